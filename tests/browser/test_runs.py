"""Runs on a state's page (issue 54), in a real headless Chromium: each run
with how it ended, a failed run named failed in words and marked, and a bar
per run for its duration."""

from __future__ import annotations

from urllib.parse import quote

from playwright.sync_api import expect

from conftest import Gateway


def recorded_run(gateway: Gateway, state_id: str, ending: dict) -> dict:
    """A run on a fresh lease of `state_id`, ended with `ending`."""
    lock = "/v1/locks/" + quote(state_id, safe="")
    lease = gateway.call("POST", lock, json={"owner": "etl-1", "ttl_seconds": 60}).json()
    run = gateway.call("POST", "/v1/runs", json={"state_id": state_id, "lease_id": lease["lease_id"]})
    assert run.status_code == 201, run.text
    ended = gateway.call("PATCH", "/v1/runs/" + run.json()["run_id"], json=ending)
    assert ended.status_code == 200, ended.text
    gateway.call("DELETE", f"{lock}/{lease['lease_id']}")
    return ended.json()


def test_the_state_page_lists_its_runs_and_names_a_failed_one_failed(page, gateway: Gateway):
    gateway.put("dev:nightly", {"completed": {}})
    recorded_run(gateway, "dev:nightly", {"exit_code": 0})
    failed = recorded_run(gateway, "dev:nightly", {"exit_code": 3})
    page.goto(gateway.base + "/#/state/" + quote("dev:nightly", safe=""))
    rows = page.get_by_test_id("run-row")
    expect(rows).to_have_count(2)
    newest = rows.first
    expect(newest).to_have_attribute("data-status", "failed")
    status = newest.get_by_test_id("run-status")
    expect(status).to_have_text("failed")
    expect(status).to_have_class("failed")
    expect(newest.get_by_test_id("run-exit")).to_have_text("3")
    expect(rows.nth(1).get_by_test_id("run-status")).to_have_text("succeeded")
    expect(page.get_by_test_id("run-bar")).to_have_count(2)
    assert failed["status"] == "failed"


def test_the_list_shows_each_states_last_run_marked_when_it_failed(page, gateway: Gateway):
    gateway.put("dev:ok", {"completed": {}})
    gateway.put("dev:broken", {"completed": {}})
    recorded_run(gateway, "dev:ok", {"exit_code": 0})
    recorded_run(gateway, "dev:broken", {"signal": 15})
    page.goto(gateway.base + "/")
    broken = page.locator('[data-testid="state-row"][data-state-id="dev:broken"]').get_by_test_id("last-run")
    expect(broken).to_have_text("failed")
    expect(broken).to_have_class("failed")
    ok = page.locator('[data-testid="state-row"][data-state-id="dev:ok"]').get_by_test_id("last-run")
    expect(ok).to_have_text("succeeded")
