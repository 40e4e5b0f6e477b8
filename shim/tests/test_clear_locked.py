"""`meltano state clear --all` says which states it left because other
clients hold their leases (the gateway's `skipped_locked` and `locked`).

A small HTTP server stands in for the gateway's answer to the pattern
delete, and for one from before that answer had those fields.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import make_project
from statehouse_meltano.backend import StatehouseStateStoreManager


@pytest.fixture
def gateway():
    """Answers DELETE /v1/states with the body it is given; records the requests."""
    state: dict = {"answer": {}, "requests": []}

    class Handler(BaseHTTPRequestHandler):
        def do_DELETE(self) -> None:  # noqa: N802 - the stdlib's name
            state["requests"].append(f"DELETE {self.path}")
            body = json.dumps(state["answer"]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state["uri"] = f"statehouse://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()


def clear_all(gateway: dict, answer: dict, caplog: pytest.LogCaptureFixture) -> tuple[int, list[str]]:
    gateway["answer"] = answer
    manager = StatehouseStateStoreManager(gateway["uri"])
    with caplog.at_level(logging.WARNING, logger="statehouse_meltano"):
        cleared = manager.clear_all()
    manager.close()
    return cleared, [record.getMessage() for record in caplog.records]


def test_the_states_left_for_their_leases_are_named(gateway, caplog) -> None:
    cleared, messages = clear_all(gateway, {"deleted": 3, "skipped_locked": 2, "locked": ["a", "b"]}, caplog)
    assert cleared == 3
    assert messages == ["statehouse: 2 states were not cleared, their leases are held: a, b"]
    assert gateway["requests"] == ["DELETE /v1/states?pattern=%2A"]


def test_past_the_hundred_named_the_rest_are_counted(gateway, caplog) -> None:
    named = [f"job-{i}" for i in range(100)]
    _, messages = clear_all(gateway, {"deleted": 0, "skipped_locked": 150, "locked": named}, caplog)
    assert messages == [
        f"statehouse: 150 states were not cleared, their leases are held: {', '.join(named)} and 50 more"
    ]


def test_one_state_left_and_an_id_with_control_characters(gateway, caplog) -> None:
    _, messages = clear_all(gateway, {"deleted": 0, "skipped_locked": 1, "locked": ["x\n\x1b[2J"]}, caplog)
    assert messages == ["statehouse: 1 state was not cleared, its lease is held: 'x\\n\\x1b[2J'"]


@pytest.mark.parametrize(
    "answer",
    [{"deleted": 4}, {"deleted": 4, "skipped_locked": 0, "locked": []}, {"deleted": 4, "locked": None}],
    ids=["older-gateway", "none-locked", "null-list"],
)
def test_nothing_is_said_when_nothing_was_left(gateway, caplog, answer: dict) -> None:
    assert clear_all(gateway, answer, caplog) == (4, [])


def test_meltano_state_clear_all_prints_them(tmp_path, gateway) -> None:
    gateway["answer"] = {"deleted": 1, "skipped_locked": 2, "locked": ["dev:tap-a-to-target-b", "nightly"]}
    project = make_project(tmp_path / "p", gateway["uri"])
    result = project.meltano("state", "clear", "--force", "--all")
    assert (
        "statehouse: 2 states were not cleared, their leases are held: dev:tap-a-to-target-b, nightly"
        in result.stderr
    ), result.stderr
    assert "1 state(s) were successfully cleared" in result.stderr, result.stderr
