"""The dashboard follows the change feed: a state written over REST shows in
the open page without a reload, and the page still settles for a headless
renderer that dumps its DOM."""

from __future__ import annotations

import subprocess

from playwright.sync_api import expect

from conftest import CHROMIUM, READ_TOKEN, Gateway, use_token

# The contract's bound for a change to show in the open page is 5 s, a
# figure a loaded machine moves; a change shown without a reload is the rule,
# and this bound only catches a page that never shows it.
LIVE_MS = 30_000


def bookmark(value: str) -> dict:
    return {"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "updated_at", "replication_key_value": value}}}}}


def test_a_state_written_elsewhere_appears_in_the_open_list(page, gateway: Gateway):
    gateway.put("live:first", {"completed": {"n": 1}})
    page.goto(gateway.base + "/")
    rows = page.get_by_test_id("state-row")
    expect(rows).to_have_count(1)
    reloads = []
    page.on("framenavigated", lambda frame: reloads.append(frame.url))
    gateway.put("live:second", {"completed": {"n": 2}})
    expect(page.locator('[data-state-id="live:second"]')).to_have_count(1, timeout=LIVE_MS)
    assert reloads == []


def test_a_new_bookmark_appears_on_the_open_state_page(page, gateway: Gateway):
    gateway.put("live:page", bookmark("2026-11-01T00:00:00Z"))
    page.goto(gateway.base + "/#/state/live%3Apage")
    expect(page.get_by_test_id("bookmarks")).to_contain_text("2026-11-01T00:00:00Z")
    gateway.put("live:page", bookmark("2026-12-24T00:00:00Z"))
    expect(page.get_by_test_id("bookmarks")).to_contain_text("2026-12-24T00:00:00Z", timeout=LIVE_MS)


def test_a_token_page_follows_with_the_token_in_a_header(page, token_gateway: Gateway):
    token_gateway.put("live:token", {"completed": {"n": 1}})
    urls = []
    page.on("request", lambda request: urls.append(request.url))
    use_token(page, token_gateway, READ_TOKEN)
    expect(page.get_by_test_id("state-row")).to_have_count(1)
    token_gateway.put("live:token-2", {"completed": {"n": 2}})
    expect(page.get_by_test_id("state-row")).to_have_count(2, timeout=LIVE_MS)
    assert any("/v1/changes" in url for url in urls)
    assert not any(READ_TOKEN in url for url in urls)


def test_the_page_still_settles_for_a_headless_dump(gateway: Gateway):
    gateway.put("live:dumped", {"completed": {"n": 1}})
    dumped = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
         "--virtual-time-budget=15000", gateway.base + "/"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert 'data-state-id="live:dumped"' in dumped.stdout
