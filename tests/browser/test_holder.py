"""Who holds it (issue 37), on a state's page in a real headless Chromium
at a phone's and a desktop's size: the holder with its info, the lock's
past leases with how each ended, and both history tables whole on a phone."""

from __future__ import annotations

from urllib.parse import quote

from playwright.sync_api import expect

from conftest import HOLDER_INFO, READ_TOKEN, Gateway, forced_then_held, lease_history, start_gateway, stop, use_token
from test_pictures import regressed_state, shot


def test_the_holder_shows_with_its_info_as_text(page, gateway: Gateway):
    gateway.put("dev:held", {"completed": {}})
    lease = forced_then_held(gateway, "dev:held", "stuck since Monday")
    page.goto(gateway.base + "/#/state/" + quote("dev:held", safe=""))
    holder = page.get_by_test_id("lock-holder")
    expect(holder.get_by_test_id("holder-owner")).to_have_text("etl-1:4242")
    expect(holder.get_by_test_id("holder-token")).to_have_text(str(lease["fencing_token"]))
    expect(holder).to_contain_text(lease["acquired_at"])
    expect(holder).to_contain_text(lease["expires_at"])
    expect(holder).to_contain_text("5 s")
    info = holder.get_by_test_id("holder-info")
    expect(info.locator('dd[data-key="host"]')).to_have_text("etl-1")
    expect(info.locator('dd[data-key="pid"]')).to_have_text("4242")
    expect(info.locator('dd[data-key="command"]')).to_have_text(HOLDER_INFO["command"])
    # Markup in info is text: shown as sent, and never an element.
    expect(info.locator('dd[data-key="note"]')).to_have_text(HOLDER_INFO["note"])
    expect(page.get_by_test_id("injected")).to_have_count(0)
    # The running lease heads the lock's history.
    newest = page.get_by_test_id("lease-row").first
    expect(newest).to_have_attribute("data-fencing-token", str(lease["fencing_token"]))
    expect(newest.get_by_test_id("ended-by")).to_have_text("running")
    expect(newest.locator('dd[data-key="host"]')).to_have_text("etl-1")


def test_a_force_unlock_from_the_page_shows_forced_its_actor_and_reason(page, gateway: Gateway):
    gateway.put("dev:stuck", {"completed": {}})
    path = "/v1/locks/" + quote("dev:stuck", safe="")
    lease = gateway.call("POST", path, json={"owner": "stuck-worker", "ttl_seconds": 600, "info": HOLDER_INFO}).json()
    page.goto(gateway.base + "/#/state/" + quote("dev:stuck", safe=""))
    reason = "tap hung on <b>orders</b> & was killed"
    page.get_by_test_id("unlock-reason").fill(reason)
    page.get_by_test_id("force-unlock").click()
    expect(page.get_by_test_id("lock-holder")).to_have_count(0)
    assert page.confirmations and "dev:stuck" in page.confirmations[0]
    assert gateway.call("GET", path).status_code == 404
    # The lease row reaches ClickHouse a moment later; then the page shows it.
    leases = lease_history(gateway, "dev:stuck", lambda ls: ls and ls[0]["ended_by"] == "forced")
    assert leases[0]["reason"] == reason and leases[0]["actor"] == "anonymous", leases
    page.reload()
    row = page.locator(f'[data-testid="lease-row"][data-fencing-token="{lease["fencing_token"]}"]')
    expect(row.get_by_test_id("ended-by")).to_have_text("forced")
    expect(row.get_by_test_id("forced-actor")).to_have_text("anonymous")
    expect(row.get_by_test_id("forced-reason")).to_have_text(reason)
    expect(row.locator("b")).to_have_count(0)
    shot(page, "lease-history")


def rows_outside(page, selector: str) -> list[dict]:
    """The rows matching `selector` that reach past the window's width."""
    return page.evaluate(
        """(selector) => [...document.querySelectorAll(selector)]
             .map((row) => ({ text: row.textContent.slice(0, 60), box: row.getBoundingClientRect().toJSON() }))
             .filter(({ box }) => box.left < 0 || box.right > window.innerWidth)""",
        selector)


def test_each_row_of_both_histories_is_whole_without_scrolling_sideways(page, gateway: Gateway):
    versions = regressed_state(gateway, "prod:warehouse-orders-nightly")
    forced_then_held(gateway, "prod:warehouse-orders-nightly", "the replica was rebuilt under the tap")
    page.goto(gateway.base + "/#/state/" + quote("prod:warehouse-orders-nightly", safe=""))
    expect(page.get_by_test_id("version-row")).to_have_count(len(versions))
    expect(page.get_by_test_id("lease-row")).to_have_count(2)
    for selector in ['[data-testid="history"] tr', '[data-testid="lease-history"] tr']:
        assert rows_outside(page, selector) == [], selector
    assert page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
    rollback = page.get_by_test_id("rollback").first
    rollback.scroll_into_view_if_needed()
    box = rollback.bounding_box()
    width = page.evaluate("() => window.innerWidth")
    assert box and 0 <= box["x"] and box["x"] + box["width"] <= width, (box, width)
    assert page.evaluate("() => window.scrollX") == 0
    # Each row is whole: its actor is on screen with it, not a scroll away.
    actor = page.get_by_test_id("version-row").first.get_by_test_id("actor")
    actor_box = actor.bounding_box()
    assert actor_box and actor_box["x"] + actor_box["width"] <= width, actor_box
    # A desktop keeps the tables; a phone shows cards, each cell labelled.
    header = page.locator('[data-testid="lease-history"] thead')
    if width > 640:
        expect(header).to_be_visible()
    else:
        expect(header).to_be_hidden()
        reason = page.get_by_test_id("forced-reason").last
        assert page.evaluate("(e) => getComputedStyle(e, '::before').content", reason.element_handle()) == '"Reason"'
    shot(page, "state-histories")


def test_without_history_the_lock_history_says_so(page):
    gateway = start_gateway(args=("--history=false",))
    try:
        gateway.put("dev:no-history", {"completed": {}})
        page.goto(gateway.base + "/#/state/" + quote("dev:no-history", safe=""))
        expect(page.get_by_test_id("lease-history-off")).to_contain_text("keeps no lock history")
        expect(page.get_by_test_id("lease-row")).to_have_count(0)
    finally:
        stop(gateway)


def test_a_read_token_sees_the_holder_but_cannot_force_unlock(page, token_gateway: Gateway):
    gateway = token_gateway
    gateway.put("guarded", {"completed": {}})
    gateway.call("POST", "/v1/locks/guarded", json={"owner": "etl-1:4242", "ttl_seconds": 600, "info": HOLDER_INFO})
    use_token(page, gateway, READ_TOKEN)
    page.goto(gateway.base + "/#/state/guarded")
    expect(page.get_by_test_id("holder-info").locator('dd[data-key="host"]')).to_have_text("etl-1")
    expect(page.get_by_test_id("force-unlock")).to_be_disabled()
    expect(page.get_by_test_id("unlock-reason")).to_be_disabled()
