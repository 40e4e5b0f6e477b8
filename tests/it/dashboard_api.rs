//! What the dashboard reads beyond the states themselves: each version's
//! bookmark values (`history?bookmarks=true`), the regressed versions
//! across states (`/v1/regressions`) and what the caller may do
//! (`/v1/whoami`).

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use statehouse::auth::Tokens;

use crate::helpers::{spawn_app, spawn_app_with};

fn bookmarked(orders: Value, customers: Value) -> Value {
    json!({"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "updated_at", "replication_key_value": orders},
        "customers": {"replication_key": "id", "replication_key_value": customers},
        "partitioned": {"partitions": []},
    }}}})
}

#[tokio::test]
async fn history_with_bookmarks_shows_each_versions_values_as_stored() {
    let app = spawn_app().await;
    let first = bookmarked(json!("2026-11-01T00:00:00Z"), json!(41));
    assert!(app.put_state("shop", &first).await.status.is_success());
    let second = bookmarked(json!("2026-10-31T00:00:00Z"), json!(41.5));
    assert!(app.put_state("shop", &second).await.status.is_success());
    app.delete_state("shop")
        .await
        .expect(StatusCode::NO_CONTENT);

    let listing = app.get("/v1/states/shop/history?bookmarks=true").await;
    listing.expect(StatusCode::OK);
    let versions = listing.json()["versions"].as_array().unwrap().clone();
    assert_eq!(versions.len(), 3);
    assert_eq!(versions[0]["bookmarks"], json!({}), "a tombstone has none");
    assert_eq!(
        versions[1]["bookmarks"],
        json!({"orders": "2026-10-31T00:00:00Z", "customers": 41.5, "partitioned": null})
    );
    assert_eq!(versions[1]["regressed_streams"], json!(["orders"]));
    assert_eq!(versions[2]["bookmarks"]["customers"], json!(41));
    assert_eq!(versions[1]["partitions"], json!({"partitioned": []}));

    let plain = app.get("/v1/states/shop/history").await.json();
    assert!(plain["versions"][1].get("bookmarks").is_none());
    assert!(plain["versions"][1].get("partitions").is_none());
    let bad = app.get("/v1/states/shop/history?bookmarks=yes").await;
    bad.expect(StatusCode::BAD_REQUEST);
    assert_eq!(bad.problem_type(), "invalid-query");
}

#[tokio::test]
async fn history_with_bookmarks_shows_a_partitioned_streams_values_as_a_loss_names_them() {
    let app = spawn_app().await;
    let partitioned = json!({"completed": {"singer_state": {"bookmarks": {"orders": {"partitions": [
        {"context": {"shop": "a"}, "replication_key": "id", "replication_key_value": 9},
        {"context": {"shop": "b"}, "replication_key": "id", "replication_key_value": "2026-11-01T00:00:00Z"},
    ]}}}}});
    assert!(
        app.put_state("shop", &partitioned)
            .await
            .status
            .is_success()
    );
    let dropped = app.put_state("shop", &json!({"completed": {}})).await;
    assert!(dropped.status.is_success(), "{}", dropped.text);

    let versions = app
        .get("/v1/states/shop/history?bookmarks=true")
        .await
        .json()["versions"]
        .clone();
    assert_eq!(versions[0]["lost_streams"], json!(["orders"]));
    assert_eq!(versions[0]["partitions"], json!({}));
    assert_eq!(versions[1]["bookmarks"], json!({"orders": null}));
    assert_eq!(
        versions[1]["partitions"],
        json!({"orders": [
            {"context": {"shop": "a"}, "replication_key_value": 9},
            {"context": {"shop": "b"}, "replication_key_value": "2026-11-01T00:00:00Z"},
        ]})
    );
}

#[tokio::test]
async fn regressions_list_the_versions_that_went_backwards_newest_first() {
    let app = spawn_app().await;
    for (id, values) in [
        ("dev:a", ["2026-11-02T00:00:00Z", "2026-11-01T00:00:00Z"]),
        ("dev:b", ["2026-11-02T00:00:00Z", "2026-11-03T00:00:00Z"]),
        ("prod:c", ["2026-11-02T00:00:00Z", "2026-10-01T00:00:00Z"]),
    ] {
        for value in values {
            let put = app.put_state(id, &bookmarked(json!(value), json!(1))).await;
            assert!(put.status.is_success(), "{}", put.text);
        }
    }
    let all = app.get("/v1/regressions").await;
    all.expect(StatusCode::OK);
    let rows = all.json()["regressions"].as_array().unwrap().clone();
    let ids: Vec<&str> = rows
        .iter()
        .map(|r| r["state_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["prod:c", "dev:a"], "newest first, only regressions");
    assert_eq!(rows[0]["regressed_streams"], json!(["orders"]));
    assert_eq!(rows[0]["actor"], "anonymous");
    assert_eq!(rows[0]["operation"], "put");

    let dev = app.get("/v1/regressions?pattern=dev:*").await.json();
    assert_eq!(dev["regressions"].as_array().unwrap().len(), 1);
    let one = app.get("/v1/regressions?limit=1").await.json();
    assert_eq!(one["regressions"][0]["state_id"], "prod:c");
    let bad = app.get("/v1/regressions?limit=0").await;
    bad.expect(StatusCode::BAD_REQUEST);
}

const ROOT: &str = "dashboard-root-token-0123456789";
const READ_DEV: &str = "dashboard-read-dev-token-0123456789";

#[tokio::test]
async fn regressions_and_whoami_answer_for_the_token() {
    let app = spawn_app_with(|config| {
        let mut tokens = Tokens::default();
        let lines = format!("admin {ROOT} root\nread {READ_DEV} dev-dashboard scope=dev:*\n");
        tokens.add("test", &lines, '\n').unwrap();
        config.tokens = tokens;
    })
    .await;
    for id in ["dev:a", "prod:a"] {
        for value in [5, 3] {
            let body = bookmarked(json!(value), json!(1)).to_string();
            let bearer = format!("Bearer {ROOT}");
            let put = app
                .request(
                    Method::PUT,
                    &format!("/v1/states/{id}"),
                    Some(&body),
                    &[
                        ("authorization", &bearer),
                        ("content-type", "application/json"),
                    ],
                )
                .await;
            assert!(put.status.is_success(), "{}", put.text);
        }
    }
    let scoped = app
        .call(Method::GET, "/v1/regressions", None, READ_DEV)
        .await;
    let ids: Vec<Value> = scoped.json()["regressions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["state_id"].clone())
        .collect();
    assert_eq!(ids, [json!("dev:a")], "only ids in the token's scope");

    let me = app.call(Method::GET, "/v1/whoami", None, READ_DEV).await;
    me.expect(StatusCode::OK);
    assert_eq!(
        me.json(),
        json!({"tokens": true, "role": "read", "name": "dev-dashboard", "scope": ["dev:*"]})
    );
    let root = app.call(Method::GET, "/v1/whoami", None, ROOT).await.json();
    assert_eq!(root["role"], "admin");
    assert_eq!(root["scope"], Value::Null);
    app.get("/v1/whoami").await.expect(StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn without_tokens_everyone_is_an_admin_and_without_history_there_are_no_regressions() {
    let app = spawn_app_with(|config| config.history = statehouse::config::History::Off).await;
    let me = app.get("/v1/whoami").await;
    assert_eq!(
        me.json(),
        json!({"tokens": false, "role": "admin", "name": null, "scope": null})
    );
    let off = app.get("/v1/regressions").await;
    off.expect(StatusCode::NOT_FOUND);
    assert_eq!(off.problem_type(), "history-off");
}
