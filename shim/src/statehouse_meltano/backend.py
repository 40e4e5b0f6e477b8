"""The Meltano state backend: every StateStoreManager call goes to the gateway."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import typing as t
from contextlib import contextmanager

from meltano.core.state_store.base import MeltanoState, StateIDLockedError, StateStoreManager

from statehouse_meltano.client import (
    GatewayClient,
    GatewayError,
    LockHeldError,
    PatternDeletion,
    StateLockedError,
    TlsSettings,
    gateway_url,
)
from statehouse_meltano.write_behind import Sender

if t.TYPE_CHECKING:
    from collections.abc import Generator, Iterable

logger = logging.getLogger(__name__)

# An import goes to the gateway in batches of at most this many states and
# bytes: well under its 16 MiB default body limit, and few requests.
IMPORT_BATCH_STATES = 5000
IMPORT_BATCH_BYTES = 8 * 1024 * 1024

# `statehouse lock STATE_ID -- meltano run ...` holds a lease on STATE_ID for
# the whole run (renewing and releasing it itself) and names it here.
RUN_LEASE_STATE_ID = "STATEHOUSE_LEASE_STATE_ID"
RUN_LEASE_ID = "STATEHOUSE_LEASE_ID"

# The names `statehouse lock` reads, taken when Meltano's own setting is
# unset: one environment then serves the runner and the shim alike.
TOKEN_ENV = "STATEHOUSE_TOKEN"
TOKEN_FILE_ENV = "STATEHOUSE_TOKEN_FILE"
CA_FILE_ENV = "STATEHOUSE_CA_FILE"
CLIENT_CERT_FILE_ENV = "STATEHOUSE_CLIENT_CERT_FILE"
CLIENT_KEY_FILE_ENV = "STATEHOUSE_CLIENT_KEY_FILE"


def run_lease(environ: t.Mapping[str, str]) -> tuple[str, str] | None:
    """The (state_id, lease_id) of the run lease this process runs under, if any."""
    state_id, lease_id = environ.get(RUN_LEASE_STATE_ID), environ.get(RUN_LEASE_ID)
    return (state_id, lease_id) if state_id and lease_id else None


def setting_or_env(value: str | None, name: str, environ: t.Mapping[str, str]) -> str | None:
    """A Meltano setting's value, else the runner's variable `name` (empty counts as unset)."""
    return value or environ.get(name) or None


def shown(state_id: str) -> str:
    """An id as printed: another client chose it, so control characters
    (a newline, a terminal escape) are shown escaped, never acted on."""
    return state_id if state_id.isprintable() else repr(state_id)


def skipped_message(deletion: PatternDeletion) -> str:
    """What a clear left because other clients hold the leases, naming those the gateway named."""
    n = deletion.skipped_locked
    states = "1 state was" if n == 1 else f"{n} states were"
    leases = "its lease is" if n == 1 else "their leases are"
    message = f"statehouse: {states} not cleared, {leases} held"
    if not deletion.locked:
        return message
    message += ": " + ", ".join(shown(state_id) for state_id in deletion.locked)
    # The gateway names at most 100.
    unnamed = n - len(deletion.locked)
    return message + (f" and {unnamed} more" if unnamed > 0 else "")


def document(state: MeltanoState) -> dict[str, t.Any]:
    """A MeltanoState as the gateway's state document."""
    return {"completed": state.completed_state or {}, "partial": state.partial_state or {}}


class LeaseRenewer:
    """Renews a lease every third of its TTL while a lock block runs."""

    def __init__(self, client: GatewayClient, state_id: str, lease_id: str, ttl_seconds: int) -> None:
        self._client = client
        self._state_id = state_id
        self._lease_id = lease_id
        self._ttl = ttl_seconds
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"statehouse-renew-{state_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._ttl / 3):
            try:
                self._client.renew(self._state_id, self._lease_id, self._ttl)
            except GatewayError as err:
                # Writes with a lapsed lease get 409, so nothing is clobbered; say why.
                logger.warning("could not renew the lock on %s: %s", self._state_id, err)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


class StatehouseStateStoreManager(StateStoreManager):
    """State in ClickHouse, through a statehouse gateway."""

    label = "statehouse"

    def __init__(
        self,
        uri: str,
        *,
        lock_timeout_seconds: int = 10,
        lock_retry_seconds: int = 1,  # noqa: ARG002 - the gateway queues waiters itself
        token: str | None = None,
        token_file: str | None = None,
        request_timeout: int | None = 10,
        lease_ttl: int | None = 30,
        owner: str | None = None,
        allow_regression: str | None = None,
        allow_loss: str | None = None,
        ca_file: str | None = None,
        client_cert_file: str | None = None,
        client_key_file: str | None = None,
        write_behind: bool | None = True,
        **kwargs: t.Any,
    ) -> None:
        """Meltano passes the URI, its own lock settings and state_backend.<scheme>.* settings."""
        super().__init__(**kwargs)
        self.uri = uri
        self.lock_timeout_seconds = float(lock_timeout_seconds if lock_timeout_seconds is not None else 10)
        self.lease_ttl = int(lease_ttl or 30)
        self.owner = owner or f"meltano@{socket.gethostname()}:{os.getpid()}"
        env = os.environ
        self.client = GatewayClient(
            gateway_url(uri),
            token=setting_or_env(token, TOKEN_ENV, env),
            # A token given outright wins; the runner's file only when none is.
            token_file=None if token else setting_or_env(token_file, TOKEN_FILE_ENV, env),
            timeout=float(request_timeout or 10),
            tls=TlsSettings(
                ca_file=setting_or_env(ca_file, CA_FILE_ENV, env),
                client_cert_file=setting_or_env(client_cert_file, CLIENT_CERT_FILE_ENV, env),
                client_key_file=setting_or_env(client_key_file, CLIENT_KEY_FILE_ENV, env),
            ),
            allow_regression=allow_regression,
            allow_loss=allow_loss,
        )
        # Leases this process holds, by state_id: writes inside a lock block carry them.
        self._leases: dict[str, str] = {}
        self._leases_guard = threading.Lock()
        self._run_lease = run_lease(os.environ)
        # None: update() writes synchronously (write_behind off).
        self._sender = Sender(self._patch, name=f"statehouse-write-{id(self):x}") if write_behind is not False else None

    def _drain(self) -> None:
        """Read-your-writes: every call but update() first waits for the queued states to be written."""
        if self._sender is not None:
            self._sender.drain()

    def close(self) -> None:
        try:
            self._drain()
        finally:
            self.client.close()

    def _run_lease_for(self, state_id: str) -> str | None:
        """The run's lease, when it is on `state_id`."""
        if self._run_lease is not None and self._run_lease[0] == state_id:
            return self._run_lease[1]
        return None

    def _lease_for(self, state_id: str) -> str | None:
        if lease_id := self._run_lease_for(state_id):
            return lease_id
        with self._leases_guard:
            return self._leases.get(state_id)

    def update(self, state: MeltanoState) -> None:  # type: ignore[misc]  # final in Meltano's base, for typing only
        """Meltano's update, written behind the run (see write_behind) unless write_behind is off.

        Raises the failure of an earlier write instead; Meltano then fails the
        run at this message, as it would have at the failed one.
        """
        if self._sender is None:
            self._patch(state)
        else:
            self._sender.submit(state)

    def _patch(self, state: MeltanoState) -> None:
        """Meltano's update in one request.

        Meltano's own (lock, read an incomplete state's stored one, merge its
        partial state, write, unlock: three or four requests) is what the
        gateway's PATCH does in one step, serialized per state_id on its
        authority. Under the run's lease, which covers the
        whole run, the PATCH carries it; without one it goes with no lease,
        and only when another client holds the state_id's lease (409
        state-locked) does it wait for the lease as Meltano would
        (lock_timeout_seconds) and PATCH under it.
        """
        if lease_id := self._run_lease_for(state.state_id):
            self.client.patch_state(state.state_id, document(state), lease_id)
            return
        try:
            self.client.patch_state(state.state_id, document(state), None)
        except StateLockedError:
            with self._held_lease(state.state_id):
                self.client.patch_state(state.state_id, document(state), self._lease_for(state.state_id))

    def set(self, state: MeltanoState) -> None:
        self._drain()
        self.client.put_state(state.state_id, document(state), self._lease_for(state.state_id))

    def get(self, state_id: str) -> MeltanoState | None:
        self._drain()
        stored = self.client.get_state(state_id)
        if stored is None:
            return None
        return MeltanoState(
            state_id=state_id,
            completed_state=stored["completed"],
            partial_state=stored["partial"],
        )

    def delete(self, state_id: str) -> None:
        self._drain()
        self.client.delete_state(state_id, self._lease_for(state_id))

    def get_state_ids(self, pattern: str | None = None) -> Iterable[str]:
        self._drain()
        return list(self.client.state_ids(pattern))

    def get_all(self, pattern: str | None = None) -> Iterable[MeltanoState]:
        """Every state in pages of documents: one request per page, not one per state."""
        self._drain()
        for stored in self.client.states(pattern):
            yield MeltanoState(
                state_id=stored["state_id"],
                completed_state=stored["completed"],
                partial_state=stored["partial"],
            )

    def set_all(self, states: Iterable[MeltanoState]) -> int:
        """Writes the states in batches (bounded in count and size), each all or nothing."""
        self._drain()
        count = 0
        batch: list[dict[str, t.Any]] = []
        size = 0
        for state in states:
            entry: dict[str, t.Any] = {
                "state_id": state.state_id,
                "completed": state.completed_state or {},
                "partial": state.partial_state or {},
            }
            if lease_id := self._lease_for(state.state_id):
                entry["lease_id"] = lease_id
            entry_size = len(json.dumps(entry))
            if batch and (len(batch) >= IMPORT_BATCH_STATES or size + entry_size > IMPORT_BATCH_BYTES):
                count += self.client.import_states(batch)
                batch, size = [], 0
            batch.append(entry)
            size += entry_size
        if batch:
            count += self.client.import_states(batch)
        return count

    def clear_all(self) -> int:
        """Clears every state but those whose lease another client holds (a run in
        progress keeps its bookmark), and says which were left: Meltano itself
        only reports the count cleared."""
        self._drain()
        deletion = self.client.delete_matching("*")
        if deletion.skipped_locked > 0:
            logger.warning(skipped_message(deletion))
        return deletion.deleted

    @contextmanager
    def acquire_lock(self, state_id: str, *, retry_seconds: float) -> Generator[None]:  # noqa: ARG002
        """Holds a gateway lease while the block runs; waits up to lock_timeout_seconds for it.

        Under a run lease on `state_id` it takes none: the run's lease covers
        the block, and its runner renews and releases it. The states queued
        before the block, and in it, are written before it ends: under the lease.
        """
        self._drain()
        with self._held_lease(state_id):
            try:
                yield
            finally:
                self._drain()

    @contextmanager
    def _held_lease(self, state_id: str) -> Generator[None]:
        """acquire_lock without the drain: the writer's own 409 fallback runs on the worker, inside it."""
        if self._run_lease_for(state_id):
            yield
            return
        try:
            lease = self.client.acquire(
                state_id,
                owner=self.owner,
                ttl_seconds=self.lease_ttl,
                wait_seconds=self.lock_timeout_seconds,
            )
        except LockHeldError as err:
            raise StateIDLockedError(str(err)) from None
        lease_id = lease["lease_id"]
        renewer = LeaseRenewer(self.client, state_id, lease_id, self.lease_ttl)
        with self._leases_guard:
            self._leases[state_id] = lease_id
        try:
            yield
        finally:
            with self._leases_guard:
                self._leases.pop(state_id, None)
            renewer.stop()
            try:
                self.client.release(state_id, lease_id)
            except GatewayError as err:
                logger.warning("could not release the lock on %s: %s", state_id, err)
