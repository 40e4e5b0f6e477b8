//! Unlocked writes (issue 45): a write to an id no gateway holds a claim on
//! reads the id's lock rows and its current row in one statement, its
//! routing read, and is decided against that row. What must not bend: the
//! row is the stored state (rows written straight into ClickHouse
//! included), the write wins over a row stamped ahead, and the lock rule is
//! the same through any gateway.

use reqwest::StatusCode;
use serde_json::{Value, json};
use statehouse::domain::GuardMode;

use crate::helpers::{Api, metric, raw_sql, spawn_app, spawn_app_with, two_peers};

/// The write path's statements so far: routing and lock reads, current
/// rows, INSERTs (background work left out).
async fn statements(api: &Api) -> f64 {
    let text = api.get("/metrics").await.text;
    ["route_read", "lock_read", "get", "history_record", "put"]
        .iter()
        .filter_map(|op| {
            metric(
                &text,
                &format!(
                    r#"statehouse_clickhouse_query_duration_seconds_count{{operation="{op}"}}"#
                ),
            )
        })
        .sum()
}

fn bookmarked(value: &str) -> Value {
    json!({"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "updated_at", "replication_key_value": value}
    }}}})
}

/// Writes `doc` as `id`'s row straight into the state table, as the
/// ClickHouse plugin does, stamped an hour ahead of the clock.
async fn plugin_writes_ahead(schema: &str, id: &str, doc: &Value) {
    raw_sql(&format!(
        "INSERT INTO `{schema}`.state (state_id, partial_state, completed_state, updated_at)
         SETTINGS async_insert=0
         VALUES ('{id}', '{}', '{}', now64(3) + INTERVAL 1 HOUR)",
        doc.get("partial").unwrap_or(&json!({})),
        doc.get("completed").unwrap_or(&json!({})),
    ))
    .await;
}

/// Sequential unlocked PUTs cost their routing read (with the current row)
/// and their INSERT. The margin: a routing read slower than half the claim
/// settle (100 ms in tests) is followed by a fresh read under the writer
/// lock, which a loaded machine may cause now and then.
#[tokio::test]
async fn an_unlocked_write_costs_its_routing_read_and_its_insert() {
    let app = spawn_app().await;
    let before = statements(&app).await;
    for n in 0..8 {
        let put = app
            .put_state("one-off", &json!({"completed": {"n": n}}))
            .await;
        assert!(put.status.is_success(), "{}", put.text);
    }
    let per_write = (statements(&app).await - before) / 8.0;
    assert!(
        per_write <= 2.5,
        "{per_write:.2} statements per unlocked write"
    );
    assert_eq!(app.get_state("one-off").await.json()["completed"]["n"], 7);
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
