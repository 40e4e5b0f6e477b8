"""The dashboard at `/`, in a real headless Chromium, on a phone-sized and a
desktop-sized viewport; every outcome is checked over REST."""

from __future__ import annotations

from datetime import datetime, timedelta
from urllib.parse import quote

from playwright.sync_api import expect

from conftest import READ_TOKEN, Gateway, use_token

BOOKMARKED = {
    "completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "updated_at", "replication_key_value": "2026-11-01T00:00:00Z"},
        "customers": {"replication_key": "id", "replication_key_value": 41},
    }}},
    "partial": {},
}


def test_the_list_loads_and_filters(page, gateway: Gateway):
    for state_id in ["dev:shop", "dev:crm", "prod:shop"]:
        gateway.put(state_id, {"completed": {"n": 1}})
    page.goto(gateway.base + "/")
    rows = page.get_by_test_id("state-row")
    expect(rows).to_have_count(3)
    page.get_by_test_id("pattern").fill("dev:*")
    page.get_by_role("button", name="Filter").click()
    expect(rows).to_have_count(2)
    expect(page.locator('[data-state-id="prod:shop"]')).to_have_count(0)
    # A threshold of zero hours marks everything stale.
    page.get_by_test_id("stale-hours").fill("0")
    page.get_by_role("button", name="Filter").click()
    expect(page.get_by_test_id("age").first).to_contain_text("stale")


def test_a_row_stamped_ahead_of_the_browsers_clock_is_ahead_not_a_negative_age(page, gateway: Gateway):
    written = gateway.put("dev:shop", {"completed": {"n": 1}})
    # The browser's clock a day behind the gateway's: the row is stamped a day ahead.
    stamped = datetime.fromisoformat(written["updated_at"].replace("Z", "+00:00"))
    page.clock.set_fixed_time(stamped - timedelta(days=1))
    page.goto(gateway.base + "/")
    age = page.locator('[data-testid="state-row"][data-state-id="dev:shop"]').get_by_test_id("age")
    expect(age).to_have_text("ahead")
    expect(age).to_have_attribute("title", "stamped 24 h after this browser's clock")
    expect(age).to_have_class("fresh")


def test_a_state_shows_its_bookmarks_document_and_history(page, gateway: Gateway):
    gateway.put("dev:shop", {"completed": {"singer_state": {"bookmarks": {"orders": {"replication_key_value": "old"}}}}})
    gateway.put("dev:shop", BOOKMARKED)
    page.goto(gateway.base + "/#/state/" + quote("dev:shop", safe=""))
    bookmarks = page.get_by_test_id("bookmark-row")
    expect(bookmarks).to_have_count(2)
    expect(page.get_by_test_id("bookmarks")).to_contain_text("2026-11-01T00:00:00Z")
    expect(page.get_by_test_id("document")).to_contain_text('"customers"')
    versions = page.get_by_test_id("version-row")
    expect(versions).to_have_count(2)
    expect(versions.first).to_contain_text("current")
    expect(versions.first.get_by_test_id("changed")).to_have_text("customers, orders")


def test_a_rollback_from_the_page_changes_the_state(page, gateway: Gateway):
    first = gateway.put("job", {"completed": {"v": 1}})
    gateway.put("job", {"completed": {"v": 2}})
    page.goto(gateway.base + "/#/state/job")
    old = page.locator(f'[data-testid="version-row"][data-version="{first["updated_at"]}"]')
    old.get_by_test_id("rollback").click()
    expect(page.get_by_test_id("version-row")).to_have_count(3)
    assert page.confirmations and "Roll job back" in page.confirmations[0]
    state = gateway.call("GET", "/v1/states/job").json()
    assert state["completed"] == {"v": 1}
    newest = gateway.call("GET", "/v1/states/job/history?limit=1").json()["versions"][0]
    assert newest["operation"] == "rollback"


def test_force_unlock_from_the_page_frees_the_lock(page, gateway: Gateway):
    gateway.put("locked", {"completed": {}})
    lease = gateway.call("POST", "/v1/locks/locked", json={"owner": "stuck-worker", "ttl_seconds": 600}).json()
    page.goto(gateway.base + "/#/locks")
    expect(page.get_by_test_id("lock-row")).to_contain_text("stuck-worker")
    page.goto(gateway.base + "/#/state/locked")
    expect(page.get_by_test_id("lock-holder")).to_contain_text("stuck-worker")
    page.get_by_test_id("force-unlock").click()
    expect(page.get_by_test_id("lock-holder")).to_have_count(0)
    assert gateway.call("GET", "/v1/locks/locked").status_code == 404
    assert gateway.call("PUT", f"/v1/locks/locked/{lease['lease_id']}").status_code == 409


def test_the_token_prompt_works_and_a_read_token_cannot_roll_back(page, token_gateway: Gateway):
    gateway = token_gateway
    first = gateway.put("guarded", {"completed": {"v": 1}})
    gateway.put("guarded", {"completed": {"v": 2}})
    page.goto(gateway.base + "/")
    expect(page.locator("#token-form")).to_be_visible()
    use_token(page, gateway, READ_TOKEN)
    expect(page.get_by_test_id("state-row")).to_have_count(1)
    stored = page.evaluate("() => sessionStorage.getItem('statehouse-token')")
    assert stored == READ_TOKEN
    assert READ_TOKEN not in page.url
    assert page.context.cookies() == []
    page.goto(gateway.base + "/#/state/guarded")
    old = page.locator(f'[data-testid="version-row"][data-version="{first["updated_at"]}"]')
    # A read token cannot roll back: the button is off and says why.
    expect(old.get_by_test_id("rollback")).to_be_disabled()
    expect(old.get_by_test_id("why-disabled")).to_contain_text("needs a write token")
    assert gateway.call("GET", "/v1/states/guarded").json()["completed"] == {"v": 2}


def test_the_token_button_shows_only_on_a_gateway_that_asks_for_tokens(page, gateway: Gateway, token_gateway: Gateway):
    # Without tokens: /v1/whoami says so, and the page offers no token to fill in.
    assert gateway.call("GET", "/v1/whoami").json()["tokens"] is False
    gateway.put("open", {"completed": {}})
    page.goto(gateway.base + "/")
    expect(page.get_by_test_id("state-row")).to_have_count(1)
    expect(page.locator("#token-button")).to_be_hidden()
    expect(page.locator("#token-form")).to_be_hidden()
    # With tokens the button is there, before a token and after one is given.
    token_gateway.put("guarded", {"completed": {}})
    page.goto(token_gateway.base + "/")
    expect(page.locator("#token-button")).to_be_visible()
    use_token(page, token_gateway, READ_TOKEN)
    expect(page.get_by_test_id("state-row")).to_have_count(1)
    expect(page.locator("#auth-status")).to_have_text("token set")
    expect(page.locator("#token-button")).to_be_visible()


def test_a_state_page_shows_the_state_as_of_a_versions_time(page, gateway: Gateway):
    first = gateway.put("dev:asof", {"completed": {"singer_state": {"bookmarks": {"orders": {"replication_key_value": "first"}}}}})
    gateway.put("dev:asof", {"completed": {"singer_state": {"bookmarks": {"orders": {"replication_key_value": "second"}}}}})
    page.goto(gateway.base + "/#/state/" + quote("dev:asof", safe=""))
    expect(page.get_by_test_id("document")).to_contain_text("second")
    old = page.locator(f'[data-testid="version-row"][data-version="{first["updated_at"]}"]')
    old.get_by_test_id("as-of-link").click()
    expect(page.get_by_test_id("as-of")).to_contain_text(first["updated_at"])
    expect(page.get_by_test_id("document")).to_contain_text("first")
    expect(page.get_by_test_id("bookmarks")).to_contain_text("first")
    page.get_by_role("link", name="back to now").click()
    expect(page.get_by_test_id("document")).to_contain_text("second")
    expect(page.get_by_test_id("as-of")).to_have_count(0)
