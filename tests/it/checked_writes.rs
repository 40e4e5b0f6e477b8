//! A write's INSERT checks, in the same statement, that the id's stored row
//! is still the one the write was decided against. Under a lease the
//! gateway is the id's authority and decides from what it remembers, so a
//! row another writer (the ClickHouse plugin) puts straight into the state
//! table is caught by the check: nothing of the refused INSERT lands, and
//! the write is decided again against the stored row.

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use statehouse::config::History;
use statehouse::domain::GuardMode;

use crate::helpers::{
    Api, TestApp, metric, plugin_writes_ahead, raw_sql, spawn_app, spawn_app_with,
};
use crate::proxy::spawn_app_behind_proxy;

/// Both halves of `doc`, as `stored` reads them (a missing half is `{}`).
fn halves(doc: &Value) -> Value {
    json!({
        "completed": doc.get("completed").cloned().unwrap_or(json!({})),
        "partial": doc.get("partial").cloned().unwrap_or(json!({})),
    })
}

fn bookmarked(value: &str) -> Value {
    json!({"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "updated_at", "replication_key_value": value}
    }}}})
}

async fn stale_writes(api: &Api) -> f64 {
    metric(
        &api.get("/metrics").await.text,
        "statehouse_stale_writes_total",
    )
    .unwrap_or(0.0)
}

/// `id`'s document as ClickHouse holds it now (FINAL), not as the
/// authority remembers it.
async fn stored(app: &TestApp, id: &str) -> Value {
    let row = raw_sql(&format!(
        "SELECT completed_state, partial_state FROM `{}`.state FINAL
         WHERE state_id = '{id}' FORMAT JSONCompactEachRow",
        app.schema
    ))
    .await;
    let halves: Vec<String> = serde_json::from_str(row.trim()).expect("one row");
    json!({
        "completed": serde_json::from_str::<Value>(&halves[0]).unwrap(),
        "partial": serde_json::from_str::<Value>(&halves[1]).unwrap(),
    })
}

async fn send_with_lease(
    app: &TestApp,
    method: Method,
    id: &str,
    body: &Value,
    lease: &str,
) -> crate::api::Reply {
    // `id` needs no escaping in a path.
    let path = format!("/v1/states/{id}");
    app.request(
        method,
        &path,
        Some(&body.to_string()),
        &[("lease-id", lease)],
    )
    .await
}

async fn leased_writes_are_decided_against_the_plugins_row(history: History) {
    let app = spawn_app_with(|config| {
        config.bookmark_regression = GuardMode::Reject;
        config.history = history;
    })
    .await;
    let id = "tap-leased-to-target";
    let (lease, _) = app.lease(id, "runner", 60, 0.0).await;
    send_with_lease(&app, Method::PUT, id, &bookmarked("2026-01-01"), &lease)
        .await
        .expect(StatusCode::CREATED);
    let refused_before = stale_writes(&app).await;

    plugin_writes_ahead(&app.schema, id, &bookmarked("2026-02-10")).await;
    // Decided against the remembered row (January) it would go forward;
    // against the plugin's (February) it goes back.
    let back = send_with_lease(&app, Method::PUT, id, &bookmarked("2026-01-20"), &lease).await;
    back.expect(StatusCode::CONFLICT);
    assert_eq!(back.problem_type(), "bookmark-regression");
    assert_eq!(stale_writes(&app).await, refused_before + 1.0);
    assert_eq!(stored(&app, id).await, halves(&bookmarked("2026-02-10")));

    send_with_lease(&app, Method::PUT, id, &bookmarked("2026-02-20"), &lease)
        .await
        .expect(StatusCode::OK);
    assert_eq!(
        stored(&app, id).await,
        halves(&bookmarked("2026-02-20")),
        "the write wins over the row stamped ahead"
    );

    // A PATCH merges into the plugin's row.
    plugin_writes_ahead(&app.schema, id, &json!({"partial": {"n": 100}})).await;
    send_with_lease(
        &app,
        Method::PATCH,
        id,
        &json!({"partial": {"m": 1}}),
        &lease,
    )
    .await
    .expect(StatusCode::OK);
    assert_eq!(stored(&app, id).await["partial"], json!({"n": 100, "m": 1}));
    assert_eq!(stale_writes(&app).await, refused_before + 2.0);
    assert_eq!(
        app.get_state(id).await.json()["partial"],
        json!({"n": 100, "m": 1})
    );
}

#[tokio::test]
async fn a_leased_write_is_checked_against_a_row_written_straight_into_clickhouse() {
    leased_writes_are_decided_against_the_plugins_row(History::Kept(None)).await;
}

#[tokio::test]
async fn a_leased_write_is_checked_with_history_off() {
    leased_writes_are_decided_against_the_plugins_row(History::Off).await;
}

/// The rows of a checked INSERT are in its text: an id and a document with
/// quotes, backslashes, question marks and braces, and a document past
/// ClickHouse's default `max_query_size` (256 KiB), go through as sent.
#[tokio::test]
async fn a_checked_insert_carries_any_id_and_a_large_document() {
    let app = spawn_app().await;
    let id = r"tap-o'brien?{x:String}\`-to-target";
    let text = r#"it's a \ "quoted" ? {y:String} `tick`"#;
    let large = "x".repeat(400 << 10);
    for n in 0..2 {
        let doc = json!({"completed": {"n": n, "text": text, "large": large}});
        let put = app.put_state(id, &doc).await;
        assert!(put.status.is_success(), "{}", put.text);
        assert_eq!(
            app.get_state(id).await.json()["completed"],
            doc["completed"]
        );
    }
    assert_eq!(stale_writes(&app).await, 0.0);
}

/// Two leased writes that queue behind a held INSERT go out together in the
/// next batch, whose check covers both ids; one of them was written
/// straight into ClickHouse meanwhile. ClickHouse refuses the batch whole,
/// and each write is decided again and lands: the one on the plugin's row
/// merges into it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_refused_for_one_of_its_ids_lands_every_write_of_it_decided_again() {
    let (app, proxy) = spawn_app_behind_proxy(|_| {}).await;
    let (a, b) = ("batched-a", "batched-b");
    let mut leases = Vec::new();
    for id in [a, b] {
        let (lease, _) = app.lease(id, "worker", 60, 0.0).await;
        app.patch_state_with_lease(id, &json!({"partial": {"n": 0}}), &lease)
            .await
            .expect(StatusCode::CREATED);
        leases.push(lease);
    }
    plugin_writes_ahead(&app.schema, b, &json!({"partial": {"plugin": 1}})).await;
    let refused_before = stale_writes(&app).await;

    // A one-off write holds the INSERT on its way; the two leased ones
    // queue behind it and go out together.
    proxy.hold_requests_containing(Some((
        &["INSERT INTO", "state_history"],
        Duration::from_millis(1000),
    )));
    let holding = {
        let api = app.api.clone();
        tokio::spawn(async move {
            api.put_state("batched-first", &json!({"completed": {}}))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let queued: Vec<_> = [a, b]
        .into_iter()
        .zip(leases)
        .map(|(id, lease)| {
            let api = app.api.clone();
            tokio::spawn(async move {
                api.patch_state_with_lease(id, &json!({"partial": {"n": 1}}), &lease)
                    .await
            })
        })
        .collect();
    holding.await.unwrap().expect(StatusCode::CREATED);
    proxy.hold_requests_containing(None);
    for write in queued {
        write.await.unwrap().expect(StatusCode::OK);
    }
    assert!(
        stale_writes(&app).await > refused_before,
        "the batch of both was refused"
    );
    assert_eq!(stored(&app, a).await["partial"], json!({"n": 1}));
    assert_eq!(
        stored(&app, b).await["partial"],
        json!({"n": 1, "plugin": 1})
    );
}
