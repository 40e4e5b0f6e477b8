"""Who holds it (issue 37), on a state's page in a real headless Chromium
at a phone's and a desktop's size: the holder with its info, the lock's
past leases with how each ended."""

from __future__ import annotations

from urllib.parse import quote

from playwright.sync_api import expect

from conftest import HOLDER_INFO, Gateway, forced_then_held, lease_history, start_gateway, stop
from test_pictures import shot


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


def test_without_history_the_lock_history_says_so(page):
    gateway = start_gateway(args=("--history=false",))
    try:
        gateway.put("dev:no-history", {"completed": {}})
        page.goto(gateway.base + "/#/state/" + quote("dev:no-history", safe=""))
        expect(page.get_by_test_id("lease-history-off")).to_contain_text("keeps no lock history")
        expect(page.get_by_test_id("lease-row")).to_have_count(0)
    finally:
        stop(gateway)
