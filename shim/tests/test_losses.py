"""Bookmarks that go away, with the real `meltano` CLI: refused by a gateway
in reject mode (Meltano's output names the stream, nothing is written), and
let through by the shim's allow_loss setting."""

from __future__ import annotations

import json
import uuid

import pytest

from conftest import Gateway, make_project, start_gateway, stop_gateway

JOB = "dev:tap-tiny-to-target-tiny"


@pytest.fixture
def rejecting():
    gw = start_gateway(f"shim_{uuid.uuid4().hex}", extra_args=("--bookmark-loss", "reject"))
    yield gw
    stop_gateway(gw)


def bookmarks(**streams: int) -> dict:
    return {name: {"replication_key": "id", "replication_key_value": value} for name, value in streams.items()}


def state(**streams: int) -> str:
    return json.dumps({"singer_state": {"bookmarks": bookmarks(**streams)}})


def test_state_set_that_drops_a_stream_is_refused_naming_it_and_passes_with_allow_loss(tmp_path, rejecting: Gateway):
    project = make_project(tmp_path / "project", rejecting.uri)
    project.meltano("state", "set", "--force", JOB, state(numbers=5, refunds=7))
    refused = project.meltano("state", "set", "--force", JOB, state(numbers=6), check=False)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0, output
    assert "refunds" in output and "allow_loss" in output, output
    assert rejecting.state(JOB)["completed"]["singer_state"]["bookmarks"] == bookmarks(numbers=5, refunds=7), (
        "nothing written"
    )

    project.meltano(
        "state", "set", "--force", JOB, state(numbers=6),
        extra_env={"MELTANO_STATE_BACKEND_STATEHOUSE_ALLOW_LOSS": "*"},
    )
    assert rejecting.state(JOB)["completed"]["singer_state"]["bookmarks"] == bookmarks(numbers=6)


def test_the_allow_loss_setting_names_streams(tmp_path, rejecting: Gateway):
    project = make_project(tmp_path / "project", rejecting.uri)
    project.meltano("state", "set", "--force", JOB, state(numbers=5, refunds=7))
    other = project.meltano(
        "state", "set", "--force", JOB, state(refunds=7), check=False,
        extra_env={"MELTANO_STATE_BACKEND_STATEHOUSE_ALLOW_LOSS": "refunds"},
    )
    assert other.returncode != 0 and "numbers" in other.stdout + other.stderr
    project.meltano(
        "state", "set", "--force", JOB, state(refunds=7),
        extra_env={"MELTANO_STATE_BACKEND_STATEHOUSE_ALLOW_LOSS": "numbers, refunds"},
    )
    assert rejecting.state(JOB)["completed"]["singer_state"]["bookmarks"] == bookmarks(refunds=7)


def test_a_run_whose_state_drops_a_stream_is_refused_naming_it(tmp_path, rejecting: Gateway):
    project = make_project(tmp_path / "project", rejecting.uri)
    project.meltano("state", "set", "--force", JOB, state(numbers=1, refunds=7))
    failed = project.meltano("run", "tap-tiny", "target-tiny", check=False, extra_env={"TAP_TINY_COUNT": "5"})
    output = failed.stdout + failed.stderr
    # Meltano writes state from the target's output handler and logs a failed
    # write there; whether the run then exits non-zero depends on when the
    # target ends (seen both ways), so only the refusal and its naming are
    # asserted, as the regression guard's run test does.
    assert "refunds" in output and "allow_loss" in output, output
    assert rejecting.state(JOB)["completed"]["singer_state"]["bookmarks"] == bookmarks(numbers=1, refunds=7)
