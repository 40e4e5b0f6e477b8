"""Starting a gateway process for the Python suites (the shim's and the
browser's): on a free loopback port, ready when it says so itself."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable

import requests


class NotReady(Exception):
    """The gateway did not get ready: the message says how."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(command: Callable[[int], list[str]], env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """`command(port)` started on a free port, once it logged "statehouse ready"
    (`env` must let statehouse's info lines through). Another process (a test
    beside this one) may take the port between free_port() and the bind, and
    would then answer for it: the gateway exits instead, and is started again
    on another port."""
    for _ in range(5):
        port = free_port()
        process = subprocess.Popen(command(port), env=env, stderr=subprocess.PIPE)
        logs = Logs(process)
        if not logs.ready.wait(30):
            process.kill()
            raise NotReady("statehouse was not ready within 30 s")
        if logs.said_ready:
            return process, port
        if b"Address already in use" not in logs.text():
            raise NotReady(f"statehouse exited with {process.wait()} before it was ready")
    raise NotReady("statehouse found its port taken five times")


def await_readyz(
    process: subprocess.Popen, url: str, get: Callable[..., requests.Response] = requests.get, **settings
) -> None:
    """Until the gateway's `url` (its /readyz) answers 200: its ready line
    says it listens, /readyz that it reaches ClickHouse. `get` is the suite's
    own call, with its `settings` (a session's `verify` must be given again:
    requests lets REQUESTS_CA_BUNDLE override the session's own)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise NotReady(f"statehouse exited with {process.returncode} before it was ready")
        try:
            if get(url, timeout=1, **settings).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    process.kill()
    raise NotReady("statehouse's /readyz did not answer 200 within 30 s")


class Logs:
    """A gateway's stderr, passed on to the test's own (where pytest shows it)
    line by line; `ready` is set at its "statehouse ready" line or its exit.
    Only the lines before that are kept: `spawn` reads them to tell a taken
    port from another failure, and a gateway logs for as long as its test."""

    def __init__(self, process: subprocess.Popen):
        self.lines: list[bytes] = []
        self.ready = threading.Event()
        self.said_ready = False
        threading.Thread(target=self._drain, args=(process.stderr,), daemon=True).start()

    def _drain(self, stderr) -> None:
        for line in stderr:
            os.write(2, line)
            if self.said_ready:
                continue
            self.lines.append(line)
            if b"statehouse ready" in line:
                self.said_ready = True
                self.ready.set()
        self.ready.set()

    def text(self) -> bytes:
        return b"".join(self.lines)
