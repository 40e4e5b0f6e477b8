"""`meltano state export`, `import` and `edit` against the gateway, in bulk
requests, and moving state to statehouse from another backend."""

from __future__ import annotations

import json
import os
import stat
import uuid
from pathlib import Path

from conftest import Gateway, Project, make_project, start_gateway, stop_gateway


def requests_to(gateway: Gateway, method: str, route: str) -> int:
    """Requests the gateway answered for one route, by its own /metrics."""
    metrics = gateway.session.get(f"{gateway.base}/metrics", timeout=10).text
    prefix = f'statehouse_http_requests_total{{method="{method}",route="{route}",'
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in metrics.splitlines() if line.startswith(prefix))


def test_export_then_import_into_an_empty_gateway_round_trips_exactly(tmp_path: Path, project: Project, gateway: Gateway):
    gateway.put("dev:a", {"completed": {"singer_state": {"bookmarks": {"s": {"v": 1.5}}}}, "partial": {}})
    gateway.put("dev:b", {"completed": {}, "partial": {"singer_state": {"bookmarks": {"s": {"v": "x"}}}}})
    gateway.put("dev:c", {"completed": {"k": [1, 2]}, "partial": {"singer_state": {"p": True}}})
    exported = project.meltano("state", "export").stdout.strip().splitlines()[-1]
    data = json.loads(exported)
    assert set(data) == {"dev:a", "dev:b", "dev:c"}
    assert requests_to(gateway, "GET", "/v1/states/{state_id}") == 0, "one listing, not a GET per state"

    empty = start_gateway(f"shim_{uuid.uuid4().hex}")
    try:
        target = make_project(tmp_path / "target", empty.uri)
        dump = tmp_path / "state.json"
        dump.write_text(exported)
        target.meltano("state", "import", str(dump))
        for state_id in data:
            assert empty.state(state_id)["completed"] == gateway.state(state_id)["completed"]
            assert empty.state(state_id)["partial"] == gateway.state(state_id)["partial"], "split kept"
        again = json.loads(target.meltano("state", "export").stdout.strip().splitlines()[-1])
        assert again == data, "round trip exact"
        assert requests_to(empty, "POST", "/v1/states") == 1
        assert requests_to(empty, "PUT", "/v1/states/{state_id}") == 0
    finally:
        stop_gateway(empty)


def test_edit_with_an_editor_script(tmp_path: Path, project: Project, gateway: Gateway):
    gateway.put("job", {"completed": {"singer_state": {"bookmarks": {"s": {"v": 1}}}}})
    editor = tmp_path / "editor.py"
    editor.write_text(
        "#!/usr/bin/env python3\n"
        "import json, sys\n"
        "path = sys.argv[-1]\n"
        "state = json.load(open(path))\n"
        "state['singer_state']['bookmarks']['s']['v'] = 2\n"
        "json.dump(state, open(path, 'w'))\n"
    )
    editor.chmod(editor.stat().st_mode | stat.S_IEXEC)
    project.meltano("state", "edit", "--force", "job", extra_env={"EDITOR": str(editor), "VISUAL": str(editor)})
    assert gateway.state("job")["completed"] == {"singer_state": {"bookmarks": {"s": {"v": 2}}}}


def test_an_import_of_5000_states_takes_one_request(tmp_path: Path, project: Project, gateway: Gateway):
    data = {
        f"dev:job-{n:04}": {"completed": {"singer_state": {"bookmarks": {"s": {"n": n}}}}, "partial": {}}
        for n in range(5000)
    }
    dump = tmp_path / "many.json"
    dump.write_text(json.dumps(data))
    project.meltano("state", "import", str(dump), timeout=300)
    assert requests_to(gateway, "POST", "/v1/states") == 1
    assert requests_to(gateway, "PUT", "/v1/states/{state_id}") == 0
    assert len(gateway.state_ids("dev:job-*")) == 1000, "a page of the listing"
    assert gateway.state("dev:job-4999")["completed"]["singer_state"]["bookmarks"]["s"]["n"] == 4999


def test_moving_from_meltanos_systemdb_to_statehouse(tmp_path: Path, gateway: Gateway):
    # A project on Meltano's default backend (its system database), with state.
    old = make_project(tmp_path / "old", "systemdb")
    old.env.pop("MELTANO_STATE_BACKEND_URI")
    old.meltano("state", "set", "--force", "dev:tap-x-to-target-y", json.dumps({"singer_state": {"bookmarks": {"x": {"v": 7}}}}))
    old.meltano("state", "set", "--force", "prod:tap-x-to-target-y", json.dumps({"singer_state": {"bookmarks": {"x": {"v": 8}}}}))
    exported = old.meltano("state", "export").stdout.strip().splitlines()[-1]
    dump = tmp_path / "from-systemdb.json"
    dump.write_text(exported)
    new = make_project(tmp_path / "new", gateway.uri)
    new.meltano("state", "import", str(dump))
    assert gateway.state("dev:tap-x-to-target-y")["completed"] == {"singer_state": {"bookmarks": {"x": {"v": 7}}}}
    assert new.state_get("prod:tap-x-to-target-y") == {"singer_state": {"bookmarks": {"x": {"v": 8}}}}
    assert os.path.exists(tmp_path / "old" / ".meltano"), "the old project kept its own state"
