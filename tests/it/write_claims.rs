//! Claims taken for unlocked writes (issue 45): an id written again through
//! a gateway within `--claim-idle` is claimed by it in the background, and
//! its later writes cost one statement, their INSERT. A one-off write
//! starts nothing; writes through another gateway are forwarded to the
//! authority; a lock on the id is granted under that claim; and a killed
//! authority holds the id's writes only until its claim lapses.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::{
    Api, clickhouse_url, metric, queries, spawn_app, spawn_configured, spawn_peer_process,
    test_config, two_peers, unique_schema, write_path_statements,
};

/// How many claims the gateway took for writes.
async fn write_claims(api: &Api) -> f64 {
    let text = api.get("/metrics").await.text;
    metric(
        &text,
        r#"statehouse_lock_events_total{event="claim_for_writes"}"#,
    )
    .unwrap_or(0.0)
}

/// Writes `id` through `api` until the gateway has claimed it for writes:
/// the second write starts the attempt, which settles in the background.
/// The bound is generous: the attempt's few statements can queue behind
/// every other test's at the local ClickHouse on a loaded 2-core machine.
async fn write_until_claimed(api: &Api, id: &str) {
    let before = write_claims(api).await;
    let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
    for n in 0.. {
        api.put_state(id, &json!({"completed": {"warm": n}}))
            .await
            .expect_because(StatusCode::OK, "warming up");
        if write_claims(api).await > before {
            return;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "{id} was never claimed for its writes"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn repeated_unlocked_writes_cost_one_statement_each_once_the_gateway_claims_the_id() {
    let app = spawn_app().await;
    app.put_state("repeated", &json!({"completed": {"warm": -1}}))
        .await
        .expect(StatusCode::CREATED);
    write_until_claimed(&app, "repeated").await;
    let before = write_path_statements(&app).await;
    for n in 0..20 {
        app.put_state("repeated", &json!({"completed": {"n": n}}))
            .await
            .expect(StatusCode::OK);
    }
    let per_write = (write_path_statements(&app).await - before) / 20.0;
    // One INSERT each, and one read of the row when the claim was new.
    assert!(
        per_write <= 1.1,
        "{per_write:.2} statements per write under a claim for writes"
    );
    assert_eq!(app.get_state("repeated").await.json()["completed"]["n"], 19);
}

/// While the gateway's claim for writes settles (table mode: its candidate
/// is first in line, not yet won), a write goes by its routing read alone,
/// which sees that candidate: the read and the INSERT, not a lock read and a
/// row read besides. A long settle keeps the claim unsettled throughout; in
/// keeper mode the claim is won at once and the writes cost less still.
#[tokio::test]
async fn writes_while_the_claim_for_them_settles_cost_the_routing_read_and_the_insert() {
    let mut config = test_config(&unique_schema());
    config.locks.settle = Duration::from_secs(20);
    let app = spawn_configured(config).await;
    let id = "settling";
    app.put_state(id, &json!({"completed": {"warm": 0}}))
        .await
        .expect(StatusCode::CREATED);
    app.put_state(id, &json!({"completed": {"warm": 1}}))
        .await
        .expect(StatusCode::OK);
    // The second write started the claim: wait until its candidate is in
    // ClickHouse (table mode) or it was won (keeper mode).
    let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
    while queries(&app, "claim").await == 0 && write_claims(&app).await == 0.0 {
        assert!(tokio::time::Instant::now() < give_up, "no claim started");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before = write_path_statements(&app).await;
    for n in 0..5 {
        app.put_state(id, &json!({"completed": {"n": n}}))
            .await
            .expect(StatusCode::OK);
    }
    let per_write = (write_path_statements(&app).await - before) / 5.0;
    assert!(
        per_write <= 2.0,
        "{per_write:.2} statements per write while the claim settles"
    );
    assert_eq!(app.get_state(id).await.json()["completed"]["n"], 4);
}

#[tokio::test]
async fn a_one_off_write_starts_no_claim() {
    let app = spawn_app().await;
    for n in 0..5 {
        app.put_state(&format!("one-off-{n}"), &json!({"completed": {"n": n}}))
            .await
            .expect(StatusCode::CREATED);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        write_claims(&app).await,
        0.0,
        "one write per id claims none"
    );
}

/// Two gateways: once one claims an id for its writes, writes through the
/// other are forwarded to it and land in order, a lock taken through the
/// other is granted by it and keeps unlocked writes out (409) until
/// released, and both serve the last acknowledged write.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_and_locks_through_a_non_authority_go_to_the_gateway_that_claimed_the_id() {
    let (a, b) = two_peers().await;
    let id = "dev:tap-claimed-to-target";
    a.put_state(id, &json!({"completed": {"n": 0}}))
        .await
        .expect(StatusCode::CREATED);
    write_until_claimed(&a, id).await;
    for n in 1..=6 {
        let via = if n % 2 == 0 { &a } else { &b };
        via.patch_state(id, &json!({"partial": {format!("k{n}"): n}}))
            .await
            .expect(StatusCode::OK);
    }
    let served = b.get_state(id).await.json();
    for n in 1..=6 {
        assert_eq!(served["partial"][format!("k{n}")], n, "{served}");
    }
    assert_eq!(
        write_claims(&b).await,
        0.0,
        "b forwarded, it claimed nothing"
    );

    let (lease, _) = b.lease(id, "holder", 60, 5.0).await;
    a.get(&format!("/v1/locks/{id}"))
        .await
        .expect_because(StatusCode::OK, "granted by the authority");
    let refused = b.put_state(id, &json!({"completed": {"n": 99}})).await;
    refused.expect(StatusCode::CONFLICT);
    assert_eq!(refused.problem_type(), "state-locked");
    a.put_state_with_lease(id, &json!({"completed": {"n": 100}}), &lease)
        .await
        .expect(StatusCode::OK);
    b.release(id, &lease).await.expect(StatusCode::NO_CONTENT);
    b.put_state(id, &json!({"completed": {"n": 101}}))
        .await
        .expect(StatusCode::OK);
    assert_eq!(a.get_state(id).await.json()["completed"]["n"], 101);
    assert_eq!(b.get_state(id).await.json()["completed"]["n"], 101);
}

/// A gateway killed while it holds an id's claim for writes: writes through
/// another gateway answer 503 with Retry-After until the claim lapses, then
/// land there; every acknowledged write is in the state.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_write_authority_holds_the_id_only_until_its_claim_lapses() {
    let schema = unique_schema();
    let args = [
        "--schema",
        &schema,
        "--claim-ttl",
        "3s",
        "--claim-settle",
        "200ms",
    ];
    let mut first = spawn_peer_process(&clickhouse_url(), &args).await;
    let second = spawn_peer_process(&clickhouse_url(), &args).await;
    let (a, b) = (first.api(), second.api());
    let id = "dev:tap-orphaned-to-target";
    a.put_state(id, &json!({"partial": {"a": 0}}))
        .await
        .expect(StatusCode::CREATED);
    write_until_claimed(&a, id).await;
    a.patch_state(id, &json!({"partial": {"a": 1}}))
        .await
        .expect(StatusCode::OK);
    first.child.kill().await.expect("kill -9");

    // Generous: the claim TTL, the settle and a loaded machine's slack.
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let reply = b.patch_state(id, &json!({"partial": {"b": 1}})).await;
        match reply.status {
            StatusCode::OK => break,
            StatusCode::SERVICE_UNAVAILABLE if tokio::time::Instant::now() < give_up => {
                assert!(reply.header("retry-after").is_some(), "{}", reply.text);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            _ => panic!("no write after the takeover bound: {}", reply.text),
        }
    }
    let served = b.get_state(id).await.json();
    assert_eq!(served["partial"], json!({"a": 1, "b": 1}));
}
