"""The dashboard's pictures (issue 30), in a real headless Chromium at a
phone's and a desktop's size: each stream's bookmark charted with its
regressions marked, each version's diff, the Regressions view, and the
stream reset; every outcome that changes state is checked over REST.
Screenshots are kept in target/browser-artifacts/."""

from __future__ import annotations

import io
import re
from datetime import datetime, timedelta
from pathlib import Path
from urllib.parse import quote, urlparse

from PIL import Image
from playwright.sync_api import expect

from conftest import READ_TOKEN, ROOT, WRITE_TOKEN, Gateway, forced_then_held, use_token

ARTIFACTS = ROOT / "target" / "browser-artifacts"


def bookmarks(orders, customers) -> dict:
    return {"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "updated_at", "replication_key_value": orders},
        "customers": {"replication_key": "id", "replication_key_value": customers},
    }}}, "partial": {}}


# The orders bookmark goes back a day in the third version.
ORDERS = ["2026-11-01T00:00:00Z", "2026-11-03T00:00:00Z", "2026-11-02T00:00:00Z"]
CUSTOMERS = [10, 20, 30]


def regressed_state(gateway: Gateway, state_id: str) -> list[dict]:
    return [gateway.put(state_id, bookmarks(o, c)) for o, c in zip(ORDERS, CUSTOMERS)]


def shot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    size = page.viewport_size
    path = ARTIFACTS / f"{name}-{size['width']}x{size['height']}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def watch(page, gateway: Gateway) -> dict:
    """Records every request's host, every CSP violation and every script
    error, from before the page loads."""
    seen = {"hosts": set(), "errors": []}
    page.on("request", lambda r: seen["hosts"].add(urlparse(r.url).netloc))
    # A 404 the page expects (no lock on the id) is logged too: only a
    # policy violation counts.
    page.on("console", lambda m: "Content Security Policy" in m.text and seen["errors"].append(m.text))
    page.on("pageerror", lambda e: seen["errors"].append(str(e)))
    return seen


def test_the_chart_has_a_series_per_stream_a_point_per_version_and_marks_the_regression(page, gateway: Gateway):
    regressed_state(gateway, "dev:shop")
    # Held, after a forced lease: the page's picture shows who holds it too.
    forced_then_held(gateway, "dev:shop", "tap hung on the replica", info={
        "host": "etl-1", "pid": 4242, "command": "meltano run tap-shop target-jsonl", "dag": "nightly"})
    seen = watch(page, gateway)
    reply = gateway.call("GET", "/")
    policy = reply.headers["Content-Security-Policy"]
    script_src = next(d for d in policy.split(";") if d.strip().startswith("script-src"))
    assert "'unsafe-inline'" not in script_src and "'unsafe-eval'" not in script_src
    page.goto(gateway.base + "/#/state/" + quote("dev:shop", safe=""))

    instants = page.locator('[data-testid="chart"][data-kind="time"]')
    numbers = page.locator('[data-testid="chart"][data-kind="number"]')
    expect(instants).to_have_attribute("data-series", "1")
    expect(instants).to_have_attribute("data-points", "3")
    expect(instants).to_have_attribute("data-regressions", "1")
    expect(numbers).to_have_attribute("data-series", "1")
    expect(numbers).to_have_attribute("data-points", "3")
    expect(numbers).to_have_attribute("data-regressions", "0")
    expect(instants.locator("canvas")).to_have_count(1)
    # uPlot's own count: the stream's series and the regression marks.
    labels = instants.locator(".u-legend .u-series .u-label")
    expect(labels).to_have_text(["version", "orders", "regressed"])

    # In text too: next to the stream's name, and in the points' table.
    row = page.locator('[data-testid="bookmark-row"][data-stream="orders"]')
    expect(row.get_by_test_id("regressed")).to_have_text("regressed")
    customers = page.locator('[data-testid="bookmark-row"][data-stream="customers"]')
    expect(customers.get_by_test_id("regressed")).to_have_count(0)
    expect(page.get_by_test_id("point-row")).to_have_count(6)

    # Hovering the regressed version names the values before and after.
    # The lock's sections above put the chart below the fold: a pointer reaches only what is in view.
    instants.locator(".u-over").scroll_into_view_if_needed()
    box = instants.locator(".u-over").bounding_box()
    page.mouse.move(box["x"] + box["width"] - 2, box["y"] + box["height"] / 2)
    expect(instants.get_by_test_id("chart-caption")).to_contain_text(
        "orders regressed at")
    expect(instants.get_by_test_id("chart-caption")).to_contain_text(
        '"2026-11-03T00:00:00Z" → "2026-11-02T00:00:00Z"')

    expect(page.get_by_test_id("lease-row")).to_have_count(2)
    shot(page, "state-page")
    assert seen["hosts"] == {urlparse(gateway.base).netloc}, seen["hosts"]
    assert seen["errors"] == [], seen["errors"]


def test_the_time_axis_and_the_legend_are_in_utc_and_24_hours(browser, gateway: Gateway):
    # A browser eight hours behind UTC, in a 12-hour locale: local time would show.
    context = browser.new_context(viewport={"width": 1280, "height": 900},
                                  timezone_id="America/Los_Angeles", locale="en-US")
    try:
        tab = context.new_page()
        versions = regressed_state(gateway, "dev:utc")
        tab.goto(gateway.base + "/#/state/" + quote("dev:utc", safe=""))
        chart = tab.locator('[data-testid="chart"][data-kind="number"]')
        expect(chart).to_have_attribute("data-x-ticks", re.compile(r"\d{4}-\d{2}-\d{2}"))
        ticks = chart.get_attribute("data-x-ticks")
        assert not re.search(r"am|pm", ticks, re.IGNORECASE), ticks
        # Each date and hh:mm the axis names is one the versions span, in UTC.
        at = [datetime.fromisoformat(v["updated_at"].replace("Z", "+00:00")) for v in versions]
        first, last = at[0].replace(second=0, microsecond=0), at[-1]
        minutes = {(first + timedelta(minutes=n)).strftime("%H:%M")
                   for n in range(int((last - first).total_seconds() // 60) + 1)}
        days = {(first + timedelta(days=n)).strftime("%Y-%m-%d") for n in range((last.date() - first.date()).days + 1)}
        named = re.findall(r"(?:^|[\s|])(\d{2}:\d{2})(?![\d.:])", ticks)
        assert named and set(named) <= minutes, (ticks, minutes)
        assert set(re.findall(r"\d{4}-\d{2}-\d{2}", ticks)) <= days, (ticks, days)
        # The legend names the version under the pointer as the page does elsewhere.
        over = chart.locator(".u-over")
        over.scroll_into_view_if_needed()
        box = over.bounding_box()
        tab.mouse.move(box["x"] + box["width"] - 2, box["y"] + box["height"] / 2)
        expect(chart.locator(".u-legend .u-series").first.locator(".u-value")).to_have_text(versions[-1]["updated_at"])
    finally:
        context.close()


def test_each_version_shows_its_diff_with_the_actor(page, gateway: Gateway):
    versions = regressed_state(gateway, "dev:diff")
    page.goto(gateway.base + "/#/state/" + quote("dev:diff", safe=""))
    newest = page.locator(f'[data-testid="version-row"][data-version="{versions[-1]["updated_at"]}"]')
    change = newest.get_by_test_id("diff-stream")
    expect(change).to_have_count(2)
    orders = change.filter(has_text="orders")
    expect(orders.get_by_test_id("old")).to_have_text('"2026-11-03T00:00:00Z"')
    expect(orders.get_by_test_id("new")).to_have_text('"2026-11-02T00:00:00Z"')
    expect(orders).to_contain_text("regressed")
    numbers = change.filter(has_text="customers")
    expect(numbers.get_by_test_id("old")).to_have_text("20")
    expect(numbers.get_by_test_id("new")).to_have_text("30")
    expect(newest.get_by_test_id("actor")).to_have_text("anonymous")
    # Every version carries its own rollback, guarded as the API is.
    first = page.locator(f'[data-testid="version-row"][data-version="{versions[0]["updated_at"]}"]')
    expect(first.get_by_test_id("rollback")).to_be_enabled()


def test_the_regressions_view_lists_a_regressed_state(page, gateway: Gateway):
    regressed_state(gateway, "prod:orders")
    gateway.put("prod:fine", bookmarks("2026-11-01T00:00:00Z", 1))
    gateway.put("prod:fine", bookmarks("2026-11-05T00:00:00Z", 2))
    page.goto(gateway.base + "/")
    page.get_by_role("link", name="Regressions").click()
    rows = page.get_by_test_id("regression-row")
    expect(rows).to_have_count(1)
    expect(rows.first).to_have_attribute("data-state-id", "prod:orders")
    expect(rows.first).to_contain_text("orders")
    expect(rows.first).to_contain_text('"2026-11-03T00:00:00Z"')
    expect(rows.first).to_contain_text('"2026-11-02T00:00:00Z"')
    expect(rows.first.get_by_test_id("actor")).to_have_text("anonymous")
    shot(page, "regressions-view")


def test_reset_resets_one_stream_after_the_confirmation_and_a_lock_is_shown(page, gateway: Gateway):
    regressed_state(gateway, "dev:reset")
    page.goto(gateway.base + "/#/state/" + quote("dev:reset", safe=""))
    orders = page.locator('[data-testid="bookmark-row"][data-stream="orders"]')
    orders.get_by_test_id("reset-stream").focus()
    page.keyboard.press("Enter")
    expect(page.locator('[data-testid="bookmark-row"][data-stream="orders"]')).to_have_count(0)
    assert page.confirmations and "orders" in page.confirmations[0] and "dev:reset" in page.confirmations[0]
    state = gateway.call("GET", "/v1/states/" + quote("dev:reset", safe="")).json()
    streams = state["completed"]["singer_state"]["bookmarks"]
    assert list(streams) == ["customers"], streams

    # Locked by a worker: the reset is refused, and the page says so.
    gateway.call("POST", "/v1/locks/" + quote("dev:reset", safe=""), json={"owner": "worker", "ttl_seconds": 600})
    page.reload()
    page.locator('[data-testid="bookmark-row"][data-stream="customers"]').get_by_test_id("reset-stream").click()
    expect(page.locator("#notice")).to_contain_text("409")
    state = gateway.call("GET", "/v1/states/" + quote("dev:reset", safe="")).json()
    assert "customers" in state["completed"]["singer_state"]["bookmarks"]


def test_without_a_write_token_reset_is_disabled_and_says_why(page, token_gateway: Gateway):
    gateway = token_gateway
    regressed_state(gateway, "guarded")
    use_token(page, gateway, READ_TOKEN)
    page.goto(gateway.base + "/#/state/guarded")
    row = page.locator('[data-testid="bookmark-row"][data-stream="orders"]')
    expect(row.get_by_test_id("reset-stream")).to_be_disabled()
    expect(row.get_by_test_id("why-disabled")).to_contain_text("needs a write token")
    # With a write token the same button works, the token in a header.
    page.evaluate(f"() => sessionStorage.setItem('statehouse-token', '{WRITE_TOKEN}')")
    page.reload()
    requests = []
    page.on("request", lambda r: requests.append((r.url, r.headers.get("authorization"))))
    page.locator('[data-testid="bookmark-row"][data-stream="orders"]').get_by_test_id("reset-stream").click()
    expect(page.locator('[data-testid="bookmark-row"][data-stream="orders"]')).to_have_count(0)
    resets = [(url, auth) for url, auth in requests if "/bookmarks/orders" in url]
    assert resets and all(WRITE_TOKEN not in url and auth == f"Bearer {WRITE_TOKEN}" for url, auth in resets)


def saturated_pixels(png: bytes) -> int:
    """Pixels whose RGB channels differ from each other by more than 60."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    return sum(1 for r, g, b in image.getdata() if max(r, g, b) - min(r, g, b) > 60)


def test_a_charted_state_shows_many_more_saturated_pixels_than_one_of_plain_strings(browser, gateway: Gateway):
    context = browser.new_context(viewport={"width": 1280, "height": 1600})
    try:
        tab = context.new_page()
        for n in range(3):
            gateway.put("charted", bookmarks(ORDERS[n], CUSTOMERS[n]))
            gateway.put("strings", bookmarks(f"batch-{n}-of-november-first", f"customer-{n}"))
        counts = {}
        for state_id in ["charted", "strings"]:
            tab.goto(gateway.base + "/#/state/" + state_id)
            expect(tab.get_by_test_id("version-row")).to_have_count(3)
            if state_id == "strings":
                expect(tab.get_by_test_id("not-charted")).to_contain_text("customers, orders")
            else:
                expect(tab.get_by_test_id("chart")).to_have_count(2)
            png = tab.screenshot()
            (ARTIFACTS / f"compare-{state_id}-1280x1600.png").parent.mkdir(parents=True, exist_ok=True)
            (ARTIFACTS / f"compare-{state_id}-1280x1600.png").write_bytes(png)
            counts[state_id] = saturated_pixels(png)
        print(f"saturated pixels: {counts}")
        assert counts["charted"] - counts["strings"] >= 800, counts
    finally:
        context.close()


def test_keyboard_focus_reaches_every_button(page, gateway: Gateway):
    regressed_state(gateway, "dev:keys")
    page.goto(gateway.base + "/#/state/" + quote("dev:keys", safe=""))
    expect(page.get_by_test_id("version-row")).to_have_count(3)
    buttons = page.locator("button:visible:enabled")
    wanted = buttons.count()
    assert wanted >= 4, wanted  # a Reset per stream, a Roll back per old version
    reached = set()
    for _ in range(200):
        page.keyboard.press("Tab")
        reached.add(page.evaluate(
            "() => { const e = document.activeElement;"
            " return e && e.tagName === 'BUTTON' ? [...document.querySelectorAll('button')].indexOf(e) : -1 }"))
    every = set(page.evaluate(
        "() => [...document.querySelectorAll('button')].map((b, i) => [b, i])"
        ".filter(([b]) => !b.disabled && b.offsetParent !== null).map(([, i]) => i)"))
    assert every <= reached, (every, reached)
