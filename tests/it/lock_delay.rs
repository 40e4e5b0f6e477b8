//! Lock-delay: after a lease with `lock_delay_seconds` ends by expiry or
//! force-unlock, no lease on its id is granted until the delay has passed,
//! through the same gateway or another, and after the authority restarts or
//! crashes (the lease row carries the delay); a release ends it with no
//! delay. (`scripts/test` runs these in keeper mode too.)

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::checker::{Held, Log, check, final_counter, increment};
use crate::helpers::{
    Api, clickhouse_url, spawn_app_with, spawn_peer_process, two_peers, unique_schema,
};
use crate::lock_faults::millis;

async fn acquire(api: &Api, id: &str, ttl: u64, wait: f64, delay: u64) -> crate::helpers::Reply {
    api.acquire(
        id,
        &json!({"owner": "worker", "ttl_seconds": ttl, "wait_seconds": wait, "lock_delay_seconds": delay}),
    )
    .await
}

/// A time of an answer. The API writes RFC 3339 UTC with milliseconds,
/// fixed-width, so text order is time order.
fn time(body: &Value, field: &str) -> String {
    let text = body[field]
        .as_str()
        .unwrap_or_else(|| panic!("{field} in {body}"));
    assert!(
        text.len() == 24 && text.ends_with('Z'),
        "{field} is not RFC 3339 UTC with milliseconds: {text}"
    );
    text.to_owned()
}

/// A lease with a delay expires; the next acquire through `next` is told
/// when the id is free, and one that waits is granted only then.
async fn after_expiry(holder: &Api, next: &Api) {
    let id = "delayed-expiry";
    let held = acquire(holder, id, 1, 0.0, 3).await;
    held.expect(StatusCode::CREATED);
    assert_eq!(held.json()["lock_delay_seconds"], 3);
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let none = next.get(&format!("/v1/locks/{id}")).await;
    none.expect_because(StatusCode::NOT_FOUND, "no lease during the delay");
    let refused = acquire(next, id, 30, 0.0, 0).await;
    refused.expect(StatusCode::CONFLICT);
    assert_eq!(refused.problem_type(), "lock-delay");
    let free_at = time(&refused.json(), "free_at");
    assert!(
        free_at > time(&held.json(), "expires_at"),
        "free_at comes after the lease's end: {}",
        refused.text
    );

    let granted = acquire(next, id, 30, 10.0, 0).await;
    granted.expect(StatusCode::CREATED);
    assert!(
        time(&granted.json(), "acquired_at") >= free_at,
        "granted before the delay ended: {} (free at {free_at:?})",
        granted.text
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_an_expiry_the_next_grant_waits_for_the_delay_through_the_same_gateway() {
    let app = spawn_app_with(|_| {}).await;
    after_expiry(&app.api, &app.api).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_an_expiry_the_next_grant_waits_for_the_delay_through_another_gateway() {
    let (a, b) = two_peers().await;
    after_expiry(&a.api, &b.api).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_force_unlock_starts_the_delay_and_a_release_ends_a_lease_with_none() {
    let (a, b) = two_peers().await;
    let id = "delayed-force";
    let held = acquire(&a.api, id, 30, 0.0, 2).await;
    held.expect(StatusCode::CREATED);
    let unlock = b
        .request(Method::DELETE, &format!("/v1/locks/{id}"), None, &[])
        .await;
    unlock.expect(StatusCode::NO_CONTENT);
    let refused = acquire(&b.api, id, 30, 0.0, 0).await;
    refused.expect(StatusCode::CONFLICT);
    assert_eq!(refused.problem_type(), "lock-delay");
    let granted = acquire(&b.api, id, 30, 10.0, 2).await;
    granted.expect(StatusCode::CREATED);

    // Released by its holder: no delay, the next acquire is granted at once.
    let lease = granted.json()["lease_id"].as_str().unwrap().to_owned();
    b.release(id, &lease).await.expect(StatusCode::NO_CONTENT);
    let next = acquire(&a.api, id, 30, 0.0, 0).await;
    next.expect(StatusCode::CREATED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_without_a_delay_is_granted_again_at_once_after_its_expiry() {
    let app = spawn_app_with(|_| {}).await;
    let id = "undelayed";
    let held = acquire(&app.api, id, 1, 0.0, 0).await;
    held.expect(StatusCode::CREATED);
    assert_eq!(held.json()["lock_delay_seconds"], 0);
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let next = acquire(&app.api, id, 30, 0.0, 0).await;
    next.expect(StatusCode::CREATED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delay_past_the_cap_is_cut_to_it_and_shown_to_others() {
    let app = spawn_app_with(|config| config.locks.max_lock_delay = Duration::from_secs(2)).await;
    let id = "capped";
    let held = acquire(&app.api, id, 30, 0.0, 600).await;
    held.expect(StatusCode::CREATED);
    assert_eq!(held.json()["lock_delay_seconds"], 2, "clamped, not refused");
    let view = app.get(&format!("/v1/locks/{id}")).await;
    assert_eq!(view.json()["lock_delay_seconds"], 2, "{}", view.text);
}

/// The id is in its lock-delay through `next`: an acquire that cannot wait
/// is told when it ends (answered).
async fn refused_until(next: &Api, id: &str) -> String {
    let refused = acquire(next, id, 30, 0.0, 0).await;
    refused.expect(StatusCode::CONFLICT);
    assert_eq!(refused.problem_type(), "lock-delay", "{}", refused.text);
    time(&refused.json(), "free_at")
}

/// An acquire that waits is granted, but not before `free_at`.
async fn granted_after(next: &Api, id: &str, free_at: &str) {
    let granted = acquire(next, id, 30, 10.0, 0).await;
    granted.expect(StatusCode::CREATED);
    assert!(
        time(&granted.json(), "acquired_at").as_str() >= free_at,
        "granted before the delay ended: {} (free at {free_at:?})",
        granted.text
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delay_outlives_a_restart_of_the_authority() {
    let (a, b) = two_peers().await;
    // Delays of 10 s: the authority's shutdown hands over and waits for its
    // writes, which on a loaded 2-core machine has taken longer than 4 s.
    let expired = acquire(&a.api, "restart-expiry", 1, 0.0, 10).await;
    expired.expect(StatusCode::CREATED);
    let forced = acquire(&a.api, "restart-force", 30, 0.0, 10).await;
    forced.expect(StatusCode::CREATED);
    let unlock = a
        .request(Method::DELETE, "/v1/locks/restart-force", None, &[])
        .await;
    unlock.expect(StatusCode::NO_CONTENT);
    tokio::time::sleep(Duration::from_millis(1200)).await;

    // The authority stops as at a redeploy: it hands its claims back, and
    // the next authority learns the delays from the lease rows alone.
    a.shut_down().await;
    let expiry_ends = refused_until(&b.api, "restart-expiry").await;
    let force_ends = refused_until(&b.api, "restart-force").await;
    granted_after(&b.api, "restart-expiry", &expiry_ends).await;
    granted_after(&b.api, "restart-force", &force_ends).await;
}

/// The authority holding a lease with a lock-delay is killed: once its
/// claim lapses, the survivor keeps the lease's place, and an acquire refused
/// before the lease would have expired is told who holds it (409
/// `lock-held`, the lease as it was granted), not of a lock-delay that has not
/// begun; after its expiry, of its lock-delay (409 `lock-delay`), and it is
/// granted once that ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_held_through_an_authority_that_crashes_keeps_its_holder_and_then_its_delay() {
    let schema = unique_schema();
    let flags = [
        "--schema",
        &schema,
        "--claim-ttl",
        "3s",
        "--claim-settle",
        "200ms",
    ];
    let mut a = spawn_peer_process(&clickhouse_url(), &flags).await;
    let b = spawn_peer_process(&clickhouse_url(), &flags).await;
    let id = "crashed-authority";
    let info = json!({"host": "runner-1", "pid": 4242});
    // Longer than the take-over (the claim TTL) takes on a loaded machine.
    let held = a
        .api()
        .acquire(
            id,
            &json!({"owner": "worker", "ttl_seconds": 20, "wait_seconds": 0,
                    "lock_delay_seconds": 3, "info": info}),
        )
        .await;
    held.expect(StatusCode::CREATED);
    let granted = held.json();
    let expires_at = millis(&time(&granted, "expires_at"));
    // The grant's row, which the survivor learns the lease from, is written
    // behind the grant.
    let shown = a.api().get(&format!("/v1/locks/{id}")).await;
    shown.expect(StatusCode::OK);
    let authority = shown.json()["gateway_id"].clone();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    a.child.kill().await.expect("kill -9");

    // Until the dead authority's claim lapses, the id is unreachable; then
    // the survivor takes the claim, and the lease keeps its place.
    let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
    let refused = loop {
        let reply = acquire(&b.api(), id, 30, 0.0, 0).await;
        if reply.status != StatusCode::SERVICE_UNAVAILABLE {
            break reply;
        }
        assert!(tokio::time::Instant::now() < give_up, "{}", reply.text);
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    refused.expect(StatusCode::CONFLICT);
    assert_eq!(refused.problem_type(), "lock-held", "{}", refused.text);
    let holder = &refused.json()["holder"];
    for field in [
        "owner",
        "fencing_token",
        "acquired_at",
        "expires_at",
        "info",
    ] {
        assert_eq!(holder[field], granted[field], "{field}: {}", refused.text);
    }
    assert_eq!(holder["gateway_id"], authority, "its authority, now dead");
    // GET shows it as the holder the 409 names, alone and in the list.
    let shown = b.api().get(&format!("/v1/locks/{id}")).await;
    shown.expect(StatusCode::OK);
    let shown = shown.json();
    assert_eq!(&shown, holder, "as the 409 names it");
    assert_eq!(shown["lock_delay_seconds"], 3);
    assert_eq!(listed(&b.api(), id).await, Some(shown));

    // Past its expiry, its lock-delay: the survivor answers it at once.
    let refused = loop {
        let reply = acquire(&b.api(), id, 30, 0.0, 0).await;
        reply.expect(StatusCode::CONFLICT);
        if reply.problem_type() == "lock-delay" {
            break reply;
        }
        assert_eq!(reply.problem_type(), "lock-held", "{}", reply.text);
        assert!(tokio::time::Instant::now() < give_up, "{}", reply.text);
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let free_at = time(&refused.json(), "free_at");
    assert_eq!(
        millis(&free_at),
        expires_at + 3_000,
        "free at the lease's expiry and its delay"
    );
    // During the delay no lease exists.
    let gone = b.api().get(&format!("/v1/locks/{id}")).await;
    gone.expect(StatusCode::NOT_FOUND);
    assert_eq!(listed(&b.api(), id).await, None);
    granted_after(&b.api(), id, &free_at).await;
}

/// `id`'s entry in `GET /v1/locks` through `api`, if it is listed.
async fn listed(api: &Api, id: &str) -> Option<Value> {
    let list = api.get("/v1/locks").await;
    list.expect(StatusCode::OK);
    list.json()["locks"]
        .as_array()
        .expect("locks")
        .iter()
        .find(|lock| lock["state_id"] == id)
        .cloned()
}

/// A grant as the checker sees it: its server times, and whether its
/// holder left it to expire rather than release it.
#[derive(Clone, Copy, Debug)]
struct Grant {
    token: u64,
    acquired_ms: i64,
    expires_ms: i64,
    left_to_expire: bool,
}

/// One worker's cycles on `id` through `api`: lock with a 1 s delay and a
/// 3 s TTL, read the counter, write it + 1 under the lease, then release,
/// or (every third cycle, staggered by worker) leave the lease to expire.
/// The TTL outlasts the read and the write on a loaded machine: with 1 s,
/// they took longer beside the Python suites, and the lease was gone.
async fn delayed_worker(
    api: Api,
    id: &'static str,
    worker: usize,
    log: Log,
    grants: Arc<Mutex<Vec<Grant>>>,
) {
    for cycle in 0..3 {
        let reply = acquire(&api, id, 3, 30.0, 1).await;
        reply.expect(StatusCode::CREATED);
        let start = Instant::now();
        let body = reply.json();
        let lease = body["lease_id"].as_str().unwrap().to_owned();
        let token = body["fencing_token"].as_u64().unwrap();
        increment(&api, id, &lease, &format!("worker {worker}")).await;
        let end = Instant::now();
        let left_to_expire = (worker + cycle).is_multiple_of(3);
        if !left_to_expire {
            let released = api.release(id, &lease).await;
            released.expect(StatusCode::NO_CONTENT);
        }
        log.lock().unwrap().push(Held { start, end, token });
        grants.lock().unwrap().push(Grant {
            token,
            acquired_ms: millis(&time(&body, "acquired_at")),
            expires_ms: millis(&time(&body, "expires_at")),
            left_to_expire,
        });
    }
}

/// The lock-delay under contention, through two gateways: four workers
/// take turns on one counter, some leaving their lease to expire. The
/// checker: the counter equals the cycles, no two leases overlap, and no
/// grant after an expired lease comes before its expiry + the delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_contention_no_grant_falls_inside_a_delay_and_no_two_leases_overlap() {
    let (a, b) = two_peers().await;
    let id = "delayed-counter";
    let (log, grants): (Log, Arc<Mutex<Vec<Grant>>>) = Default::default();
    let workers: Vec<_> = (0..4_usize)
        .map(|worker| {
            let api = if worker.is_multiple_of(2) {
                a.api.clone()
            } else {
                b.api.clone()
            };
            tokio::spawn(delayed_worker(api, id, worker, log.clone(), grants.clone()))
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    assert_eq!(final_counter(&a.api, id).await, 12);
    check(&log, 12);
    let mut grants = grants.lock().unwrap().clone();
    grants.sort_by_key(|g| g.token);
    assert!(grants.iter().any(|g| g.left_to_expire));
    for pair in grants.windows(2) {
        let (before, after) = (pair[0], pair[1]);
        if before.left_to_expire {
            assert!(
                after.acquired_ms >= before.expires_ms + 1_000,
                "granted inside the lock-delay of an expired lease: {before:?} then {after:?}"
            );
        }
    }
}
