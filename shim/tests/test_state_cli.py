"""`meltano state ...` against the gateway, checked through the CLI and the REST API."""

from __future__ import annotations

import json
import socket
import threading

from conftest import Gateway, Project, free_port, make_project


def singer(**bookmarks) -> dict:
    return {"singer_state": {"bookmarks": bookmarks}}


def test_set_get_and_list(project: Project, gateway: Gateway):
    project.meltano("state", "set", "--force", "dev:tap-a-to-target-b", json.dumps(singer(users={"since": 1})))
    project.meltano("state", "set", "--force", "prod:tap-c-to-target-d", json.dumps(singer(orders={"since": 2})))
    project.meltano("state", "set", "--force", "odd id/with spaces", json.dumps(singer(x={"y": "ü"})))

    assert project.state_get("dev:tap-a-to-target-b") == singer(users={"since": 1})
    assert project.state_get("odd id/with spaces") == singer(x={"y": "ü"})
    stored = gateway.state("dev:tap-a-to-target-b")
    assert stored["completed"] == singer(users={"since": 1})
    assert stored["partial"] == {}

    listed = project.meltano("state", "list").stdout.splitlines()
    assert sorted(listed) == sorted(gateway.state_ids()) == sorted(
        ["dev:tap-a-to-target-b", "prod:tap-c-to-target-d", "odd id/with spaces"]
    )
    dev_only = project.meltano("state", "list", "--pattern", "dev:*").stdout.splitlines()
    assert dev_only == ["dev:tap-a-to-target-b"] == gateway.state_ids("dev:*")


def test_merge_a_state_and_from_another_id(project: Project, gateway: Gateway):
    project.meltano("state", "set", "--force", "job", json.dumps(singer(s1={"v": 1})))
    project.meltano("state", "merge", "job", json.dumps(singer(s2={"v": 2})))
    assert project.state_get("job") == singer(s1={"v": 1}, s2={"v": 2})
    stored = gateway.state("job")
    assert stored["completed"] == singer(s1={"v": 1}), "merge keeps the completed state"
    assert stored["partial"] == singer(s2={"v": 2}), "and adds a partial one"

    project.meltano("state", "set", "--force", "other", json.dumps(singer(s3={"v": 3})))
    project.meltano("state", "merge", "job", "--from-state-id", "other")
    assert project.state_get("job") == singer(s1={"v": 1}, s2={"v": 2}, s3={"v": 3})
    assert gateway.state("other")["completed"] == singer(s3={"v": 3}), "the source is untouched"


def test_copy_and_move(project: Project, gateway: Gateway):
    project.meltano("state", "set", "--force", "src", json.dumps(singer(a={"v": 1})))
    project.meltano("state", "copy", "--force", "src", "copied")
    assert project.state_get("copied") == singer(a={"v": 1})
    assert gateway.state("src") is not None

    project.meltano("state", "move", "--force", "src", "moved")
    assert project.state_get("moved") == singer(a={"v": 1})
    assert gateway.state("moved")["completed"] == singer(a={"v": 1})
    assert gateway.state("src") is None, "move clears the source"
    assert project.state_get("src") == {}


def test_clear_one_and_all(project: Project, gateway: Gateway):
    for state_id in ["one", "two", "three"]:
        project.meltano("state", "set", "--force", state_id, json.dumps(singer(k={"v": state_id})))
    project.meltano("state", "clear", "--force", "one")
    assert gateway.state("one") is None
    assert sorted(gateway.state_ids()) == ["three", "two"]
    assert project.state_get("one") == {}

    project.meltano("state", "clear", "--force", "--all")
    assert gateway.state_ids() == []
    assert project.meltano("state", "list").stdout.strip() == ""


def test_gateway_down_fails_naming_the_gateway_and_writes_nothing(tmp_path, gateway: Gateway):
    port = free_port()
    down = make_project(tmp_path / "down", f"statehouse://127.0.0.1:{port}")
    result = down.meltano("state", "set", "--force", "job", json.dumps(singer(a={"v": 1})), check=False, timeout=60)
    assert result.returncode != 0
    assert f"statehouse gateway at http://127.0.0.1:{port}" in result.stdout + result.stderr

    # A gateway that accepts but never answers: the request timeout (5 s here) ends it.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    accepted = []
    stop = threading.Event()

    def hold_connections():
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(silent.accept()[0])
            except OSError:
                pass

    holder = threading.Thread(target=hold_connections, daemon=True)
    holder.start()
    try:
        stalled = make_project(tmp_path / "stalled", f"statehouse://127.0.0.1:{silent.getsockname()[1]}")
        result = stalled.meltano("state", "get", "job", check=False, timeout=60)
        assert result.returncode != 0
        assert f"statehouse gateway at http://127.0.0.1:{silent.getsockname()[1]}" in result.stdout + result.stderr
        assert "timed out" in (result.stdout + result.stderr).lower()
    finally:
        stop.set()
        holder.join()
        for conn in accepted:
            conn.close()
        silent.close()
    assert gateway.state_ids() == [], "nothing reached the real gateway"


def test_clear_all_leaves_a_state_whose_lease_a_running_pipeline_holds(project: Project, gateway: Gateway):
    for state_id in ["running", "done"]:
        project.meltano("state", "set", "--force", state_id, json.dumps(singer(k={"v": state_id})))
    # Another client's run holds the lease on one of them.
    lease = gateway.session.post(
        f"{gateway.base}/v1/locks/running", json={"owner": "nightly-run", "ttl_seconds": 120}, timeout=10
    )
    assert lease.status_code == 201, lease.text

    result = project.meltano("state", "clear", "--force", "--all")
    assert "statehouse: 1 state was not cleared, its lease is held: running" in result.stderr, result.stderr
    assert gateway.state_ids() == ["running"]
    assert gateway.state("running")["completed"] == singer(k={"v": "running"})

    released = gateway.session.delete(f"{gateway.base}/v1/locks/running/{lease.json()['lease_id']}", timeout=10)
    assert released.status_code == 204
    project.meltano("state", "clear", "--force", "--all")
    assert gateway.state_ids() == []
