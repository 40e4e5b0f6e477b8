"""The write-behind queue on its own, with a fake send and no I/O: what it
drops, what it keeps, in which order, and what a failed send does."""

from __future__ import annotations

import threading
from collections import deque

import pytest
from meltano.core.state_store.base import MeltanoState

from statehouse_meltano import write_behind
from statehouse_meltano.write_behind import Sender, enqueue


def complete(state_id: str, n: int) -> MeltanoState:
    return MeltanoState(state_id=state_id, completed_state={"singer_state": {"n": n}})


def partial(state_id: str, n: int) -> MeltanoState:
    return MeltanoState(state_id=state_id, partial_state={"singer_state": {"n": n}})


def queued(queue: deque[MeltanoState]) -> list[tuple[str, dict, dict]]:
    return [(s.state_id, s.completed_state, s.partial_state) for s in queue]


def as_queued(*states: MeltanoState) -> list[tuple[str, dict, dict]]:
    return queued(deque(states))


def test_a_complete_state_drops_every_earlier_queued_state_of_its_id_only():
    queue: deque[MeltanoState] = deque()
    for state in [complete("a", 1), partial("b", 1), partial("a", 2), complete("b", 2), complete("a", 3)]:
        enqueue(queue, state)
    assert queued(queue) == as_queued(complete("b", 2), complete("a", 3))


def test_incomplete_states_are_never_dropped_nor_merged():
    queue: deque[MeltanoState] = deque()
    states = [complete("a", 1), partial("a", 2), partial("a", 3), partial("a", 4)]
    for state in states:
        enqueue(queue, state)
    assert queued(queue) == as_queued(*states)


def test_a_state_with_neither_part_is_incomplete_and_drops_nothing():
    # The gateway's PATCH merges it (nothing) into what is stored: the states before it still count.
    queue: deque[MeltanoState] = deque()
    empty = MeltanoState(state_id="a")
    for state in [partial("a", 1), empty]:
        enqueue(queue, state)
    assert queued(queue) == as_queued(partial("a", 1), empty)


class FakeGateway:
    """A send that records what it got, holds the first call until `release`, and fails where told."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.sent: list[MeltanoState] = []
        self.first_taken = threading.Event()
        self.release = threading.Event()
        self.fail_at = fail_at

    def send(self, state: MeltanoState) -> None:
        self.first_taken.set()
        assert self.release.wait(timeout=60), "the test released the first send"
        self.sent.append(state)
        if len(self.sent) == self.fail_at:
            raise RuntimeError(f"refused message {self.fail_at}")


def in_flight(gateway: FakeGateway) -> Sender:
    """A sender whose first state is being sent (and held there)."""
    sender = Sender(gateway.send, name="test-sender")
    sender.submit(partial("a", 0))
    assert gateway.first_taken.wait(timeout=60)
    return sender


def test_while_a_write_is_in_flight_only_the_newest_complete_state_and_the_incomplete_ones_after_it_follow():
    gateway = FakeGateway()
    sender = in_flight(gateway)
    for state in [complete("a", 1), partial("a", 2), complete("a", 3), partial("a", 4), partial("a", 5)]:
        sender.submit(state)
    assert sender.pending() == 3
    gateway.release.set()
    sender.drain()
    assert as_queued(*gateway.sent) == as_queued(partial("a", 0), complete("a", 3), partial("a", 4), partial("a", 5))
    assert sender.pending() == 0


def test_after_the_queue_drained_new_work_starts_the_worker_again():
    gateway = FakeGateway()
    gateway.release.set()
    sender = Sender(gateway.send, name="test-sender")
    sender.submit(complete("a", 1))
    sender.drain()
    sender.submit(complete("a", 2))
    sender.drain()
    assert as_queued(*gateway.sent) == as_queued(complete("a", 1), complete("a", 2))


def test_a_failed_send_is_raised_by_the_next_call_and_nothing_more_is_sent():
    gateway = FakeGateway(fail_at=1)
    sender = in_flight(gateway)
    sender.submit(partial("a", 1))
    gateway.release.set()
    with pytest.raises(RuntimeError, match="refused message 1"):
        sender.drain()
    assert as_queued(*gateway.sent) == as_queued(partial("a", 0)), "the state queued behind the failure is not sent"
    with pytest.raises(RuntimeError, match="refused message 1"):
        sender.submit(partial("a", 2))
    assert len(gateway.sent) == 1
    assert sender.failure() is not None and sender.failure().state_id == "a"


def test_a_failure_no_call_raised_is_left_for_the_exit_check_until_a_call_raises_it():
    gateway = FakeGateway(fail_at=1)
    sender = Sender(gateway.send, name="test-sender-unreported")
    sender.submit(complete("a", 1))
    try:
        assert gateway.first_taken.wait(timeout=60)
        (worker,) = [thread for thread in threading.enumerate() if thread.name == "test-sender-unreported"]
        gateway.release.set()
        worker.join(timeout=60)
        assert sender in write_behind._UNREPORTED
    finally:
        # Raised here, so this process's own exit check lets pytest's status stand.
        with pytest.raises(RuntimeError, match="refused message 1"):
            sender.drain()
    assert sender not in write_behind._UNREPORTED
