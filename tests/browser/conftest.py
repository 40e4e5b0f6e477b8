"""Fixtures: a gateway process on the local ClickHouse, and the page at its
`/` in a real headless Chromium (Debian's, driven by Playwright)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
import requests
from playwright.sync_api import expect, sync_playwright

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
import gateway_process  # noqa: E402  (shared with the shim's suite)

CHROMIUM = os.environ.get("STATEHOUSE_CHROMIUM", "/usr/bin/chromium")

# An `expect` passes as soon as the page shows what it asks for; its bound
# only catches a page that never does. Playwright's 5 s default is short for
# Chromium beside a loaded machine's other work (`SCRIPTS_TEST_STRESS=1`).
expect.set_options(timeout=30_000)


@dataclass
class Gateway:
    base: str
    process: subprocess.Popen
    token: str | None = None

    def call(self, method: str, path: str, token: str | None = None, **kwargs) -> requests.Response:
        headers = kwargs.pop("headers", {})
        if token or self.token:
            headers["Authorization"] = f"Bearer {token or self.token}"
        return requests.request(method, self.base + path, headers=headers, timeout=10, **kwargs)

    def put(self, state_id: str, document: dict) -> dict:
        reply = self.call("PUT", f"/v1/states/{quote(state_id, safe='')}", json=document)
        reply.raise_for_status()
        return reply.json()


def start_gateway(tokens: str | None = None, args: tuple[str, ...] = (), schema: str | None = None) -> Gateway:
    """A gateway on a database of its own, or on `schema`, shared with other
    gateways (then it advertises its URL, so that they forward to it)."""
    shared = schema is not None
    clickhouse = os.environ.get("STATEHOUSE_TEST_CLICKHOUSE_URL")
    if not clickhouse:
        pytest.fail("STATEHOUSE_TEST_CLICKHOUSE_URL is not set: run the tests with scripts/test")
    binary = Path(os.environ.get("STATEHOUSE_BIN", ROOT / "target" / "debug" / "statehouse"))
    env = {**os.environ, "STATEHOUSE_CLICKHOUSE_URL": clickhouse, "RUST_LOG": "warn,statehouse=info"}
    if tokens:
        env["STATEHOUSE_TOKENS"] = tokens
    schema = schema or f"browser_{uuid.uuid4().hex}"

    def command(port: int) -> list[str]:
        advertise = ("--advertise-url", f"http://127.0.0.1:{port}") if shared else ()
        return [str(binary), "serve", "--listen", f"127.0.0.1:{port}", "--schema", schema,
                "--claim-settle", "200ms", *advertise, *args]

    try:
        process, port = gateway_process.spawn(command, env)
        base = f"http://127.0.0.1:{port}"
        gateway_process.await_readyz(process, f"{base}/readyz")
    except gateway_process.NotReady as err:
        pytest.fail(str(err))
    return Gateway(base=base, process=process)


def stop(gateway: Gateway) -> None:
    gateway.process.terminate()
    gateway.process.wait(timeout=30)


READ_TOKEN = "dashboard-read-token-0123"
WRITE_TOKEN = "dashboard-write-token-0123"


@pytest.fixture
def token_gateway():
    """A gateway that asks for tokens; the fixture's own calls use the write one."""
    gw = start_gateway(tokens=f"read {READ_TOKEN},write {WRITE_TOKEN}")
    gw.token = WRITE_TOKEN
    yield gw
    stop(gw)


def use_token(page, gateway: Gateway, token: str) -> None:
    """Gives the page `token` through its prompt, as a user would."""
    page.goto(gateway.base + "/")
    page.locator("#token-input").fill(token)
    page.get_by_role("button", name="Use token").click()


@pytest.fixture
def gateway():
    gw = start_gateway()
    yield gw
    stop(gw)


@pytest.fixture(scope="session")
def browser():
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            # The machine's network is closed: no background fetches.
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"],
        )
        yield chromium
        chromium.close()


@pytest.fixture(params=[(1280, 900), (390, 844)], ids=["desktop", "phone"])
def page(browser, request):
    width, height = request.param
    context = browser.new_context(viewport={"width": width, "height": height})
    tab = context.new_page()
    # Every confirmation the page asks for is accepted, and recorded.
    tab.confirmations = []

    def accept(dialog):
        tab.confirmations.append(dialog.message)
        dialog.accept()

    tab.on("dialog", accept)
    yield tab
    context.close()


# What `statehouse lock` sends, with a key of the caller's own; the note is
# markup that the page must show as text.
HOLDER_INFO = {"host": "etl-1", "pid": 4242, "command": "meltano run tap-github target-jsonl",
               "note": "<img src=x data-testid=injected>"}


def lease_history(gateway: Gateway, state_id: str, until, timeout: float = 15) -> list[dict]:
    """The id's lease history once `until(leases)` holds: lease rows reach
    ClickHouse about a second behind the lock's own answers."""
    deadline = time.monotonic() + timeout
    while True:
        leases = gateway.call("GET", f"/v1/locks/{quote(state_id, safe='')}/history").json()["leases"]
        if until(leases) or time.monotonic() > deadline:
            return leases
        time.sleep(0.2)


def forced_then_held(gateway: Gateway, state_id: str, reason: str, info: dict = HOLDER_INFO) -> dict:
    """A lease forced off `state_id` with `reason`, then a new one held with
    `info`; answers the new lease once the history shows both."""
    path = f"/v1/locks/{quote(state_id, safe='')}"
    gateway.call("POST", path, json={"owner": "stuck-worker", "ttl_seconds": 600,
                                      "info": {"host": "etl-0", "pid": 17}}).raise_for_status()
    gateway.call("DELETE", path, params={"reason": reason}).raise_for_status()
    lease = gateway.call("POST", path, json={"owner": "etl-1:4242", "ttl_seconds": 600, "lock_delay_seconds": 5,
                                             "info": info})
    lease.raise_for_status()
    leases = lease_history(gateway, state_id, lambda ls: len(ls) == 2 and ls[1]["ended_by"] == "forced")
    assert [l["ended_by"] for l in leases] == [None, "forced"], leases
    return lease.json()
