"""Bookmarks that go away, on the dashboard in a real headless Chromium: the
state page names a dropped stream as "lost" next to its name, in its
bookmarks and in its history's diff, and the Regressions view lists it, each
with the value it had (a partitioned stream's partition by partition)."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from playwright.sync_api import expect

from conftest import Gateway, start_gateway, stop


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


def partitioned(**shops) -> dict:
    """Meltano's partitioned bookmark for `orders`: one partition per shop, its value in the partition."""
    return {"completed": {"singer_state": {"bookmarks": {"orders": {"partitions": [
        {"context": {"shop": shop}, "replication_key": "id", "replication_key_value": value}
        for shop, value in shops.items()
    ]}}}}, "partial": {}}


@pytest.fixture
def rejecting_gateway():
    """A gateway that refuses a write losing a bookmark (`--bookmark-loss reject`)."""
    gw = start_gateway(args=("--bookmark-loss", "reject"))
    yield gw
    stop(gw)


def test_a_lost_partitioned_stream_shows_the_values_its_409_named(page, rejecting_gateway: Gateway):
    gateway = rejecting_gateway
    gateway.put("dev:shops", partitioned(a=9))
    path = "/v1/states/" + quote("dev:shops", safe="")
    refused = gateway.call("PUT", path, json={"completed": {}})
    assert refused.status_code == 409, refused.text
    assert refused.json()["losses"] == [{"stream": "orders", "from": 9, "context": {"shop": "a"}}]
    gateway.call("PUT", path, json={"completed": {}}, headers={"Statehouse-Allow-Loss": "orders"}).raise_for_status()
    page.goto(gateway.base + "/#/state/" + quote("dev:shops", safe=""))

    orders = page.locator('[data-testid="bookmark-row"][data-stream="orders"]')
    expect(orders.locator("td").first).to_have_text("orders lost")
    expect(orders.locator("code.old")).to_have_text('{"shop":"a"}: 9')
    change = page.get_by_test_id("version-row").first.get_by_test_id("diff-stream")
    expect(change).to_have_text('orders: {"shop":"a"}: 9 → (none) lost')


def test_the_regressions_view_shows_a_lost_partitions_value_and_the_ones_left(page, gateway: Gateway):
    gateway.put("prod:shops", partitioned(a=9, b=4))
    gateway.put("prod:shops", partitioned(b=5))
    page.goto(gateway.base + "/#/regressions")
    rows = page.get_by_test_id("loss-row")
    expect(rows).to_have_count(1)
    expect(rows.first.locator("code.old")).to_have_text('{"shop":"a"}: 9; {"shop":"b"}: 4')
    expect(rows.first.locator("code.new")).to_have_text('{"shop":"b"}: 5')
