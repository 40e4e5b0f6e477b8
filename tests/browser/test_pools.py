"""The Pools view, in a real headless Chromium at a phone's and a desktop's
size, against pool leases taken through the API of a real gateway: each
pool's fill and waiters, each holder with its owner and info shown as text,
and every row whole on a phone."""

from __future__ import annotations

import threading
import time
import uuid
from urllib.parse import quote

from playwright.sync_api import expect

from conftest import HOLDER_INFO, Gateway, start_gateway, stop, use_token
from test_holder import rows_outside
from test_pictures import shot, watch


def take(gateway: Gateway, pool: str, owner: str, limit: int, info: dict, token: str | None = None) -> dict:
    """A lease on one of `pool`'s slots, held long past the test."""
    reply = gateway.call("POST", f"/v1/pools/{quote(pool, safe='')}", token=token,
                         json={"owner": owner, "limit": limit, "ttl_seconds": 600, "info": info})
    assert reply.status_code == 201, reply.text
    return reply.json()


def test_both_holders_show_with_their_owner_and_info_and_each_row_is_whole(page, gateway: Gateway):
    seen = watch(page, gateway)
    pool = "prod:warehouse-source-db"
    first = take(gateway, pool, "etl-1:4242", 2, HOLDER_INFO)
    second = take(gateway, pool, "etl-2:77", 2, {"host": "etl-2", "pid": 77, "dag": "nightly"})
    page.goto(gateway.base + "/#/pools")
    row = page.locator(f'[data-testid="pool-row"][data-pool="{pool}"]')
    expect(row.get_by_test_id("held")).to_have_text("2 / 2 (full)")
    expect(row.get_by_test_id("waiting")).to_have_text("0")
    section = page.locator(f'[data-testid="pool"][data-pool="{pool}"]')
    expect(section.get_by_test_id("pool-holder-row")).to_have_count(2)
    # The lease answer has no gateway; the pool's own view names the one that granted it.
    view = gateway.call("GET", f"/v1/pools/{quote(pool, safe='')}").json()
    granted_by = {h["fencing_token"]: h["gateway_id"] for h in view["holders"]}
    for lease in (first, second):
        holder = section.locator(f'[data-testid="pool-holder-row"][data-fencing-token="{lease["fencing_token"]}"]')
        expect(holder.get_by_test_id("holder-owner")).to_have_text(lease["owner"])
        expect(holder).to_contain_text(lease["acquired_at"])
        expect(holder).to_contain_text(lease["expires_at"])
        expect(holder).to_contain_text(granted_by[lease["fencing_token"]])
    info = section.locator(f'[data-testid="pool-holder-row"][data-fencing-token="{first["fencing_token"]}"]') \
        .get_by_test_id("holder-info")
    expect(info.locator('dd[data-key="host"]')).to_have_text("etl-1")
    expect(info.locator('dd[data-key="pid"]')).to_have_text("4242")
    expect(info.locator('dd[data-key="command"]')).to_have_text(HOLDER_INFO["command"])
    # Markup in info is text: shown as sent, and never an element.
    expect(info.locator('dd[data-key="note"]')).to_have_text(HOLDER_INFO["note"])
    expect(page.get_by_test_id("injected")).to_have_count(0)
    other = section.locator(f'[data-testid="pool-holder-row"][data-fencing-token="{second["fencing_token"]}"]')
    expect(other.locator('dd[data-key="dag"]')).to_have_text("nightly")
    # Each row is whole: no row reaches past the window, and nothing scrolls sideways.
    for selector in ['[data-testid="pools"] tr', '[data-testid="pool-holders"] tr']:
        assert rows_outside(page, selector) == [], selector
    assert page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
    header = section.locator('[data-testid="pool-holders"] thead')
    if page.viewport_size["width"] > 640:
        expect(header).to_be_visible()
    else:
        # A phone shows cards, each cell under its column's name.
        expect(header).to_be_hidden()
        owner = section.get_by_test_id("holder-owner").first
        assert page.evaluate("(e) => getComputedStyle(e, '::before').content", owner.element_handle()) == '"Owner"'
    assert seen["errors"] == [], seen["errors"]
    assert seen["hosts"] == {gateway.base.removeprefix("http://")}, seen["hosts"]
    shot(page, "pools")


def waiting_behind(gateway: Gateway, pool: str, holder: dict) -> threading.Thread:
    """A second acquire, waiting in the gateway until `holder`'s lease is
    released; it gives up (409) before the client's own 10 s timeout would."""
    waiter = threading.Thread(target=lambda: gateway.call(
        "POST", f"/v1/pools/{pool}", json={"owner": "etl-2:77", "limit": 1, "ttl_seconds": 600, "wait_seconds": 8}))
    waiter.start()
    deadline = time.monotonic() + 5
    while gateway.call("GET", f"/v1/pools/{pool}").json()["waiting"] != 1:
        if time.monotonic() > deadline:
            gateway.call("DELETE", f"/v1/pools/{pool}/{holder['lease_id']}")
            waiter.join()
            raise AssertionError("the second acquire never waited")
        time.sleep(0.1)
    return waiter


def test_a_waiting_acquire_is_counted(page, gateway: Gateway):
    pool = "api-quota"
    held = take(gateway, pool, "etl-1:4242", 1, {"host": "etl-1"})
    waiter = waiting_behind(gateway, pool, held)
    try:
        page.goto(gateway.base + "/#/pools")
        row = page.locator(f'[data-testid="pool-row"][data-pool="{pool}"]')
        expect(row.get_by_test_id("waiting")).to_have_text("1 (priority 0)")
        expect(row.get_by_test_id("held")).to_have_text("1 / 1 (full)")
    finally:
        gateway.call("DELETE", f"/v1/pools/{pool}/{held['lease_id']}")
        waiter.join()
    # The release handed the slot on; the view read again shows the new holder.
    page.reload()
    expect(page.locator(f'[data-testid="pool"][data-pool="{pool}"]').get_by_test_id("holder-owner")).to_have_text("etl-2:77")
    expect(row.get_by_test_id("waiting")).to_have_text("0")


def test_the_waiters_show_through_a_gateway_that_is_not_the_pools_authority(page):
    schema = f"browser_{uuid.uuid4().hex}"
    authority = start_gateway(schema=schema)
    other = start_gateway(schema=schema)
    try:
        pool = "shared-source-db"
        held = take(authority, pool, "etl-1:4242", 1, {"host": "etl-1"})
        waiter = waiting_behind(authority, pool, held)
        try:
            # Acquires wait at the authority: the other gateway's listing
            # cannot count them, the pool's own GET (forwarded) can.
            page.goto(other.base + "/#/pools")
            row = page.locator(f'[data-testid="pool-row"][data-pool="{pool}"]')
            expect(row.get_by_test_id("waiting")).to_have_text("1 (priority 0)")
            expect(page.get_by_test_id("holder-owner")).to_have_text("etl-1:4242")
        finally:
            authority.call("DELETE", f"/v1/pools/{pool}/{held['lease_id']}")
            waiter.join()
    finally:
        stop(other)
        stop(authority)


def test_the_slots_used_and_the_waiters_by_priority_show(page, gateway: Gateway):
    pool = "shared-warehouse"
    path = f"/v1/pools/{pool}"
    held = gateway.call("POST", path, json={"owner": "backfill", "limit": 4, "slots": 3, "ttl_seconds": 600})
    assert held.status_code == 201, held.text
    held = held.json()
    # Two waiters that do not fit beside the 3 slots, the higher priority second.
    waiters = [threading.Thread(target=lambda body=body: gateway.call("POST", path, json=body)) for body in (
        {"owner": "hourly-low", "limit": 4, "slots": 2, "priority": 0, "ttl_seconds": 600, "wait_seconds": 8},
        {"owner": "hourly-high", "limit": 4, "slots": 2, "priority": 10, "ttl_seconds": 600, "wait_seconds": 8},
    )]
    try:
        for n, waiter in enumerate(waiters, start=1):
            waiter.start()
            deadline = time.monotonic() + 5
            while gateway.call("GET", path).json()["waiting"] != n:
                assert time.monotonic() < deadline, "the acquire never waited"
                time.sleep(0.1)
        page.goto(gateway.base + "/#/pools")
        row = page.locator(f'[data-testid="pool-row"][data-pool="{pool}"]')
        expect(row.get_by_test_id("held")).to_have_text("3 / 4")
        expect(row.get_by_test_id("waiting")).to_have_text("2 (priority 10, 0)")
        section = page.locator(f'[data-testid="pool"][data-pool="{pool}"]')
        expect(section.get_by_test_id("holder-slots")).to_have_text("3")
        expect(section.get_by_test_id("waiter-priority")).to_have_text(["10", "0"])
        expect(section.get_by_test_id("waiter-slots")).to_have_text(["2", "2"])
        for selector in ['[data-testid="pools"] tr', '[data-testid="pool-waiters"] tr']:
            assert rows_outside(page, selector) == [], selector
    finally:
        gateway.call("DELETE", f"{path}/{held['lease_id']}")
        for waiter in waiters:
            waiter.join()


def test_without_pools_in_use_the_view_says_so(page, gateway: Gateway):
    page.goto(gateway.base + "/#/pools")
    expect(page.get_by_test_id("no-pools")).to_have_text("No pool is in use.")


SCOPED_READ = "pools-team-a-read-0123"
WRITER = "pools-writer-0123"


def test_a_scoped_token_sees_only_the_pools_in_its_scope(page):
    # The scoped entry goes last: a scope's globs continue after its commas.
    gateway = start_gateway(tokens=f"write {WRITER},read {SCOPED_READ} team-a scope=team-a:*")
    try:
        take(gateway, "team-a:db", "a-worker", 2, {"team": "a"}, token=WRITER)
        take(gateway, "team-b:db", "b-worker", 2, {"team": "b"}, token=WRITER)
        use_token(page, gateway, SCOPED_READ)
        page.goto(gateway.base + "/#/pools")
        expect(page.get_by_test_id("pool-row")).to_have_count(1)
        expect(page.locator('[data-testid="pool-row"][data-pool="team-a:db"]')).to_have_count(1)
        expect(page.get_by_test_id("holder-owner")).to_have_text("a-worker")
        expect(page.get_by_text("b-worker")).to_have_count(0)
    finally:
        stop(gateway)
