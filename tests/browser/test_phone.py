"""Every view at a phone's width (390 px) as at a desktop's (issue 53):
nothing reaches past the window, every table's columns included, and a
state id reads as an id rather than as a column of five characters."""

from __future__ import annotations

from urllib.parse import quote

from playwright.sync_api import expect

from conftest import HOLDER_INFO, Gateway
from test_pictures import regressed_state, shot

# Ids as Meltano names them, and one with no hyphen to break at.
IDS = ["prod:tap-google-analytics-to-target-snowflake", "dev:tap-postgres-to-target-jsonl",
       "prod:warehouse_orders_nightly_full_refresh_backfill"]
REGRESSED = IDS[0]


def outside(page) -> list[dict]:
    """Every element on screen whose box reaches past the window's edges,
    including one clipped by a container that scrolls sideways."""
    return page.evaluate(
        """() => [...document.querySelectorAll("body *")]
             .map((e) => ({ e, box: e.getBoundingClientRect() }))
             .filter(({ box }) => box.width > 0 && box.height > 0)
             .filter(({ box }) => box.left < -0.5 || box.right > window.innerWidth + 0.5)
             .map(({ e, box }) => ({ tag: e.tagName, cls: e.className, text: e.textContent.slice(0, 40),
                                     left: box.left, right: box.right }))""")


def id_lines(page) -> list[dict]:
    """Each id that heads a row (a state's, a pool's) with the lines it is
    laid out on: a line per distinct top of its text's fragments."""
    return page.evaluate(
        """() => [...document.querySelectorAll("td.id:first-child")].map((cell) => {
             const tops = new Set();
             const walk = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
             for (let node = walk.nextNode(); node; node = walk.nextNode()) {
               const range = document.createRange();
               range.selectNodeContents(node);
               for (const r of range.getClientRects()) if (r.width > 0) tops.add(Math.round(r.top));
             }
             return { text: cell.textContent, lines: tops.size };
           })""")


def assert_fits(page, name: str) -> None:
    width = page.evaluate("() => window.innerWidth")
    assert page.evaluate("() => document.scrollingElement.scrollWidth") <= width, name
    assert outside(page) == [], name
    ids = id_lines(page)
    assert ids, name
    # Readable: a line holds 20 characters or more (it held 5 or 6).
    for cell in ids:
        assert cell["lines"] == 1 or len(cell["text"]) / cell["lines"] >= 20, (name, cell)
    shot(page, "fits-" + name)


def test_every_view_fits_the_window_and_its_ids_read_whole(page, gateway: Gateway):
    for state_id in IDS:
        gateway.put(state_id, {"completed": {"n": 1}})
    regressed_state(gateway, REGRESSED)
    for state_id in IDS[1:]:
        gateway.call("POST", "/v1/locks/" + quote(state_id, safe=""),
                     json={"owner": "airflow-worker-3:meltano-run-4242", "ttl_seconds": 600,
                           "info": HOLDER_INFO}).raise_for_status()
    gateway.call("POST", "/v1/pools/" + quote("prod:warehouse-source-db", safe=""),
                 json={"owner": "etl-1:4242", "limit": 2, "ttl_seconds": 600, "info": HOLDER_INFO}).raise_for_status()

    page.goto(gateway.base + "/")
    expect(page.get_by_test_id("state-row")).to_have_count(len(IDS))
    expect(page.get_by_test_id("lock").filter(has_text="airflow-worker-3")).to_have_count(2)
    assert_fits(page, "states")

    page.goto(gateway.base + "/#/locks")
    locks = page.get_by_test_id("lock-row")
    expect(locks).to_have_count(2)
    # Every column of a lock is on screen: its fencing token, expiry and gateway too.
    lock = gateway.call("GET", "/v1/locks/" + quote(IDS[1], safe="")).json()
    row = locks.filter(has_text=IDS[1])
    for value in (str(lock["fencing_token"]), lock["expires_at"], lock["gateway_id"]):
        expect(row.get_by_text(value, exact=True)).to_be_visible()
    assert_fits(page, "locks")

    page.goto(gateway.base + "/#/regressions")
    regression = page.get_by_test_id("regression-row")
    expect(regression).to_have_count(1)
    version = gateway.call("GET", "/v1/regressions").json()["regressions"][0]["version"]
    expect(regression.get_by_test_id("actor")).to_be_visible()
    expect(regression.get_by_text(version, exact=True)).to_be_visible()
    assert_fits(page, "regressions")

    page.goto(gateway.base + "/#/pools")
    expect(page.get_by_test_id("pool-holder-row")).to_have_count(1)
    assert_fits(page, "pools")

    page.goto(gateway.base + "/#/state/" + quote(REGRESSED, safe=""))
    expect(page.get_by_test_id("chart")).to_have_count(2)
    page.get_by_text("The charted points as a table").click()
    points = page.get_by_test_id("point-row")
    expect(points).to_have_count(6)
    # The Value column is whole: each value on screen with its row.
    expect(points.get_by_text('"2026-11-02T00:00:00Z"', exact=True)).to_be_visible()
    # Here the id is the page's title, not a cell.
    expect(page.get_by_test_id("state-title")).to_have_text(REGRESSED)
    width = page.evaluate("() => window.innerWidth")
    assert page.evaluate("() => document.scrollingElement.scrollWidth") <= width
    assert outside(page) == []
    shot(page, "fits-state")
