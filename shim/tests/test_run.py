"""`meltano run` end to end: a tiny tap and target, state kept by the gateway."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path
from urllib.parse import quote

from conftest import Cluster, Gateway, Project, make_project

JOB = "dev:tap-tiny-to-target-tiny"


def received_states(project: Project) -> list[dict]:
    log = project.root / "tap.log"
    return [json.loads(line)["received_state"] for line in log.read_text().splitlines()]


def records(project: Project) -> list[int]:
    path = Path(project.env["TARGET_TINY_OUTPUT"])
    return [json.loads(line)["id"] for line in path.read_text().splitlines()] if path.exists() else []


def bookmark(gateway: Gateway) -> int | None:
    stored = gateway.state(JOB)
    if stored is None:
        return None
    merged = {**stored["completed"], **stored["partial"]}
    return merged["singer_state"]["bookmarks"]["numbers"]["last_id"]


def test_a_second_run_starts_from_the_first_runs_bookmark(project: Project, gateway: Gateway):
    project.meltano("run", "tap-tiny", "target-tiny", extra_env={"TAP_TINY_COUNT": "5"})
    assert bookmark(gateway) == 5
    assert project.state_get(JOB)["singer_state"]["bookmarks"]["numbers"]["last_id"] == 5

    project.meltano("run", "tap-tiny", "target-tiny", extra_env={"TAP_TINY_COUNT": "3"})
    first, second = received_states(project)
    assert first == {}, "the first run starts from nothing"
    assert second["bookmarks"]["numbers"]["last_id"] == 5, "the second run is given the bookmark"
    assert records(project) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert bookmark(gateway) == 8


def test_a_killed_run_leaves_its_progress_and_the_next_run_continues(project: Project, gateway: Gateway):
    # A short lease: the killed run may die holding one, and the next run's
    # lock wait (lock_timeout_seconds, 10 s) outlasts it.
    slow = {"TAP_TINY_COUNT": "1000", "TAP_TINY_DELAY": "0.05", "MELTANO_STATE_BACKEND_STATEHOUSE_LEASE_TTL": "2"}
    run = project.popen("run", "tap-tiny", "target-tiny", extra_env=slow)
    try:
        deadline = time.monotonic() + 120
        while (bookmark(gateway) or 0) < 10:
            assert run.poll() is None, run.stdout.read()
            assert time.monotonic() < deadline, "no progress was stored"
            time.sleep(0.2)
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    # The killed worker may have died holding a lease: it ends at its TTL (2 s).
    deadline = time.monotonic() + 60
    while gateway.session.get(f"{gateway.base}/v1/locks/{quote(JOB, safe='')}", timeout=10).status_code != 404:
        assert time.monotonic() < deadline, "the dead worker's lease outlived its TTL"
        time.sleep(0.2)
    # Read once its lease is gone: a write it sent just before the kill may
    # still have been on its way to ClickHouse (it lands or fails with its
    # batch, client or not).
    left = bookmark(gateway)
    assert 10 <= left < 1000, left
    # Meltano's own job record still says "running" after a kill -9: --force.
    resumed_run = project.meltano("run", "--force", "tap-tiny", "target-tiny", extra_env={"TAP_TINY_COUNT": "3"})
    # Meltano can exit 0 after failing to persist state; say so rather than guess.
    assert "Failed to persist" not in resumed_run.stdout + resumed_run.stderr, resumed_run.stderr
    resumed = received_states(project)[-1]
    assert resumed["bookmarks"]["numbers"]["last_id"] == left, "the next run starts where the killed one stopped"
    assert bookmark(gateway) == left + 3


def test_two_simultaneous_runs_of_one_job_never_corrupt_its_state(tmp_path, gateway: Gateway):
    # Two workers (two projects, one gateway) run the same job at once.
    workers = [make_project(tmp_path / name, gateway.uri) for name in ("a", "b")]
    runs = [
        worker.popen(
            "run", "tap-tiny", "target-tiny",
            extra_env={"TAP_TINY_COUNT": "40", "TAP_TINY_DELAY": "0.01", "TAP_TINY_RUN": name},
        )
        for worker, name in zip(workers, ("a", "b"))
    ]
    outputs = []
    for run in runs:
        out, _ = run.communicate(timeout=300)
        outputs.append(out)
        assert run.returncode == 0, out
    for out in outputs:
        # Every STATE the target emitted was acknowledged by the backend.
        assert out.count("Incremental state has been updated") == 40, out
        assert "Failed to persist" not in out
    stored = gateway.state(JOB)
    final = stored["completed"]["singer_state"]
    assert final["run"] in ("a", "b"), "the state is one run's final state, whole"
    # Each tap goes on from the bookmark it was given: none when both began
    # before either stored a state, the other's first ones when one began later
    # (on a loaded machine, Meltano's start-up alone takes seconds).
    winner = workers[("a", "b").index(final["run"])]
    given = received_states(winner)[-1].get("bookmarks", {}).get("numbers", {}).get("last_id", 0)
    assert final["bookmarks"]["numbers"]["last_id"] == given + 40
    assert stored["partial"] == {}


def test_a_run_through_three_gateways_behind_a_round_robin_balancer(tmp_path, cluster: Cluster):
    # Every request may land on any gateway: the id's authority serves its
    # lock operations and lock-checked writes, whoever was asked.
    project = make_project(tmp_path / "p", cluster.uri)
    run = project.meltano("run", "tap-tiny", "target-tiny", extra_env={"TAP_TINY_COUNT": "30"})
    output = run.stdout + run.stderr
    assert output.count("Incremental state has been updated") == 30, output
    for trouble in ("Failed to persist", "could not renew the lock", "could not release the lock", "locked"):
        assert trouble not in output, output
    for gateway in cluster.gateways:
        assert bookmark(gateway) == 30, "every gateway serves the last bookmark"
        assert cluster.requests_served(gateway) > 0, "the balancer spread requests over every gateway"
    # Nobody holds the lock afterwards, as seen from each gateway.
    for gateway in cluster.gateways:
        assert gateway.session.get(f"{gateway.base}/v1/locks/{quote(JOB, safe='')}", timeout=10).status_code == 404


def inserts(gateway: Gateway) -> int:
    """INSERT statements the gateway sent ClickHouse (versions, states, lease rows), by its /metrics."""
    metrics = gateway.session.get(f"{gateway.base}/metrics", timeout=10).text
    operations = ('"history_record"', '"put"', '"lease_write"')
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in metrics.splitlines()
        if line.startswith("statehouse_clickhouse_query_duration_seconds_count{")
        and any(f"operation={op}" in line for op in operations)
    )


def test_a_run_of_100_state_messages_costs_one_insert_each_and_a_lease_row_insert_a_second(
    project: Project, gateway: Gateway
):
    # Each STATE message is one version INSERT; the lease rows of its lock
    # and unlock are coalesced, at most one INSERT a second. On a quiet
    # machine the run takes well under 10 s (at most 110 INSERTs); a loaded
    # one takes longer, and the bound follows the seconds it took.
    before = inserts(gateway)
    started = time.monotonic()
    project.meltano("run", "tap-tiny", "target-tiny", extra_env={"TAP_TINY_COUNT": "100"})
    assert bookmark(gateway) == 100
    time.sleep(1.5)  # the last lease rows go out within a second
    seconds = time.monotonic() - started
    spent = inserts(gateway) - before
    bound = 100 + max(10, math.ceil(seconds) + 1)
    assert spent <= bound, f"100 STATE messages took {spent} INSERTs in {seconds:.1f} s (bound {bound})"
