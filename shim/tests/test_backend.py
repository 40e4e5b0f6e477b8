"""The state backend object itself, as Meltano uses it, against a real gateway."""

from __future__ import annotations

import time

import pytest
from meltano.core.state_store.base import MeltanoState, StateIDLockedError

from conftest import Gateway
from statehouse_meltano.backend import StatehouseStateStoreManager
from statehouse_meltano.client import gateway_url


def test_uri_forms():
    assert gateway_url("statehouse://gw:8080") == "http://gw:8080"
    assert gateway_url("statehouses://gw.example") == "https://gw.example"
    assert gateway_url("statehouse://gw:8080/prefix/") == "http://gw:8080/prefix"
    for bad in ["http://gw:8080", "statehouse:///no-host", "clickhouse://h"]:
        with pytest.raises(ValueError):
            gateway_url(bad)


def lock_view(gateway: Gateway, state_id: str):
    response = gateway.session.get(f"{gateway.base}/v1/locks/{state_id}", timeout=10)
    return response.json() if response.status_code == 200 else None


def test_acquire_lock_holds_renews_writes_with_and_releases_its_lease(gateway: Gateway):
    manager = StatehouseStateStoreManager(uri=gateway.uri, lease_ttl=3, owner="test-owner")
    with manager.acquire_lock("job", retry_seconds=1):
        assert lock_view(gateway, "job")["owner"] == "test-owner"
        first_expiry = lock_view(gateway, "job")["expires_at"]
        # Outlive the TTL: the renewer keeps the lease.
        time.sleep(4)
        view = lock_view(gateway, "job")
        assert view is not None and view["expires_at"] > first_expiry
        # Writes inside the block carry the lease; others are refused meanwhile.
        manager.set(MeltanoState(state_id="job", completed_state={"singer_state": {"n": 1}}))
        outsider = gateway.session.put(f"{gateway.base}/v1/states/job", json={"completed": {}}, timeout=10)
        assert outsider.status_code == 409
    assert lock_view(gateway, "job") is None, "released when the block ends"
    assert manager.get("job").completed_state == {"singer_state": {"n": 1}}
    manager.close()


def test_a_held_lock_raises_meltanos_locked_error_after_lock_timeout(gateway: Gateway):
    holder = StatehouseStateStoreManager(uri=gateway.uri, owner="holder")
    waiter = StatehouseStateStoreManager(uri=gateway.uri, owner="waiter", lock_timeout_seconds=1)
    with holder.acquire_lock("busy", retry_seconds=1):
        with pytest.raises(StateIDLockedError, match="held by holder"):
            with waiter.acquire_lock("busy", retry_seconds=1):
                pass
    with waiter.acquire_lock("busy", retry_seconds=1):
        pass


def test_a_lock_delay_raises_meltanos_locked_error_as_a_held_lock_does(gateway: Gateway):
    taken = gateway.session.post(
        f"{gateway.base}/v1/locks/delayed",
        json={"owner": "old-run", "ttl_seconds": 30, "lock_delay_seconds": 3},
        timeout=10,
        **gateway.tls,
    )
    assert taken.status_code == 201, taken.text
    unlocked = gateway.session.delete(f"{gateway.base}/v1/locks/delayed", timeout=10, **gateway.tls)
    assert unlocked.status_code == 204, unlocked.text
    waiter = StatehouseStateStoreManager(uri=gateway.uri, owner="waiter", lock_timeout_seconds=1)
    with pytest.raises(StateIDLockedError, match="free again at"):
        with waiter.acquire_lock("delayed", retry_seconds=1):
            pass
    waiter.close()


def test_one_http_connection_serves_many_calls(gateway: Gateway):
    manager = StatehouseStateStoreManager(uri=gateway.uri)
    for n in range(20):
        manager.update(MeltanoState(state_id=f"s{n % 3}", partial_state={"singer_state": {"n": n}}))
    assert sorted(manager.get_state_ids()) == ["s0", "s1", "s2"]
    assert manager.get("s2").partial_state == {"singer_state": {"n": 17}}
    pools = manager.client.session.get_adapter(gateway.base).poolmanager.pools
    assert len(pools) == 1
    (pool,) = [pools[key] for key in pools.keys()]
    assert pool.num_connections == 1, "every call reused one keep-alive connection"
    manager.close()


def test_bulk_operations(gateway: Gateway):
    manager = StatehouseStateStoreManager(uri=gateway.uri)
    written = manager.set_all(
        MeltanoState(state_id=f"bulk-{n}", completed_state={"singer_state": {"n": n}}) for n in range(5)
    )
    assert written == 5
    assert {s.state_id for s in manager.get_all()} == {f"bulk-{n}" for n in range(5)}
    assert [s.state_id for s in manager.get_all("bulk-[0-2]")] == [], "globs only know * and ?"
    assert len(list(manager.get_all("bulk-?"))) == 5
    assert manager.clear_all() == 5
    assert list(manager.get_state_ids()) == []
    manager.close()
