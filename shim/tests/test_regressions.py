"""Bookmarks that go backwards, with the real `meltano` CLI: recorded in
warn mode, refused in reject mode (Meltano's output names the stream), and
let through by the shim's allow_regression setting."""

from __future__ import annotations

import json
import uuid
from urllib.parse import quote

import pytest

from conftest import Gateway, Project, make_project, start_gateway, stop_gateway

JOB = "dev:tap-tiny-to-target-tiny"


@pytest.fixture
def rejecting():
    gw = start_gateway(f"shim_{uuid.uuid4().hex}", extra_args=("--bookmark-regression", "reject"))
    yield gw
    stop_gateway(gw)


def newest_version(gateway: Gateway) -> dict:
    history = gateway.session.get(f"{gateway.base}/v1/states/{quote(JOB, safe='')}/history", timeout=10).json()
    return history["versions"][0]


def bookmark(n: int) -> str:
    return json.dumps({"singer_state": {"bookmarks": {"numbers": {"replication_key": "id", "replication_key_value": n}}}})


def test_a_tap_emitting_an_older_bookmark_is_recorded_as_a_regression(project: Project, gateway: Gateway):
    project.meltano("run", "tap-tiny", "target-tiny", extra_env={"TAP_TINY_COUNT": "5"})
    assert newest_version(gateway)["regressed_streams"] == []
    project.meltano("run", "tap-tiny", "target-tiny", extra_env={"TAP_TINY_COUNT": "1", "TAP_TINY_START": "2"})
    assert newest_version(gateway)["regressed_streams"] == ["numbers"]


def test_in_reject_mode_the_runs_state_write_is_refused_naming_the_stream(tmp_path, rejecting: Gateway):
    project = make_project(tmp_path / "project", rejecting.uri)
    project.meltano("run", "tap-tiny", "target-tiny", extra_env={"TAP_TINY_COUNT": "5"})
    failed = project.meltano(
        "run", "tap-tiny", "target-tiny", check=False, extra_env={"TAP_TINY_COUNT": "1", "TAP_TINY_START": "2"}
    )
    output = failed.stdout + failed.stderr
    assert "bookmark" in output.lower() and "numbers" in output, output
    stored = rejecting.state(JOB)
    merged = {**stored["completed"], **stored["partial"]}
    assert merged["singer_state"]["bookmarks"]["numbers"]["replication_key_value"] == 5, "nothing written"


def test_a_runs_last_state_refused_behind_it_fails_the_run_naming_the_lost_state(tmp_path, rejecting: Gateway):
    project = make_project(tmp_path / "project", rejecting.uri)
    project.meltano("run", "tap-tiny", "target-tiny", extra_env={"TAP_TINY_COUNT": "5"})
    # One STATE message, so its refused write is the run's last: no later
    # update() reports it, the exit check does.
    failed = project.meltano(
        "run", "tap-tiny", "target-tiny", check=False, extra_env={"TAP_TINY_COUNT": "1", "TAP_TINY_START": "2"}
    )
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert f"statehouse: the last state of {JOB!r} was not saved:" in failed.stderr, failed.stderr
    assert "numbers" in failed.stderr.split("was not saved:", 1)[1], failed.stderr
    assert rejecting.state(JOB)["completed"]["singer_state"]["bookmarks"]["numbers"]["replication_key_value"] == 5


def test_state_set_of_an_older_bookmark_is_refused_and_passes_with_the_allow_setting(tmp_path, rejecting: Gateway):
    project = make_project(tmp_path / "project", rejecting.uri)
    project.meltano("state", "set", "--force", JOB, bookmark(10))
    refused = project.meltano("state", "set", "--force", JOB, bookmark(3), check=False)
    assert refused.returncode != 0
    assert "allow_regression" in refused.stdout + refused.stderr
    project.meltano(
        "state", "set", "--force", JOB, bookmark(3),
        extra_env={"MELTANO_STATE_BACKEND_STATEHOUSE_ALLOW_REGRESSION": "numbers"},
    )
    assert rejecting.state(JOB)["completed"]["singer_state"]["bookmarks"]["numbers"]["replication_key_value"] == 3
