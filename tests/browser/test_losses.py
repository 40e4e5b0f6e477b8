"""Bookmarks that go away, on the dashboard in a real headless Chromium: the
state page names a dropped stream as "lost" next to its name, in its
bookmarks and in its history's diff, and the Regressions view lists it."""

from __future__ import annotations

from urllib.parse import quote

from playwright.sync_api import expect

from conftest import Gateway


def bookmarks(**streams) -> dict:
    return {"completed": {"singer_state": {"bookmarks": {
        name: {"replication_key": "id", "replication_key_value": value} for name, value in streams.items()
    }}}, "partial": {}}


def lost_refunds(gateway: Gateway, state_id: str) -> list[dict]:
    return [gateway.put(state_id, bookmarks(orders=5, refunds=7)), gateway.put(state_id, bookmarks(orders=6))]


def test_the_state_page_names_the_dropped_stream_lost_next_to_its_name(page, gateway: Gateway):
    versions = lost_refunds(gateway, "dev:shop")
    page.goto(gateway.base + "/#/state/" + quote("dev:shop", safe=""))

    refunds = page.locator('[data-testid="bookmark-row"][data-stream="refunds"]')
    expect(refunds.locator("td").first).to_have_text("refunds lost")
    expect(refunds.get_by_test_id("lost")).to_have_text("lost")
    expect(refunds).to_contain_text("7")
    orders = page.locator('[data-testid="bookmark-row"][data-stream="orders"]')
    expect(orders.get_by_test_id("lost")).to_have_count(0)

    newest = page.locator(f'[data-testid="version-row"][data-version="{versions[-1]["updated_at"]}"]')
    change = newest.get_by_test_id("diff-stream").filter(has_text="refunds")
    expect(change).to_contain_text("refunds: 7 → (none) lost")
    expect(newest.get_by_test_id("diff-stream").filter(has_text="orders").get_by_test_id("lost")).to_have_count(0)


def test_the_regressions_view_lists_a_loss(page, gateway: Gateway):
    lost_refunds(gateway, "prod:shop")
    page.goto(gateway.base + "/")
    page.get_by_role("link", name="Regressions").click()
    rows = page.get_by_test_id("loss-row")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-state-id", "prod:shop")
    expect(rows.first).to_contain_text("refunds lost")
    expect(rows.first).to_contain_text("7")
    expect(page.get_by_test_id("regression-row")).to_have_count(0)
