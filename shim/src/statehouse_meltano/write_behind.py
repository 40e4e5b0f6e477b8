"""Write-behind for Meltano's update(): STATE messages are persisted behind the run.

Meltano calls update() once per STATE message and waits for it; a synchronous
write to the gateway (one ClickHouse INSERT) costs several times what Meltano's
own SQLite systemdb does, and no synchronous write can close that gap. So
update() hands the message to a Sender and returns at once; the Sender's worker
thread writes the messages in order, one at a time.

Newest wins: a complete state (one with a completed part, Meltano's and the
gateway's is_complete) replaces the stored one entirely under the gateway's
PATCH, so every message of its state_id queued before it is dropped unsent.
Incomplete states are deep-merged by the PATCH into what is stored, so they are
never dropped or merged here: each is sent, in order.

The end of the process: Meltano never calls close() at the end of `meltano
run`, so the worker is a non-daemon thread, which Python joins before it exits:
the last STATE message is written before `meltano run` ends. A failed write is
kept and raised by the next call; if no later call reported it (the run's last
write failed), an atexit handler, which Python runs after joining non-daemon
threads, says so on stderr and ends the process with status 1, so the run does
not look saved when it is not.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import typing as t
from collections import deque
from dataclasses import dataclass

if t.TYPE_CHECKING:
    from collections.abc import Callable

    from meltano.core.state_store.base import MeltanoState


def enqueue(queue: deque[MeltanoState], state: MeltanoState) -> None:
    """Queues `state`, dropping the queued messages it makes irrelevant.

    A complete state is stored whole, whatever came before it for its
    state_id; an incomplete one is merged into what is stored, so it drops nothing.
    """
    if state.is_complete():
        kept = [queued for queued in queue if queued.state_id != state.state_id]
        queue.clear()
        queue.extend(kept)
    queue.append(state)


@dataclass(frozen=True)
class Failure:
    """A write that failed: the state_id it was for and why."""

    state_id: str
    error: Exception


class Sender:
    """Sends queued states with `send`, in order, on a worker thread that runs while there is work."""

    def __init__(self, send: Callable[[MeltanoState], None], name: str) -> None:
        self._send = send
        self._name = name
        self._changed = threading.Condition()
        self._queue: deque[MeltanoState] = deque()
        self._worker: threading.Thread | None = None
        self._failure: Failure | None = None

    def submit(self, state: MeltanoState) -> None:
        """Queues `state` for the worker; raises a kept failure instead, sending nothing more after one."""
        with self._changed:
            self._raise_failure()
            enqueue(self._queue, state)
            if self._worker is None:
                # Non-daemon: Python waits for it at exit (see the module's docstring).
                self._worker = threading.Thread(target=self._run, name=self._name, daemon=False)
                self._worker.start()

    def drain(self) -> None:
        """Waits until every queued state is sent; raises a kept failure."""
        with self._changed:
            while self._worker is not None:
                self._changed.wait()
            self._raise_failure()

    def pending(self) -> int:
        """States queued and not yet taken by the worker."""
        with self._changed:
            return len(self._queue)

    def failure(self) -> Failure | None:
        """The kept failure, if a write failed."""
        with self._changed:
            return self._failure

    def _raise_failure(self) -> None:
        if self._failure is None:
            return
        _UNREPORTED.discard(self)
        raise self._failure.error

    def _run(self) -> None:
        while True:
            with self._changed:
                if not self._queue or self._failure is not None:
                    # After a failure the rest is not sent: a later state
                    # stored over a lost one would hide the loss.
                    self._queue.clear()
                    self._worker = None
                    self._changed.notify_all()
                    return
                state = self._queue.popleft()
            try:
                self._send(state)
            except Exception as err:  # noqa: BLE001 - kept and raised by the next call
                with self._changed:
                    self._failure = Failure(state.state_id, err)
                    _UNREPORTED.add(self)


# Senders whose failure no call has raised yet; strong references, so a
# manager dropped before the process ends still has its failure reported.
_UNREPORTED: set[Sender] = set()


def _report_unsaved_at_exit() -> None:
    """Ends the process with status 1 when a write failed and nothing reported it.

    Python runs atexit handlers after joining non-daemon threads, so every
    worker is done here. os._exit because the exit status is already set by
    then (`meltano run` may be exiting 0): flushing stdout, stderr and the
    logging handlers first, as a normal exit would.
    """
    failures = [failure for sender in list(_UNREPORTED) if (failure := sender.failure())]
    if not failures:
        return
    for failure in failures:
        sys.stderr.write(f"statehouse: the last state of {failure.state_id!r} was not saved: {failure.error}\n")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


atexit.register(_report_unsaved_at_exit)
