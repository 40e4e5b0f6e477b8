"""`meltano run` without `statehouse lock`: STATE messages are written behind
the run, at most one PATCH each (one each with write_behind off), the last one
before the run ends; and a run that finds its id locked by another client waits
for the lease."""

from __future__ import annotations

import os
import signal
from collections import Counter
from urllib.parse import quote

from conftest import Gateway, Project
from test_run import JOB, bookmark
from test_run_lease import LEASE, LOCK, STATE, lock_view, served, wait_for


def api(counts: Counter) -> Counter:
    """The API requests among the counts: not the test's own /metrics scrapes."""
    return Counter({key: n for key, n in counts.items() if key[1].startswith("/v1/")})


def lock_waits(gateway: Gateway) -> int:
    """Acquires that had to wait behind a holder, by the gateway's /metrics."""
    metrics = gateway.session.get(f"{gateway.base}/metrics", timeout=10).text
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in metrics.splitlines()
        if line.startswith('statehouse_lock_events_total{event="wait"}')
    )


WRITE_BEHIND_OFF = {"MELTANO_STATE_BACKEND_STATEHOUSE_WRITE_BEHIND": "false"}


def patches(sent: Counter) -> int:
    return sum(n for (method, route, _), n in sent.items() if (method, route) == ("PATCH", STATE))


def test_an_unlocked_run_writes_its_state_messages_behind_it_at_most_one_patch_each(
    project: Project, gateway: Gateway
):
    before = served(gateway)
    run = project.meltano("run", "tap-tiny", "target-tiny", extra_env={"TAP_TINY_COUNT": "7"})
    output = run.stdout + run.stderr
    assert output.count("Incremental state has been updated") == 7, output
    sent = api(served(gateway) - before)
    assert bookmark(gateway) == 7
    # At most one PATCH per STATE message (a newer complete state makes a
    # queued one needless), the first creating the state, and nothing else
    # about the state but the run's one read of it at the start (404: there
    # is none yet); no lock, no read-merge-write of Meltano's own.
    assert 1 <= patches(sent) <= 7, sent
    assert sent["PATCH", STATE, 201] == 1, sent
    assert set(sent) <= {("PATCH", STATE, 201), ("PATCH", STATE, 200), ("GET", STATE, 404)}, sent
    assert sent["GET", STATE, 404] == 1, sent


def test_with_write_behind_off_an_unlocked_run_writes_each_state_message_with_one_patch(
    project: Project, gateway: Gateway
):
    before = served(gateway)
    run = project.meltano("run", "tap-tiny", "target-tiny", extra_env={"TAP_TINY_COUNT": "7", **WRITE_BEHIND_OFF})
    output = run.stdout + run.stderr
    assert output.count("Incremental state has been updated") == 7, output
    sent = api(served(gateway) - before)
    assert bookmark(gateway) == 7
    assert sent == {("PATCH", STATE, 201): 1, ("PATCH", STATE, 200): 6, ("GET", STATE, 404): 1}, sent
    assert not any(route in (LOCK, LEASE) for _, route, _ in sent), sent


def test_a_run_of_many_messages_has_stored_its_last_bookmark_when_meltano_run_returns(
    project: Project, gateway: Gateway
):
    before = served(gateway)
    run = project.meltano("run", "tap-tiny", "target-tiny", extra_env={"TAP_TINY_COUNT": "200"})
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert output.count("Incremental state has been updated") == 200, output
    sent = api(served(gateway) - before)
    # Read at once: the run's last write is done before the process ends.
    assert bookmark(gateway) == 200
    assert 1 <= patches(sent) <= 200, sent
    assert set(sent) <= {("PATCH", STATE, 201), ("PATCH", STATE, 200), ("GET", STATE, 404)}, sent


def test_an_unlocked_run_waits_for_another_holders_lease_and_persists_every_message(
    project: Project, gateway: Gateway
):
    holder = gateway.session.post(
        f"{gateway.base}/v1/locks/{quote(JOB, safe='')}", json={"owner": "other-run", "ttl_seconds": 300}, timeout=10
    )
    assert holder.status_code == 201, holder.text
    before = served(gateway)
    waits_before = lock_waits(gateway)
    # A lock wait longer than any test machine needs: the run waits, it does not give up.
    run = project.popen(
        "run", "tap-tiny", "target-tiny",
        extra_env={"TAP_TINY_COUNT": "5", "MELTANO_STATE_BACKEND_LOCK_TIMEOUT_SECONDS": "120"},
    )
    try:
        wait_for("the run's first PATCH is refused", lambda: (served(gateway) - before)["PATCH", STATE, 409] >= 1)
        wait_for("the run waits in the lock's queue", lambda: lock_waits(gateway) > waits_before)
        assert bookmark(gateway) is None, "nothing written past the holder's lease"
        assert lock_view(gateway)["owner"] == "other-run"
        released = gateway.session.delete(
            f"{gateway.base}/v1/locks/{quote(JOB, safe='')}/{holder.json()['lease_id']}", timeout=10
        )
        assert released.status_code == 204, released.text
        out, _ = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 0, out
    assert out.count("Incremental state has been updated") == 5, out
    assert "Failed to persist" not in out, out
    sent = served(gateway) - before
    assert bookmark(gateway) == 5
    # The refused PATCH, then the wait for the lease and the write under it;
    # the messages after it (only the newest of those queued meanwhile) find
    # the id free and go unlocked.
    assert sent["PATCH", STATE, 409] == 1, sent
    assert 1 <= sent["PATCH", STATE, 201] + sent["PATCH", STATE, 200] <= 5, sent
    # The test's own release among them; renewals would not be wrong, so they are left out.
    locking = {key: n for key, n in sent.items() if key[1] in (LOCK, LEASE) and key[0] in ("POST", "DELETE")}
    assert locking == {("POST", LOCK, 201): 1, ("DELETE", LEASE, 204): 2}, sent
    assert lock_view(gateway) is None, "the run released the lease it waited for"
