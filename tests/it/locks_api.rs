//! The lock endpoints and how locks guard state writes.

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::helpers::{
    joined, peer_config, queries, raw_sql, spawn_app, spawn_configured, test_config, two_peers,
    unique_schema,
};

#[tokio::test]
async fn acquire_inspect_release() {
    let app = spawn_app().await;
    let reply = app
        .acquire("job", &json!({"owner": "worker-1", "ttl_seconds": 60}))
        .await;
    reply.expect(StatusCode::CREATED);
    let lease = reply.json();
    assert_eq!(lease["owner"], "worker-1");
    assert_eq!(lease["state_id"], "job");
    assert!(lease["fencing_token"].as_u64().unwrap() >= 1);
    let lease_id = lease["lease_id"].as_str().unwrap();

    let one = app.get("/v1/locks/job").await;
    one.expect(StatusCode::OK);
    let view = one.json();
    assert_eq!(view["owner"], "worker-1");
    assert_eq!(view["expires_at"], lease["expires_at"]);
    assert!(
        view.get("lease_id").is_none(),
        "others never see the lease_id"
    );
    let all = app.get("/v1/locks").await.json();
    assert_eq!(all["locks"].as_array().unwrap().len(), 1);
    assert_eq!(all["locks"][0]["state_id"], "job");

    app.release("job", lease_id)
        .await
        .expect(StatusCode::NO_CONTENT);
    let gone = app.get("/v1/locks/job").await;
    gone.expect(StatusCode::NOT_FOUND);
    assert_eq!(gone.problem_type(), "lock-not-found");
    let twice = app.release("job", lease_id).await;
    twice.expect(StatusCode::CONFLICT);
    assert_eq!(twice.problem_type(), "lease-not-current");
    let renew = app
        .request(Method::PUT, &format!("/v1/locks/job/{lease_id}"), None, &[])
        .await;
    renew.expect_because(StatusCode::CONFLICT, "a released lease cannot be renewed");
    // Released leases leave the listing (the release is recorded in the background).
    for _ in 0..50 {
        if app.get("/v1/locks").await.json()["locks"]
            .as_array()
            .unwrap()
            .is_empty()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("released lease still listed");
}

#[tokio::test]
async fn a_held_lock_answers_409_with_the_holder_after_the_wait() {
    let app = spawn_app().await;
    app.lease("busy", "first", 60, 0.0).await;
    let now = app.acquire("busy", &json!({"owner": "second"})).await;
    now.expect(StatusCode::CONFLICT);
    assert_eq!(now.problem_type(), "lock-held");
    assert_eq!(now.json()["holder"]["owner"], "first");
    // No wait was asked for, so none is said to have run out.
    assert_eq!(now.json()["detail"], "busy is locked by another holder");
    let waited = app
        .acquire("busy", &json!({"owner": "third", "wait_seconds": 0.5}))
        .await;
    waited.expect(StatusCode::CONFLICT);
    assert_eq!(waited.json()["holder"]["owner"], "first");
    // Other state_ids are not held up.
    let other = app.acquire("free", &json!({"owner": "second"})).await;
    other.expect(StatusCode::CREATED);
}

#[tokio::test]
async fn waiters_are_served_first_come_first_served() {
    let app = spawn_app().await;
    let (holder, _) = app.lease("queue", "holder", 60, 0.0).await;
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for name in ["a", "b", "c", "d"] {
        let (api, order) = (app.api.clone(), order.clone());
        waiters.push(tokio::spawn(async move {
            let (lease, _) = api.lease("queue", name, 60, 30.0).await;
            order.lock().unwrap().push(name);
            tokio::time::sleep(Duration::from_millis(30)).await;
            api.release("queue", &lease)
                .await
                .expect(StatusCode::NO_CONTENT);
        }));
        // Each waiter is queued before the next one asks.
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    app.release("queue", &holder)
        .await
        .expect(StatusCode::NO_CONTENT);
    for waiter in waiters {
        waiter.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), ["a", "b", "c", "d"]);
}

#[tokio::test]
async fn renew_extends_and_an_expired_lease_is_gone() {
    let app = spawn_app().await;
    let first = app
        .acquire("ttl", &json!({"owner": "w", "ttl_seconds": 1}))
        .await
        .json();
    let lease_id = first["lease_id"].as_str().unwrap();
    let renewed = app
        .request(
            Method::PUT,
            &format!("/v1/locks/ttl/{lease_id}"),
            Some(r#"{"ttl_seconds": 120}"#),
            &[],
        )
        .await;
    renewed.expect(StatusCode::OK);
    assert!(renewed.json()["expires_at"].as_str() > first["expires_at"].as_str());
    assert_eq!(renewed.json()["fencing_token"], first["fencing_token"]);

    let short = app
        .acquire("short", &json!({"owner": "w", "ttl_seconds": 1}))
        .await
        .json();
    let short_id = short["lease_id"].as_str().unwrap();
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let late = app
        .request(
            Method::PUT,
            &format!("/v1/locks/short/{short_id}"),
            None,
            &[],
        )
        .await;
    late.expect(StatusCode::CONFLICT);
    assert_eq!(late.problem_type(), "lease-not-current");
    app.get("/v1/locks/short")
        .await
        .expect(StatusCode::NOT_FOUND);
    let next = app.acquire("short", &json!({"owner": "next"})).await;
    next.expect(StatusCode::CREATED);
}

#[tokio::test]
async fn locked_states_take_writes_only_with_the_holders_lease() {
    let app = spawn_app().await;
    app.put_state("guarded", &json!({"completed": {"n": 0}}))
        .await;
    let (lease, _) = app.lease("guarded", "owner", 60, 0.0).await;
    let before = app.table_snapshot().await;

    let without = app
        .put_state("guarded", &json!({"completed": {"n": 1}}))
        .await;
    without.expect(StatusCode::CONFLICT);
    assert_eq!(without.problem_type(), "state-locked");
    assert_eq!(without.json()["holder"]["owner"], "owner");
    let wrong = app
        .put_state_with_lease(
            "guarded",
            &json!({"completed": {"n": 1}}),
            "00000000-0000-4000-8000-000000000000",
        )
        .await;
    wrong.expect(StatusCode::CONFLICT);
    assert_eq!(wrong.problem_type(), "lease-not-current");
    let patch = app
        .patch_state("guarded", &json!({"partial": {"x": 1}}))
        .await;
    patch.expect(StatusCode::CONFLICT);
    let delete = app.delete_state("guarded").await;
    delete.expect(StatusCode::CONFLICT);
    let bad_header = app
        .request(
            Method::PUT,
            "/v1/states/guarded",
            Some("{}"),
            &[("lease-id", "not-a-uuid")],
        )
        .await;
    assert_eq!(bad_header.problem_type(), "invalid-header");
    assert_eq!(
        app.table_snapshot().await,
        before,
        "refused writes changed nothing"
    );

    let right = app
        .put_state_with_lease("guarded", &json!({"completed": {"n": 1}}), &lease)
        .await;
    right.expect(StatusCode::OK);
    let reads_need_no_lease = app.get_state("guarded").await;
    assert_eq!(reads_need_no_lease.json()["completed"]["n"], 1);

    app.release("guarded", &lease).await;
    let stale = app
        .put_state_with_lease("guarded", &json!({"completed": {"n": 2}}), &lease)
        .await;
    stale.expect_because(
        StatusCode::CONFLICT,
        "a released lease cannot write, even unlocked",
    );
    let unlocked = app
        .put_state("guarded", &json!({"completed": {"n": 3}}))
        .await;
    unlocked.expect(StatusCode::OK);
}

#[tokio::test]
async fn force_unlock_ends_the_lease_for_its_holder() {
    let app = spawn_app().await;
    let (lease, token) = app.lease("stuck", "crashed-worker", 3600, 0.0).await;
    let forced = app
        .request(Method::DELETE, "/v1/locks/stuck", None, &[])
        .await;
    forced.expect(StatusCode::NO_CONTENT);
    app.get("/v1/locks/stuck")
        .await
        .expect(StatusCode::NOT_FOUND);
    let write = app.put_state_with_lease("stuck", &json!({}), &lease).await;
    write.expect(StatusCode::CONFLICT);
    app.release("stuck", &lease)
        .await
        .expect(StatusCode::CONFLICT);
    let (_, next) = app.lease("stuck", "next-worker", 60, 0.0).await;
    assert!(next > token);
    let again = app
        .request(Method::DELETE, "/v1/locks/nothing-here", None, &[])
        .await;
    again.expect_because(StatusCode::NO_CONTENT, "force-unlock is idempotent");
}

#[tokio::test]
async fn fencing_tokens_increase_across_a_gateway_restart_and_repeat_acquires_skip_the_settle() {
    let schema = unique_schema();
    let first = spawn_configured(test_config(&schema)).await;
    let mut last = 0;
    for _ in 0..5 {
        let (lease, token) = first.lease("fenced", "w", 60, 0.0).await;
        assert!(token > last, "{token} after {last}");
        last = token;
        first.release("fenced", &lease).await;
    }
    let metrics = first.get("/metrics").await.text;
    assert!(
        metrics.contains(r#"statehouse_lock_events_total{event="claim_win"} 1"#),
        "five acquires, one claim:\n{metrics}"
    );
    assert!(metrics.contains(r#"statehouse_lock_events_total{event="grant"} 5"#));
    drop(first);

    let second = spawn_configured(test_config(&schema)).await;
    // The first gateway's claim is released or expires; the wait covers both.
    let (_, token) = second.lease("fenced", "w", 60, 30.0).await;
    assert!(token > last, "after a restart: {token} after {last}");
}

#[tokio::test]
async fn bad_lock_requests_are_refused() {
    let app = spawn_app().await;
    for (body, problem) in [
        (r#"{}"#, "invalid-body"),
        (r#"{"owner": ""}"#, "invalid-body"),
        (r#"{"owner": "w", "ttl_seconds": 0}"#, "invalid-body"),
        (r#"{"owner": "w", "ttl_seconds": 3601}"#, "invalid-body"),
        (r#"{"owner": "w", "wait_seconds": -1}"#, "invalid-body"),
        (r#"{"owner": "w", "wait_seconds": 301}"#, "invalid-body"),
        (
            r#"{"owner": "w", "lock_delay_seconds": -1}"#,
            "invalid-body",
        ),
        (
            r#"{"owner": "w", "lock_delay_seconds": 1.5}"#,
            "invalid-body",
        ),
        (r#"{"owner": "w", "colour": "red"}"#, "invalid-body"),
        (r#"{"owner": 5}"#, "invalid-body"),
        (r#"{"owner": "#, "invalid-json"),
        ("", "invalid-body"),
    ] {
        let reply = app
            .request(Method::POST, "/v1/locks/x", Some(body), &[])
            .await;
        reply.expect_because(StatusCode::BAD_REQUEST, body);
        assert_eq!(reply.problem_type(), problem, "{body}");
    }
    let bad_lease = app
        .request(Method::DELETE, "/v1/locks/x/not-a-uuid", None, &[])
        .await;
    bad_lease.expect(StatusCode::BAD_REQUEST);
    let unknown = app
        .request(
            Method::DELETE,
            "/v1/locks/x/00000000-0000-4000-8000-000000000000",
            None,
            &[],
        )
        .await;
    unknown.expect(StatusCode::CONFLICT);
    assert_eq!(
        app.get("/v1/locks").await.json()["locks"],
        json!([]),
        "nothing was locked"
    );
}

/// openapi.yaml says integer for the whole seconds of a lock request, and a
/// JSON integer may be written `5.0`: every such field takes it.
#[tokio::test]
async fn whole_seconds_may_be_written_as_floats() {
    let app = spawn_app().await;
    let body = r#"{"owner": "w", "ttl_seconds": 30.0, "lock_delay_seconds": 5.0}"#;
    let held = app
        .request(Method::POST, "/v1/locks/floats", Some(body), &[])
        .await;
    held.expect(StatusCode::CREATED);
    assert_eq!(held.json()["lock_delay_seconds"], 5);
    let lease_id = held.json()["lease_id"].as_str().unwrap().to_owned();
    let renewed = app
        .request(
            Method::PUT,
            &format!("/v1/locks/floats/{lease_id}"),
            Some(r#"{"ttl_seconds": 60.0}"#),
            &[],
        )
        .await;
    renewed.expect(StatusCode::OK);
}

#[tokio::test]
async fn an_idle_claim_is_released_and_locks_show_through_every_gateway() {
    let schema = unique_schema();
    let with_timings = |schema: &str| {
        let mut config = peer_config(schema);
        // Renewal ticks every second; an idle claim goes after half a second.
        config.locks.claim_ttl = Duration::from_secs(3);
        config.locks.claim_idle = Duration::from_millis(500);
        config
    };
    let a = spawn_configured(with_timings(&schema)).await;
    let b = spawn_configured(with_timings(&schema)).await;

    let (lease, _) = a.lease("shared", "on-a", 60, 0.0).await;
    let seen_from_b = b.get("/v1/locks/shared").await;
    seen_from_b.expect(StatusCode::OK);
    assert_eq!(seen_from_b.json()["owner"], "on-a");
    let gateway_a = seen_from_b.json()["gateway_id"].clone();
    // The list is ClickHouse's record, written behind the grant.
    let mut listed = Value::Null;
    for _ in 0..50 {
        listed = b.get("/v1/locks").await.json()["locks"][0]["gateway_id"].clone();
        if listed == gateway_a {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(listed, gateway_a);
    let renew_via_b = b
        .request(Method::PUT, &format!("/v1/locks/shared/{lease}"), None, &[])
        .await;
    renew_via_b.expect(StatusCode::OK);
    let write_via_b = b
        .put_state_with_lease("shared", &json!({"completed": {"by": "a"}}), &lease)
        .await;
    write_via_b.expect_because(
        StatusCode::CREATED,
        "the holder's lease is honoured through every gateway",
    );
    let intruder = b.put_state("shared", &json!({})).await;
    assert_eq!(intruder.problem_type(), "state-locked");

    b.release("shared", &lease)
        .await
        .expect(StatusCode::NO_CONTENT);
    // A's claim is idle now: it lets go within a renewal tick plus the idle time,
    // so B's single try (no wait) finds no earlier candidate.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let reply = b.acquire("shared", &json!({"owner": "on-b"})).await;
    reply.expect(StatusCode::CREATED);
    let seen_from_a = a.get("/v1/locks/shared").await;
    assert_eq!(seen_from_a.json()["owner"], "on-b");
    assert_ne!(seen_from_a.json()["gateway_id"], gateway_a);
}

#[tokio::test]
async fn a_gateway_that_shuts_down_hands_its_claims_back() {
    let schema = unique_schema();
    let first = spawn_configured(test_config(&schema)).await;
    let (lease, _) = first.lease("handed-back", "w", 60, 0.0).await;
    first.release("handed-back", &lease).await;
    first.shut_down().await;
    // Its claim would stay live for --claim-ttl (10 s) had it not been withdrawn,
    // and a single try (no wait) would lose to it.
    let second = spawn_configured(test_config(&schema)).await;
    let reply = second
        .acquire("handed-back", &json!({"owner": "next"}))
        .await;
    reply.expect(StatusCode::CREATED);
}

/// A lease table made by the version before token blocks and forwarding
/// (no token kind, no URL column, no lock-delay columns) is upgraded in
/// place at start, keeping its fencing tokens.
#[tokio::test]
async fn a_lease_table_from_the_previous_version_is_upgraded_and_keeps_its_tokens() {
    let schema = unique_schema();
    raw_sql(&format!("CREATE DATABASE `{schema}`")).await;
    raw_sql(&format!(
        "CREATE TABLE `{schema}`.state_lease (
            state_id String, kind Enum8('claim' = 1, 'lease' = 2), claim_id UUID, lease_id UUID,
            gateway_id UUID, owner String, fencing_token UInt64, created_at DateTime64(3),
            expires_at DateTime64(3), released UInt8, version UInt64
        ) ENGINE = ReplacingMergeTree(version) ORDER BY (state_id, kind, claim_id)"
    ))
    .await;
    raw_sql(&format!(
        "INSERT INTO `{schema}`.state_lease VALUES ('old', 'lease', toUUID('00000000-0000-0000-0000-000000000000'),
            generateUUIDv4(), generateUUIDv4(), 'before', 41, now64(3) - 60, now64(3) - 30, 1, 41 * 1048576 + 1048575)"
    ))
    .await;
    let app = spawn_configured(test_config(&schema)).await;
    let (_, token) = app.lease("old", "after", 30, 0.0).await;
    assert!(token > 41, "token {token} continues above the old ones");
    let columns = raw_sql(&format!(
        "SELECT name FROM system.columns WHERE database = '{schema}' AND table = 'state_lease'
           AND name IN ('advertise_url', 'lock_delay_ms', 'ended_at') ORDER BY name"
    ))
    .await;
    assert_eq!(columns, "advertise_url\nended_at\nlock_delay_ms\n");
}

/// Meltano's cycle per STATE message (lock, read, write with the lease,
/// unlock) on an id this gateway is the authority for costs one synchronous
/// ClickHouse round trip: the write's INSERT (of its version, which writes
/// the state row through the history view).
#[tokio::test]
async fn a_state_message_cycle_on_the_authority_costs_one_clickhouse_round_trip() {
    let app = spawn_app().await;
    app.put_state("hot", &json!({"completed": {"n": 0}})).await;
    // The first message of a run claims the id and reads it from ClickHouse.
    let (lease, _) = app.lease("hot", "meltano", 30, 0.0).await;
    app.get_state("hot").await;
    app.release("hot", &lease).await;
    let writes_now = async || queries(&app, "history_record").await + queries(&app, "put").await;
    let (reads, writes) = (queries(&app, "get").await, writes_now().await);
    for n in 1..=5 {
        let (lease, _) = app.lease("hot", "meltano", 30, 0.0).await;
        let read = app.get_state("hot").await;
        assert_eq!(read.json()["completed"]["n"], n - 1);
        let write = app
            .put_state_with_lease("hot", &json!({"completed": {"n": n}}), &lease)
            .await;
        write.expect(StatusCode::OK);
        app.release("hot", &lease)
            .await
            .expect(StatusCode::NO_CONTENT);
    }
    assert_eq!(queries(&app, "get").await, reads, "no ClickHouse reads");
    assert_eq!(writes_now().await, writes + 5, "one INSERT per message");
    assert_eq!(
        app.get_state("hot").await.json()["completed"]["n"],
        5,
        "the state read back is the last one written"
    );
}

/// Lease rows are written behind, coalesced across ids and over time: a
/// burst of lock cycles on many ids costs ClickHouse a few INSERTs, not one
/// or two per cycle, and every row still lands (another gateway's listing
/// shows the last leases, released ones gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_rows_of_a_burst_of_lock_cycles_go_out_in_a_few_inserts() {
    let app = spawn_app().await;
    for n in 0..8 {
        let (lease, _) = app.lease(&format!("burst-{n}"), "warm-up", 30, 0.0).await;
        app.release(&format!("burst-{n}"), &lease).await;
    }
    // Let the warm-up's rows go out first.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = queries(&app, "lease_write").await;
    let started = std::time::Instant::now();
    let mut cycles = 0;
    for round in 0..25 {
        for n in 0..8 {
            let id = format!("burst-{n}");
            let (lease, _) = app.lease(&id, "worker", 30, 0.0).await;
            if round < 24 || n % 2 == 0 {
                app.release(&id, &lease).await;
            }
            cycles += 1;
        }
    }
    let took = started.elapsed();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let inserts = queries(&app, "lease_write").await - before;
    // One flush a second at most, and one more for the last rows.
    let most = took.as_secs() + 2;
    assert!(
        inserts <= most,
        "{cycles} cycles in {took:?} took {inserts} lease INSERTs (at most {most})"
    );
    // Another gateway lists from the rows in ClickHouse alone.
    let other = spawn_configured(test_config(&app.schema)).await;
    let listed: Vec<Value> = other.get("/v1/locks").await.json()["locks"]
        .as_array()
        .unwrap()
        .clone();
    let mut held: Vec<&str> = listed
        .iter()
        .map(|l| l["state_id"].as_str().unwrap())
        .collect();
    held.sort();
    assert_eq!(held, ["burst-1", "burst-3", "burst-5", "burst-7"]);
}

/// A write to an id no gateway holds a claim on reads the id's claims, lease
/// and current row once, in one statement, while it is routed, and its lock
/// check and its decision go by that read: two round trips in all (that read
/// and the INSERT). A lock read of such an id costs the routing read alone.
/// (A one-off write: a repeat would claim the id, see `write_claims`.)
#[tokio::test]
async fn an_unlocked_write_reads_the_lock_table_once() {
    // The routing read is trusted for half the settle time: a long settle
    // keeps it fresh on a slow machine.
    let mut config = test_config(&unique_schema());
    config.locks.settle = Duration::from_secs(20);
    let app = spawn_configured(config).await;
    app.put_state("warm", &json!({"completed": {"n": 0}})).await;
    joined(&app).await;
    let route_reads = queries(&app, "route_read").await;
    let lock_reads = queries(&app, "lock_read").await;
    let state_reads = queries(&app, "get").await;
    let inserts = queries(&app, "history_record").await;
    let write = app.put_state("cold", &json!({"completed": {"n": 1}})).await;
    write.expect(StatusCode::CREATED);
    assert_eq!(queries(&app, "route_read").await, route_reads + 1);
    assert_eq!(queries(&app, "lock_read").await, lock_reads);
    assert_eq!(queries(&app, "get").await, state_reads);
    assert_eq!(queries(&app, "history_record").await, inserts + 1);

    let lock = app.get("/v1/locks/cold").await;
    lock.expect(StatusCode::NOT_FOUND);
    assert_eq!(queries(&app, "lock_read").await, lock_reads + 1);
}

/// An authority keeps its ids' state in memory; a delete by pattern through
/// another gateway reaches it before that delete is answered.
#[tokio::test]
async fn a_delete_by_pattern_through_another_gateway_is_seen_by_the_authority() {
    let (a, b) = two_peers().await;
    let (lease, _) = a.lease("remembered", "w", 30, 0.0).await;
    a.put_state_with_lease("remembered", &json!({"completed": {"v": 1}}), &lease)
        .await;
    a.release("remembered", &lease).await;
    a.get_state("remembered").await.expect(StatusCode::OK);

    let deleted = b
        .request(Method::DELETE, "/v1/states?pattern=remember*", None, &[])
        .await;
    assert_eq!(deleted.json()["deleted"], 1);
    a.get_state("remembered")
        .await
        .expect(StatusCode::NOT_FOUND);
    let patch = a
        .patch_state("remembered", &json!({"partial": {"w": 2}}))
        .await;
    patch.expect(StatusCode::CREATED);
    assert_eq!(
        patch.json()["completed"],
        json!({}),
        "nothing deleted comes back"
    );
}
