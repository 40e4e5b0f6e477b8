"""The client retries a 503 that says when to come back, and nothing else.

A small HTTP server stands in for a gateway here: what is checked is the
client's handling of answers a real gateway gives under overload or while
the gateway holding a claim is gone, which cannot be brought about on cue.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from statehouse_meltano.client import GatewayClient, GatewayUnavailableError


def problem(kind: str) -> bytes:
    return json.dumps({"type": f"urn:statehouse:problem:{kind}", "title": kind, "status": 503, "detail": kind}).encode()


class Script:
    """Answers requests from a list, then 200 with an empty state listing."""

    def __init__(self, answers: list[tuple[int, dict[str, str], bytes]]) -> None:
        self.answers = answers
        self.seen = 0


@pytest.fixture
def gateway():
    scripts: list[Script] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            script = scripts[0]
            script.seen += 1
            if script.answers:
                status, headers, body = script.answers.pop(0)
            else:
                status, headers, body = 200, {}, b'{"states": [], "next_cursor": null}'
            self.send_response(status)
            for name, value in {"Content-Type": "application/problem+json", **headers}.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def serve(answers: list[tuple[int, dict[str, str], bytes]]) -> tuple[GatewayClient, Script]:
        scripts.append(Script(answers))
        return GatewayClient(f"http://127.0.0.1:{server.server_address[1]}", timeout=5), scripts[0]

    yield serve
    server.shutdown()


@pytest.mark.parametrize("kind", ["overloaded", "authority-unreachable"])
def test_a_503_with_retry_after_is_retried(gateway, kind: str) -> None:
    client, script = gateway([(503, {"Retry-After": "1"}, problem(kind))] * 2)
    assert list(client.state_ids("*")) == []
    assert script.seen == 3


def test_a_503_from_clickhouse_is_not_retried(gateway) -> None:
    client, script = gateway([(503, {}, problem("clickhouse-unavailable"))])
    with pytest.raises(GatewayUnavailableError, match="clickhouse-unavailable"):
        list(client.state_ids("*"))
    assert script.seen == 1


def test_retries_stop_within_their_window(gateway) -> None:
    client, script = gateway([(503, {"Retry-After": "3600"}, problem("overloaded"))])
    with pytest.raises(GatewayUnavailableError, match="overloaded"):
        list(client.state_ids("*"))
    assert script.seen == 1
