//! `/v1/bookmarks`: the effective state's bookmarks, one row per stream.

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::spawn_app;

#[tokio::test]
async fn each_stream_of_the_effective_state_is_a_row() {
    let app = spawn_app().await;
    app.put_state(
        "dev:shop",
        &json!({
            "completed": {"singer_state": {"bookmarks": {
                "orders": {"replication_key": "updated_at", "replication_key_value": "2026-11-01"},
                "customers": {"replication_key": "id", "replication_key_value": 41}
            }}},
            "partial": {"singer_state": {"bookmarks": {
                "orders": {"replication_key_value": "2026-12-01"}
            }}}
        }),
    )
    .await;
    app.put_state("dev:empty", &json!({"completed": {"anything": 1}}))
        .await;
    app.put_state("other", &json!({})).await;

    let reply = app.get("/v1/bookmarks?pattern=dev:*").await;
    reply.expect(StatusCode::OK);
    let body = reply.json();
    let rows = body["bookmarks"].as_array().unwrap();
    let row = |id: &str, stream: Value| {
        rows.iter()
            .find(|r| r["state_id"] == id && r["stream"] == stream)
            .unwrap_or_else(|| panic!("no row for {id} {stream}: {rows:?}"))
            .clone()
    };
    assert_eq!(rows.len(), 3, "{rows:?}");
    let orders = row("dev:shop", json!("orders"));
    assert_eq!(
        orders["replication_key"], "updated_at",
        "kept from completed"
    );
    assert_eq!(
        orders["replication_key_value"], "2026-12-01",
        "partial wins"
    );
    assert_eq!(
        orders["bookmark"],
        json!({"replication_key": "updated_at", "replication_key_value": "2026-12-01"})
    );
    assert_eq!(
        row("dev:shop", json!("customers"))["replication_key_value"],
        41
    );
    let empty = row("dev:empty", Value::Null);
    assert_eq!(empty["bookmark"], Value::Null);
    let age = empty["age_seconds"].as_f64().unwrap();
    assert!((0.0..600.0).contains(&age), "{age}");
    assert_eq!(
        empty["updated_at"],
        app.get_state("dev:empty").await.json()["updated_at"]
    );

    // Pages count states, with the listing's cursor.
    let first = app.get("/v1/bookmarks?pattern=dev:*&limit=1").await.json();
    assert_eq!(first["bookmarks"][0]["state_id"], "dev:empty");
    let cursor = first["next_cursor"].as_str().unwrap();
    let second = app
        .get(&format!(
            "/v1/bookmarks?pattern=dev:*&limit=1&cursor={cursor}"
        ))
        .await
        .json();
    assert_eq!(second["bookmarks"].as_array().unwrap().len(), 2);
    assert_eq!(second["next_cursor"], Value::Null);
    let foreign = app
        .get(&format!("/v1/bookmarks?pattern=other&cursor={cursor}"))
        .await;
    foreign.expect(StatusCode::BAD_REQUEST);
}

fn shop(orders: &str, customers: u64) -> Value {
    json!({"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "updated_at", "replication_key_value": orders},
        "customers": {"replication_key": "id", "replication_key_value": customers}
    }}}})
}

async fn regressed(app: &crate::helpers::TestApp, id: &str) -> Vec<(String, bool)> {
    let body = app.get(&format!("/v1/bookmarks?pattern={id}")).await.json();
    let mut rows: Vec<(String, bool)> = body["bookmarks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let stream = r["stream"].as_str().unwrap_or("").to_owned();
            (stream, r["last_change_regressed"].as_bool().unwrap())
        })
        .collect();
    rows.sort();
    rows
}

#[tokio::test]
async fn a_row_says_whether_its_streams_newest_change_went_backwards() {
    let app = spawn_app().await;
    app.put_state("shop", &shop("2026-11-02T00:00:00Z", 41))
        .await;
    app.put_state("shop", &shop("2026-11-01T00:00:00Z", 42))
        .await;
    let back = [("customers".to_owned(), false), ("orders".to_owned(), true)];
    assert_eq!(regressed(&app, "shop").await, back);

    // A later change of another stream leaves the orders' last change as it was.
    app.put_state("shop", &shop("2026-11-01T00:00:00Z", 43))
        .await;
    assert_eq!(regressed(&app, "shop").await, back);

    // Moving forward again clears it.
    app.put_state("shop", &shop("2026-11-03T00:00:00Z", 43))
        .await;
    assert_eq!(
        regressed(&app, "shop").await,
        [
            ("customers".to_owned(), false),
            ("orders".to_owned(), false)
        ]
    );

    app.put_state("plain", &json!({"completed": {}})).await;
    assert_eq!(regressed(&app, "plain").await, [(String::new(), false)]);
}
