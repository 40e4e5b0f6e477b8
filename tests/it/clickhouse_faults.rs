//! A failing or slow ClickHouse gives a clear 503, never a hang or a lost write.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;
use statehouse::domain::Coordination;

use crate::helpers::TestApp;
use crate::proxy::{Proxy, spawn_app_behind_proxy};

async fn app_behind_proxy(query_timeout: Duration) -> (TestApp, Proxy) {
    spawn_app_behind_proxy(|config| config.query_timeout = query_timeout).await
}

/// The status of `/readyz` once it is 200, or its last one after `limit`.
async fn ready_within(app: &TestApp, limit: Duration) -> StatusCode {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let status = app.get("/readyz").await.status;
        if status == StatusCode::OK || tokio::time::Instant::now() >= deadline {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn clickhouse_down_gives_503_and_the_gateway_recovers_by_itself() {
    let (app, proxy) = app_behind_proxy(Duration::from_secs(5)).await;
    let kept = app.put_state("kept", &json!({"completed": {"v": 1}})).await;
    kept.expect(StatusCode::CREATED);

    proxy.set_down(true);
    let read = app.get_state("kept").await;
    read.expect(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(read.problem_type(), "clickhouse-unavailable");
    let write = app.put_state("lost", &json!({"completed": {"v": 2}})).await;
    write.expect(StatusCode::SERVICE_UNAVAILABLE);
    let listing = app.get("/v1/states").await;
    listing.expect(StatusCode::SERVICE_UNAVAILABLE);
    let ready = app.get("/readyz").await;
    ready.expect(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        ready.json()["components"]["clickhouse"],
        json!({"status": "unavailable", "problem": "urn:statehouse:problem:clickhouse-unavailable"}),
        "names the problem, not ClickHouse's text"
    );
    app.get("/healthz")
        .await
        .expect_because(StatusCode::OK, "liveness does not depend on ClickHouse");

    proxy.set_down(false);
    // A probe may be answered from the check of up to a second ago.
    assert_eq!(
        ready_within(&app, Duration::from_secs(3)).await,
        StatusCode::OK
    );
    assert_eq!(
        app.get_state("kept").await.json()["completed"]["v"],
        1,
        "acknowledged write survived"
    );
    app.get_state("lost")
        .await
        .expect_because(StatusCode::NOT_FOUND, "the refused write did not happen");
}

#[tokio::test]
async fn a_stalled_clickhouse_gives_503_at_the_query_timeout() {
    let (app, proxy) = app_behind_proxy(Duration::from_millis(300)).await;
    app.put_state("slow", &json!({})).await;
    proxy.set_delay(Duration::from_secs(3));
    // The client gives up far later than the gateway should: a hang fails here.
    let reply = tokio::time::timeout(Duration::from_secs(20), app.get_state("slow"))
        .await
        .expect("the gateway answers instead of hanging");
    reply.expect(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.problem_type(), "clickhouse-unavailable");
    assert!(
        reply.json()["detail"]
            .as_str()
            .unwrap()
            .contains("did not answer")
    );
    let ready = app.get("/readyz").await;
    ready.expect(StatusCode::SERVICE_UNAVAILABLE);
    proxy.set_delay(Duration::ZERO);
    app.get_state("slow").await.expect(StatusCode::OK);
}

/// One writer's record: the last value acknowledged with a 2xx and the last
/// value it tried; a write refused with 503 may still have landed.
struct WriterLog {
    id: String,
    acknowledged: u64,
    attempted: u64,
    refused: usize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_outage_under_traffic_loses_no_acknowledged_write_and_locks_stay_truthful() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let (app, proxy) = app_behind_proxy(Duration::from_secs(2)).await;
    let (held, _) = app.lease("held", "through-the-outage", 120, 0.0).await;
    let (released, _) = app.lease("released", "lets-go-during-it", 120, 0.0).await;

    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let (api, stop) = (app.api.clone(), stop.clone());
            tokio::spawn(async move {
                let mut log = WriterLog {
                    id: format!("writer-{w}"),
                    acknowledged: 0,
                    attempted: 0,
                    refused: 0,
                };
                while !stop.load(Ordering::SeqCst) {
                    let n = log.attempted + 1;
                    log.attempted = n;
                    let reply = api
                        .put_state(&log.id, &json!({"completed": {"n": n}}))
                        .await;
                    if reply.status.is_success() {
                        log.acknowledged = n;
                    } else {
                        reply.expect(StatusCode::SERVICE_UNAVAILABLE);
                        assert_eq!(reply.problem_type(), "clickhouse-unavailable");
                        log.refused += 1;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                log
            })
        })
        .collect();
    let reader = {
        let (api, stop) = (app.api.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let status = api.get_state("writer-0").await.status;
                assert!([200, 404, 503].contains(&status.as_u16()), "{status}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };

    tokio::time::sleep(Duration::from_millis(700)).await;
    proxy.set_down(true);
    app.get("/readyz")
        .await
        .expect(StatusCode::SERVICE_UNAVAILABLE);
    app.release("released", &released)
        .await
        .expect(StatusCode::NO_CONTENT);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    proxy.set_down(false);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stop.store(true, Ordering::SeqCst);
    reader.await.unwrap();

    app.get("/readyz")
        .await
        .expect_because(StatusCode::OK, "recovered by itself");
    let mut refused = 0;
    for writer in writers {
        let log = writer.await.unwrap();
        refused += log.refused;
        let stored = app.get_state(&log.id).await.json()["completed"]["n"]
            .as_u64()
            .unwrap();
        assert!(
            stored >= log.acknowledged && stored <= log.attempted,
            "{}: stored {stored}, acknowledged {}, attempted {}",
            log.id,
            log.acknowledged,
            log.attempted
        );
    }
    assert!(refused > 0, "the outage was felt");

    // The lease held through the outage is still held, and still works.
    let view = app.get("/v1/locks/held").await;
    view.expect(StatusCode::OK);
    assert_eq!(view.json()["owner"], "through-the-outage");
    let write = app
        .put_state_with_lease("held", &json!({"completed": {"ok": true}}), &held)
        .await;
    assert!(write.status.is_success(), "{}", write.text);
    // The one released during the outage is not reported once ClickHouse is back.
    app.get("/v1/locks/released")
        .await
        .expect(StatusCode::NOT_FOUND);
    for _ in 0..100 {
        let listed = app.get("/v1/locks").await.json();
        let ids: Vec<&str> = listed["locks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["state_id"].as_str().unwrap())
            .collect();
        if ids == ["held"] {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("GET /v1/locks still lists the lease released during the outage");
}

/// The claim TTL of the unsettled-claim test: the held answer outlasts it.
const SHORT_CLAIM_TTL: Duration = Duration::from_secs(3);

/// A no-wait acquire whose one claim attempt cannot settle: the answer to
/// its candidate's INSERT reaches the gateway only after the claim TTL (held
/// here, as a loaded ClickHouse delays it), so the candidate ran out before
/// it was read back. Nobody holds the id or the pool, so the answer is 503
/// `authority-unreachable` with `Retry-After` (what clients retry), not a
/// 409 `lock-held` naming no holder or a `pool-full` of "0 of 2 held".
/// Table mode: a Keeper claim has no read between its write and its win.
/// With no wait, nothing is tried again, however the load moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_no_wait_acquire_whose_claim_cannot_settle_is_told_to_retry_not_that_it_is_held() {
    let (app, proxy) = spawn_app_behind_proxy(|config| {
        config.locks.coordination = Coordination::Table;
        config.locks.claim_ttl = SHORT_CLAIM_TTL;
    })
    .await;
    // A claim attempt's candidate (not its withdrawal, nor a renewal).
    let proposal: &[&str] = &["'claim', {claim:UUID}", "toIntervalMillisecond"];
    let held = SHORT_CLAIM_TTL + Duration::from_secs(1);
    let body = json!({"owner": "worker", "ttl_seconds": 60});
    let pool_body = json!({"owner": "worker", "limit": 2, "ttl_seconds": 60});
    for (what, path) in [
        ("state_id", "/v1/locks/unsettled"),
        ("pool", "/v1/pools/unsettled"),
    ] {
        proxy.hold_the_answer_to_one_request_containing(proposal, held);
        let reply = match what {
            "pool" => app.pool_acquire("unsettled", &pool_body).await,
            _ => app.acquire("unsettled", &body).await,
        };
        reply.expect_because(StatusCode::SERVICE_UNAVAILABLE, what);
        assert_eq!(reply.problem_type(), "authority-unreachable", "{what}");
        assert!(reply.header("retry-after").is_some(), "{what}");
        assert!(
            reply.json()["detail"]
                .as_str()
                .is_some_and(|d| d.contains("could not be settled")),
            "{what}: {}",
            reply.text
        );
        assert!(
            !proxy.held_answers().is_empty(),
            "{what}: the answer was held"
        );
        app.get(path)
            .await
            .expect_because(StatusCode::NOT_FOUND, format!("nobody holds the {what}"));
    }
    // Asked again, as Retry-After says: granted.
    app.acquire(
        "unsettled",
        &json!({"owner": "worker", "ttl_seconds": 60, "wait_seconds": 30}),
    )
    .await
    .expect(StatusCode::CREATED);
    app.pool_acquire(
        "unsettled",
        &json!({"owner": "worker", "limit": 2, "ttl_seconds": 60, "wait_seconds": 30}),
    )
    .await
    .expect(StatusCode::CREATED);
}
