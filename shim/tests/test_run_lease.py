"""`statehouse lock JOB -- meltano ...`: one run of a pipeline at a time,
with the real meltano CLI under the gateway's own runner."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import quote

import pytest
from meltano.core.state_store.base import MeltanoState

from conftest import MELTANO, Gateway, Project, lock_prefix, statehouse_bin
from statehouse_meltano.backend import StatehouseStateStoreManager
from test_run import JOB, bookmark, received_states, records

SAMPLE = re.compile(r'^statehouse_http_requests_total\{method="(\w+)",route="([^"]+)",status="(\d+)"\} (\S+)$')
STATE = "/v1/states/{state_id}"
LOCK = "/v1/locks/{state_id}"
LEASE = "/v1/locks/{state_id}/{lease_id}"
SLOW = {"TAP_TINY_COUNT": "1000", "TAP_TINY_DELAY": "0.05"}


def lock(gateway: Gateway, *flags: str) -> list[str]:
    return lock_prefix(gateway.base, JOB, *flags)


def served(gateway: Gateway) -> Counter:
    """API requests the gateway answered, by (method, route, status), from its /metrics."""
    counts: Counter = Counter()
    for line in gateway.session.get(f"{gateway.base}/metrics", timeout=10).text.splitlines():
        if match := SAMPLE.match(line):
            method, route, status, value = match.groups()
            counts[method, route, int(status)] = int(float(value))
    return counts


def lock_view(gateway: Gateway, state_id: str = JOB) -> dict | None:
    response = gateway.session.get(f"{gateway.base}/v1/locks/{quote(state_id, safe='')}", timeout=10)
    return response.json() if response.status_code == 200 else None


def wait_for(what: str, check, within: float = 120) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"{what} within {within} s"
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, but for the runner's own: its
    watchdog, or a fork of it that has not yet become the command."""
    runner = os.path.realpath(statehouse_bin())
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                program = os.path.realpath(entry / "exe")
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and program != runner:
                found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid`: for meltano, its tap and target among them."""
    found = children(pid)
    for child in list(found):
        found.extend(descendants(child))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_the_backend_rides_on_the_run_lease_for_its_state_id_only(gateway: Gateway, monkeypatch: pytest.MonkeyPatch):
    lease = gateway.session.post(
        f"{gateway.base}/v1/locks/run", json={"owner": "the-runner", "ttl_seconds": 30}, timeout=10
    ).json()
    monkeypatch.setenv("STATEHOUSE_LEASE_STATE_ID", "run")
    monkeypatch.setenv("STATEHOUSE_LEASE_ID", lease["lease_id"])
    manager = StatehouseStateStoreManager(uri=gateway.uri, owner="meltano")
    with manager.acquire_lock("run", retry_seconds=1):
        assert lock_view(gateway, "run")["owner"] == "the-runner", "no lease of its own"
        manager.update(MeltanoState(state_id="run", partial_state={"singer_state": {"a": {"x": 1}}}))
    manager.update(MeltanoState(state_id="run", partial_state={"singer_state": {"a": {"y": 2}, "b": 3}}))
    # Through the manager: its reads wait for the writes behind it.
    assert manager.get("run").partial_state == {"singer_state": {"a": {"x": 1, "y": 2}, "b": 3}}, "Meltano's merge"
    manager.update(MeltanoState(state_id="run", completed_state={"singer_state": {"done": True}}))
    assert manager.get("run").completed_state == {"singer_state": {"done": True}}
    assert manager.get("run").partial_state == {}, "a complete state replaces"
    assert lock_view(gateway, "run")["owner"] == "the-runner", "the block left the run's lease alone"
    # Another state_id is locked as without a run lease.
    with manager.acquire_lock("other", retry_seconds=1):
        assert lock_view(gateway, "other")["owner"] == "meltano"
    assert lock_view(gateway, "other") is None
    manager.update(MeltanoState(state_id="other", partial_state={"n": 1}))
    assert manager.get("other").partial_state == {"n": 1}
    manager.close()


def test_under_a_run_lease_each_bookmark_is_at_most_one_request_and_meltano_takes_no_lock(project: Project, gateway: Gateway):
    before = served(gateway)
    run = project.meltano("run", "tap-tiny", "target-tiny", prefix=lock(gateway), extra_env={"TAP_TINY_COUNT": "7"})
    output = run.stdout + run.stderr
    assert output.count("Incremental state has been updated") == 7, output
    assert bookmark(gateway) == 7
    sent = served(gateway) - before
    writes = sum(n for (method, route, _), n in sent.items() if route == STATE and method in ("PUT", "PATCH", "DELETE"))
    assert 1 <= writes <= 7, sent
    # The runner's own acquire and release (and renewals, should the run
    # outlast a third of the TTL, and its looks at the lease between them,
    # GETs), and nothing from Meltano: its lock blocks ride on the run's lease.
    locking = {key: n for key, n in sent.items() if key[1] in (LOCK, LEASE) and key[0] not in ("PUT", "GET")}
    assert locking == {("POST", LOCK, 201): 1, ("DELETE", LEASE, 204): 1}, sent
    assert lock_view(gateway) is None, "released when meltano ended"


def test_a_second_run_leaves_at_once_or_waits_and_goes_on_from_the_first_runs_bookmark(
    project: Project, gateway: Gateway
):
    first = project.popen(
        "run", "tap-tiny", "target-tiny",
        prefix=lock(gateway),
        extra_env={"TAP_TINY_COUNT": "30", "TAP_TINY_DELAY": "0.1", "TAP_TINY_RUN": "first"},
    )
    try:
        wait_for("the first run holds the lease", lambda: bookmark(gateway) is not None)
        # It left at once, without waiting for the lease (75, nothing run):
        # how soon is the machine's speed.
        busy = project.meltano("run", "tap-tiny", "target-tiny", prefix=lock(gateway), check=False)
        assert busy.returncode == 75, busy.stderr
        assert f"{JOB} is locked by " in busy.stderr and " since " in busy.stderr and " until " in busy.stderr
        assert "nothing was run" in busy.stderr

        second = project.popen(
            "run", "tap-tiny", "target-tiny",
            prefix=lock(gateway, "--wait", "120s"),
            extra_env={"TAP_TINY_COUNT": "5", "TAP_TINY_RUN": "second"},
        )
        out, _ = first.communicate(timeout=180)
        assert first.returncode == 0, out
        out, _ = second.communicate(timeout=180)
        assert second.returncode == 0, out
    finally:
        for run in (first,):
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
    given = received_states(project)
    assert len(given) == 2, "the busy run never started meltano"
    assert given[0] == {}
    assert given[1]["bookmarks"]["numbers"]["last_id"] == 30, "the second ran after the first, from its bookmark"
    assert records(project) == list(range(1, 36)), "what both emitted, in order"
    stored = gateway.state(JOB)["completed"]["singer_state"]
    assert stored["bookmarks"]["numbers"]["last_id"] == 35
    assert stored["run"] == "second"


def test_a_force_unlock_stops_the_run_and_none_of_its_writes_land_after_it(project: Project, gateway: Gateway):
    run = subprocess.Popen(
        [*lock(gateway, "--ttl", "3s", "--grace", "10s"), str(MELTANO), "run", "tap-tiny", "target-tiny"],
        cwd=project.root,
        env={**project.env, **SLOW},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lost_at: list[float] = []
    stderr: list[str] = []

    def read() -> None:
        for line in run.stderr:
            stderr.append(line)
            if "lost the lease" in line:
                lost_at.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for("progress", lambda: (bookmark(gateway) or 0) >= 5)
        # Just after a renewal, so that the run writes for most of a third
        # of the TTL with a lease that is gone.
        expiry = lock_view(gateway)["expires_at"]
        wait_for("a renewal", lambda: lock_view(gateway)["expires_at"] != expiry, within=5)
        before = served(gateway)
        unlocked = gateway.session.delete(f"{gateway.base}/v1/locks/{quote(JOB, safe='')}", timeout=10)
        assert unlocked.status_code == 204
        unlocked_at = time.monotonic()
        # A write the gateway let through just before the force-unlock may
        # still be finishing; every one checked after it is refused.
        time.sleep(0.3)
        left = bookmark(gateway)
        assert run.wait(timeout=60) == 76, "".join(stderr)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    reader.join(timeout=10)
    assert len(lost_at) == 1, "".join(stderr)
    # The next renewal (a third of the TTL, 1 s, after the last) finds the
    # lease gone, and SIGTERM goes out with that line; unless meltano, its
    # write refused, has ended by itself before, and the release finds it gone.
    # Within a second or so; a loaded machine has taken 2.2 s, so the bound
    # here only catches a runner that never notices (no write landed after
    # the force-unlock either way: checked below).
    assert lost_at[0] - unlocked_at < 20, f"{lost_at[0] - unlocked_at:.2f} s"
    assert bookmark(gateway) == left, "no write landed after the force-unlock"
    refused = served(gateway) - before
    assert refused["PATCH", STATE, 409] >= 1, f"its writes were refused: {refused}"


def test_kill_9_of_the_runner_ends_meltano_and_the_lease_ends_by_its_ttl(project: Project, gateway: Gateway):
    run = project.popen("run", "tap-tiny", "target-tiny", prefix=lock(gateway, "--ttl", "3s"), extra_env=SLOW)
    try:
        wait_for("progress", lambda: (bookmark(gateway) or 0) >= 5)
        [meltano] = children(run.pid)
        tree = [meltano, *descendants(meltano)]
        assert len(tree) >= 3, f"meltano runs a tap and a target: {tree}"
        os.kill(run.pid, signal.SIGKILL)
        run.wait(timeout=10)
        # Bounds only a hang reaches: nothing renews the 3 s lease now, and
        # the watchdog's SIGKILL comes at most 5 s after its SIGTERM.
        wait_for("meltano dies with its runner", lambda: not alive(meltano), within=20)
        wait_for("the tap and target die too", lambda: not any(alive(pid) for pid in tree), within=20)
        wait_for("the lease lapses by its TTL", lambda: lock_view(gateway) is None, within=20)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    left = bookmark(gateway)
    # Meltano's own record of the killed run still says "running": --force
    # skips that check, the lease is the guard. The killed run's lock-delay
    # (its default, 2 s + --grace + 5 s) keeps the next one waiting until it ends.
    resumed = project.meltano(
        "run",
        "--force",
        "tap-tiny",
        "target-tiny",
        prefix=lock(gateway, "--wait", "60s"),
        extra_env={"TAP_TINY_COUNT": "3"},
    )
    assert "Failed to persist" not in resumed.stdout + resumed.stderr, resumed.stderr
    assert received_states(project)[-1]["bookmarks"]["numbers"]["last_id"] == left
    assert bookmark(gateway) == left + 3


def test_meltanos_exit_status_comes_back_through_the_runner(project: Project, gateway: Gateway):
    # 0 and 3: `meltano invoke` exits with its plugin's code.
    for code in (0, 3):
        result = project.meltano(
            "invoke", "tap-tiny", prefix=lock(gateway), check=False, extra_env={"TAP_TINY_EXIT": str(code)}
        )
        assert result.returncode == code, result.stderr
    # A signal: meltano killed with SIGKILL is 128 + 9, and the lease goes.
    run = project.popen("invoke", "tap-tiny", prefix=lock(gateway), extra_env=SLOW)
    try:
        wait_for("meltano starts the tap", lambda: (project.root / "tap.log").exists())
        wait_for("meltano's child", lambda: children(run.pid) != [])
        [meltano] = children(run.pid)
        os.kill(meltano, signal.SIGKILL)
        assert run.wait(timeout=30) == 128 + signal.SIGKILL
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert lock_view(gateway) is None
