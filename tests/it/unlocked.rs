//! Unlocked writes (issue 45): a write to an id no gateway holds a claim on
//! reads the id's lock rows and its current row in one statement, its
//! routing read, and is decided against that row. What must not bend: the
//! row is the stored state (rows written straight into ClickHouse
//! included), the write wins over a row stamped ahead, and the lock rule is
//! the same through any gateway, beside lock holders on the same id too.

use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use statehouse::domain::GuardMode;
use tokio::sync::watch;

use crate::api::retried;
use crate::checker::{Held, Log, check};
use crate::helpers::{Api, plugin_writes_ahead, spawn_app_with, two_peers, write_path_statements};

fn bookmarked(value: &str) -> Value {
    json!({"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "updated_at", "replication_key_value": value}
    }}}})
}

/// One-off unlocked PUTs cost their routing read (with the current row)
/// and their INSERT: two statements each. A routing read slower than half
/// the claim settle is followed by a fresh read under the writer lock, so
/// the settle here is a minute, past any read's query timeout, and the
/// count is the write's own, whatever the machine's load. (The figure under
/// load, with the settle the tests run, is `bench/fleet`'s statements per
/// write; repeated writes to one id make the gateway its authority: see
/// `write_claims`.)
#[tokio::test]
async fn an_unlocked_write_costs_its_routing_read_and_its_insert() {
    let app = spawn_app_with(|config| config.locks.settle = Duration::from_secs(60)).await;
    let before = write_path_statements(&app).await;
    for n in 0..8 {
        let put = app
            .put_state(&format!("one-off-{n}"), &json!({"completed": {"n": n}}))
            .await;
        assert!(put.status.is_success(), "{}", put.text);
    }
    let statements = write_path_statements(&app).await - before;
    assert_eq!(statements, 16.0, "8 unlocked writes");
    assert_eq!(app.get_state("one-off-7").await.json()["completed"]["n"], 7);
}

/// Rows the ClickHouse plugin writes into the same table, stamped ahead,
/// right before each unlocked write: each write is decided against the
/// plugin's row (the bookmark guard refuses going back from it) and wins
/// over it.
#[tokio::test]
async fn an_unlocked_write_is_decided_against_a_row_written_straight_into_clickhouse() {
    let app = spawn_app_with(|config| config.bookmark_regression = GuardMode::Reject).await;
    let id = "dev:tap-plugin-to-target";
    app.put_state(id, &bookmarked("2026-01-01"))
        .await
        .expect(StatusCode::CREATED);
    for round in 1..=4 {
        let ahead = format!("2026-0{}-10", round + 1);
        plugin_writes_ahead(&app.schema, id, &bookmarked(&ahead)).await;
        let back = app
            .put_state(id, &bookmarked(&format!("2026-0{round}-20")))
            .await;
        back.expect(StatusCode::CONFLICT);
        assert_eq!(back.problem_type(), "bookmark-regression");
        let forward = format!("2026-0{}-20", round + 1);
        app.put_state(id, &bookmarked(&forward))
            .await
            .expect(StatusCode::OK);
        let served = app.get_state(id).await.json();
        assert_eq!(
            served["completed"]["singer_state"]["bookmarks"]["orders"]["replication_key_value"],
            forward.as_str(),
            "round {round}: the write wins over the row stamped ahead"
        );
    }
}

/// Two gateways: an unlocked write through the one that is not the
/// authority is checked by the authority's lock (refused while another
/// holds the lease), lands once the lease is released, and a row written
/// straight into ClickHouse after the claim ends is seen by the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unlocked_write_through_a_non_authority_keeps_the_lock_rule() {
    let (a, b) = two_peers().await;
    let id = "dev:tap-shared-to-target";
    let (lease, _) = a.lease(id, "holder", 60, 0.0).await;
    let refused = b.put_state(id, &json!({"completed": {"n": 1}})).await;
    refused.expect(StatusCode::CONFLICT);
    assert_eq!(refused.problem_type(), "state-locked");
    a.put_state_with_lease(id, &json!({"completed": {"n": 2}}), &lease)
        .await
        .expect(StatusCode::CREATED);
    a.release(id, &lease).await.expect(StatusCode::NO_CONTENT);
    b.put_state(id, &json!({"completed": {"n": 3}}))
        .await
        .expect(StatusCode::OK);
    assert_eq!(a.get_state(id).await.json()["completed"]["n"], 3);
    assert_eq!(b.get_state(id).await.json()["completed"]["n"], 3);
    // Ids nobody ever locked are served where they arrive, from the stored state.
    for n in 0..4 {
        let fresh = format!("fresh-{n}");
        plugin_writes_ahead(&a.schema, &fresh, &json!({"partial": {"n": 100}})).await;
        let via = if n % 2 == 0 { &a } else { &b };
        via.patch_state(&fresh, &json!({"partial": {"m": n}}))
            .await
            .expect(StatusCode::OK);
        let served = a.get_state(&fresh).await.json();
        assert_eq!(served["partial"], json!({"n": 100, "m": n}), "{fresh}");
    }
}

/// A lock holder of the mixed checker: `cycles` times lock, read the
/// partial state's counter, PATCH it + 1 under the lease, renew, unlock,
/// logging the interval it held the lease. Between cycles it waits for an
/// unlocked write to be acknowledged (or for the writers to be done): the
/// holders queue for the lease back to back otherwise, and the writers
/// would only get in once they are done.
async fn holder(
    api: Api,
    id: &'static str,
    name: String,
    cycles: usize,
    log: Log,
    mut progress: watch::Receiver<Progress>,
) {
    for _ in 0..cycles {
        // The wait is a give-up for a loaded machine, not a bound under test.
        let (lease, token) = api.lease(id, &name, 30, 240.0).await;
        let start = Instant::now();
        let read = retried(|| api.get_state(id)).await;
        let counter = match read.status {
            StatusCode::OK => read.json()["partial"]["counter"].as_u64().unwrap_or(0),
            StatusCode::NOT_FOUND => 0,
            other => panic!("{name}: read failed: {other} {}", read.text),
        };
        let next = json!({"partial": {"counter": counter + 1}});
        let write = retried(|| api.patch_state_with_lease(id, &next, &lease)).await;
        assert!(write.status.is_success(), "{name}: {}", write.text);
        retried(|| api.renew(id, &lease, 30))
            .await
            .expect_because(StatusCode::OK, &name);
        let end = Instant::now();
        retried(|| api.release(id, &lease))
            .await
            .expect_because(StatusCode::NO_CONTENT, &name);
        log.lock().unwrap().push(Held { start, end, token });
        let seen = progress.borrow_and_update().acknowledged;
        progress
            .wait_for(|now| now.acknowledged > seen || now.writers_done == now.writers)
            .await
            .unwrap();
    }
}

/// How far the unlocked writers are, for the holders to wait on.
#[derive(Clone, Copy, Debug, Default)]
struct Progress {
    acknowledged: u64,
    writers_done: usize,
    writers: usize,
}

/// An unlocked writer of the mixed checker: PATCHes its own key `key` with
/// 1..=writes and no lease, alternating between the gateways, each value
/// again until it is acknowledged: after a 409 `state-locked` (a holder
/// has the lease) and after a 503 with `Retry-After`, as a client does.
/// Answers the last value acknowledged.
async fn unlocked_writer(
    apis: [Api; 2],
    id: &'static str,
    key: String,
    writes: u64,
    progress: Arc<watch::Sender<Progress>>,
) -> u64 {
    let mut acknowledged = 0;
    for i in 1..=writes {
        let body = json!({"partial": {key.as_str(): i}});
        // A give-up for a machine that stalls, not a bound under test.
        let give_up = Instant::now() + Duration::from_secs(120);
        let mut attempt = 0;
        loop {
            assert!(
                Instant::now() < give_up,
                "{key}: write {i} never acknowledged"
            );
            let reply = apis[(i as usize + attempt) % 2]
                .patch_state(id, &body)
                .await;
            attempt += 1;
            match reply.status {
                status if status.is_success() => break,
                StatusCode::CONFLICT if reply.problem_type() == "state-locked" => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                StatusCode::SERVICE_UNAVAILABLE => {
                    let after = reply.header("retry-after");
                    let seconds: u64 = after.and_then(|s| s.parse().ok()).unwrap_or_else(|| {
                        panic!("{key}: a 503 without Retry-After: {}", reply.text)
                    });
                    tokio::time::sleep(Duration::from_secs(seconds)).await;
                }
                other => panic!("{key}: write {i} answered {other}: {}", reply.text),
            }
        }
        acknowledged = i;
        progress.send_modify(|p| p.acknowledged += 1);
    }
    progress.send_modify(|p| p.writers_done += 1);
    acknowledged
}

/// The lock checker with unlocked writers beside it, on one id through
/// two gateways: holders increment a counter under their leases, unlocked
/// writers each PATCH a key of their own between the leases. No lease
/// overlaps another, the counter counts every cycle (no unlocked write
/// overwrote it), and each writer's key holds its last acknowledged value
/// (no acknowledged unlocked write was lost), as read through either gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unlocked_writers_and_lock_holders_share_one_id_through_two_gateways() {
    const HOLDERS: usize = 4;
    const CYCLES: usize = 8;
    const WRITERS: usize = 3;
    const WRITES: u64 = 12;
    let (a, b) = two_peers().await;
    let id = "mixed";
    let log: Log = Arc::default();
    let (progress, watching) = watch::channel(Progress {
        writers: WRITERS,
        ..Progress::default()
    });
    let progress = Arc::new(progress);
    let holders: Vec<_> = (0..HOLDERS)
        .map(|k| {
            let api = if k % 2 == 0 { &a } else { &b };
            let name = format!("holder-{k}");
            tokio::spawn(holder(
                api.api.clone(),
                id,
                name,
                CYCLES,
                log.clone(),
                watching.clone(),
            ))
        })
        .collect();
    let writers: Vec<_> = (0..WRITERS)
        .map(|k| {
            let apis = [a.api.clone(), b.api.clone()];
            let key = format!("w{k}");
            tokio::spawn(unlocked_writer(apis, id, key, WRITES, progress.clone()))
        })
        .collect();
    for task in holders {
        task.await.unwrap();
    }
    let mut last = Vec::new();
    for task in writers {
        last.push(task.await.unwrap());
    }
    check(&log, HOLDERS * CYCLES);
    for gateway in [&a, &b] {
        let partial = gateway.get_state(id).await.json()["partial"].clone();
        assert_eq!(partial["counter"], (HOLDERS * CYCLES) as u64, "{partial}");
        for (k, acknowledged) in last.iter().enumerate() {
            assert_eq!(partial[format!("w{k}")], *acknowledged, "w{k}: {partial}");
        }
    }
}
