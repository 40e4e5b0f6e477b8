//! Bookmarks that go backwards (`--bookmark-regression warn|reject|off`):
//! warned about in an answer header and /metrics, refused with 409 unless
//! allowed, or not compared. Rollbacks and stream resets are never refused.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::helpers::{
    Api, TestApp, encode_id, metric, raw_sql, spawn_app, spawn_app_with, spawn_configured,
    test_config, unique_schema,
};
use statehouse::domain::GuardMode;

fn state(orders: &str, users: u64) -> Value {
    json!({"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "updated_at", "replication_key_value": orders},
        "users": {"replication_key": "id", "replication_key_value": users}
    }}}})
}

async fn put(api: &Api, id: &str, body: &Value, allow: Option<&str>) -> crate::helpers::Reply {
    let headers: Vec<(&str, &str)> = allow
        .map(|a| vec![("statehouse-allow-regression", a)])
        .unwrap_or_default();
    api.request(
        Method::PUT,
        &format!("/v1/states/{}", encode_id(id)),
        Some(&body.to_string()),
        &headers,
    )
    .await
}

async fn regressions_counted(api: &Api) -> f64 {
    let text = api.get("/metrics").await.text;
    metric(&text, "statehouse_bookmark_regressions_total").unwrap()
}

async fn orders(api: &Api, id: &str) -> String {
    api.get_state(id).await.json()["completed"]["singer_state"]["bookmarks"]["orders"]
        ["replication_key_value"]
        .as_str()
        .unwrap()
        .to_owned()
}

async fn reject_app() -> TestApp {
    spawn_app_with(|config| config.bookmark_regression = GuardMode::Reject).await
}

#[tokio::test]
async fn by_default_a_regression_is_written_and_named_in_a_header_and_the_metric() {
    let app = spawn_app().await;
    put(&app, "job", &state("2024-05-01T10:00:00Z", 10), None).await;
    let before = regressions_counted(&app).await;
    let forward = put(&app, "job", &state("2024-05-01T12:00:00+01:00", 11), None).await;
    forward.expect(StatusCode::OK);
    assert_eq!(forward.header("statehouse-bookmark-regression"), None);

    let back = put(&app, "job", &state("2024-05-01T10:30:00+02:00", 9), None).await;
    back.expect(StatusCode::OK);
    assert_eq!(
        back.header("statehouse-bookmark-regression"),
        Some("orders, users")
    );
    assert_eq!(regressions_counted(&app).await - before, 2.0);
    assert_eq!(orders(&app, "job").await, "2024-05-01T10:30:00+02:00");
}

#[tokio::test]
async fn reject_refuses_a_regression_naming_each_stream_and_writes_nothing() {
    let app = reject_app().await;
    put(&app, "job", &state("2024-05-02", 10), None).await;
    let back = put(&app, "job", &state("2024-05-01", 10), None).await;
    back.expect(StatusCode::CONFLICT);
    assert_eq!(back.problem_type(), "bookmark-regression");
    let found = back.json()["regressions"].clone();
    assert_eq!(
        found,
        json!([{"stream": "orders", "from": "2024-05-02", "to": "2024-05-01"}])
    );
    assert_eq!(orders(&app, "job").await, "2024-05-02", "nothing written");

    // A PATCH whose partial moves the effective bookmark back is one too.
    let patch = app
        .patch_state(
            "job",
            &json!({"partial": {"singer_state": {"bookmarks": {"users": {"replication_key": "id", "replication_key_value": 3}}}}}),
        )
        .await;
    assert_eq!(patch.problem_type(), "bookmark-regression");
}

#[tokio::test]
async fn the_allow_header_lets_named_streams_or_all_of_them_through() {
    let app = reject_app().await;
    put(&app, "job", &state("2024-05-02", 10), None).await;
    let other = put(&app, "job", &state("2024-05-01", 10), Some("users")).await;
    assert_eq!(other.problem_type(), "bookmark-regression");
    let named = put(&app, "job", &state("2024-05-01", 10), Some("orders")).await;
    named.expect(StatusCode::OK);
    let all = put(&app, "job", &state("2024-04-01", 1), Some("*")).await;
    all.expect(StatusCode::OK);
    assert_eq!(
        all.header("statehouse-bookmark-regression"),
        Some("orders, users")
    );
    assert_eq!(orders(&app, "job").await, "2024-04-01");
}

#[tokio::test]
async fn off_compares_nothing() {
    let app = spawn_app_with(|config| config.bookmark_regression = GuardMode::Off).await;
    put(&app, "job", &state("2024-05-02", 10), None).await;
    let back = put(&app, "job", &state("2024-05-01", 9), None).await;
    back.expect(StatusCode::OK);
    assert_eq!(back.header("statehouse-bookmark-regression"), None);
}

#[tokio::test]
async fn a_changed_key_or_a_new_stream_is_not_a_regression() {
    let app = reject_app().await;
    put(&app, "job", &state("2024-05-02", 10), None).await;
    let rekeyed = json!({"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "created_at", "replication_key_value": "2020-01-01"},
        "users": {"replication_key": "id", "replication_key_value": 10},
        "items": {"replication_key": "id", "replication_key_value": 1}
    }}}});
    let reply = put(&app, "job", &rekeyed, None).await;
    reply.expect(StatusCode::OK);
}

#[tokio::test]
async fn rollback_and_stream_reset_are_never_refused() {
    let app = reject_app().await;
    put(&app, "job", &state("2024-05-01", 10), None).await;
    let history = app.get("/v1/states/job/history").await.json();
    let first = history["versions"][0]["version"]
        .as_str()
        .unwrap()
        .to_owned();
    put(&app, "job", &state("2024-05-02", 11), None).await;
    let rollback = app
        .request(
            Method::POST,
            "/v1/states/job/rollback",
            Some(&json!({"version": first}).to_string()),
            &[],
        )
        .await;
    assert!(rollback.status.is_success(), "{}", rollback.text);
    assert_eq!(orders(&app, "job").await, "2024-05-01");
    // Not refused, but recorded for what it is.
    let history = app.get("/v1/states/job/history").await.json();
    assert_eq!(
        history["versions"][0]["regressed_streams"],
        json!(["orders", "users"])
    );
    let reset = app
        .request(Method::DELETE, "/v1/states/job/bookmarks/orders", None, &[])
        .await;
    assert!(reset.status.is_success(), "{}", reset.text);
}

#[tokio::test]
async fn a_bulk_import_is_refused_whole_naming_the_entry_unless_allowed() {
    let app = reject_app().await;
    put(&app, "b", &state("2024-05-02", 10), None).await;
    let batch = json!([
        {"state_id": "a", "completed": state("2024-01-01", 1)["completed"]},
        {"state_id": "b", "completed": state("2024-05-01", 10)["completed"]}
    ])
    .to_string();
    let refused = app
        .request(Method::POST, "/v1/states", Some(&batch), &[])
        .await;
    refused.expect(StatusCode::CONFLICT);
    assert_eq!(refused.problem_type(), "bookmark-regression");
    assert!(
        refused.json()["detail"]
            .as_str()
            .unwrap()
            .contains("entry 1")
    );
    app.get_state("a")
        .await
        .expect_because(StatusCode::NOT_FOUND, "nothing written");
    let allowed = app
        .request(
            Method::POST,
            "/v1/states",
            Some(&batch),
            &[("statehouse-allow-regression", "orders")],
        )
        .await;
    allowed.expect(StatusCode::OK);
    assert_eq!(orders(&app, "b").await, "2024-05-01");
}

#[tokio::test]
async fn history_records_the_regressed_streams_of_each_version() {
    let app = spawn_app().await;
    put(&app, "job", &state("2024-05-02", 10), None).await;
    put(&app, "job", &state("2024-05-01", 11), None).await;
    let versions = app.get("/v1/states/job/history").await.json()["versions"].clone();
    assert_eq!(versions[0]["regressed_streams"], json!(["orders"]));
    assert_eq!(versions[1]["regressed_streams"], json!([]));
}

/// A history table made before versions recorded their regressed streams
/// gains the column at start; its old versions read as having none.
#[tokio::test]
async fn a_history_table_from_before_gains_the_regressed_streams() {
    let schema = unique_schema();
    raw_sql(&format!("CREATE DATABASE `{schema}`")).await;
    raw_sql(&format!(
        "CREATE TABLE `{schema}`.state_history (
            state_id String, version DateTime64(3), operation LowCardinality(String),
            deleted UInt8, completed_state Nullable(String), partial_state Nullable(String),
            changed_streams Array(String), actor String, lease_owner String,
            fencing_token UInt64, request_id String, user_agent String
        ) ENGINE = MergeTree ORDER BY (state_id, version)"
    ))
    .await;
    raw_sql(&format!(
        "INSERT INTO `{schema}`.state_history (state_id, version, operation, deleted,
            completed_state, partial_state, changed_streams, actor, lease_owner,
            fencing_token, request_id, user_agent)
         VALUES ('old', now64(3), 'put', 0, '{{}}', '{{}}', [], 'anonymous', '', 0, '', '')"
    ))
    .await;
    let app = spawn_configured(test_config(&schema)).await;
    let old = app.get("/v1/states/old/history").await.json();
    assert_eq!(old["versions"][0]["regressed_streams"], json!([]));
    assert_eq!(old["versions"][0]["lost_streams"], json!([]));
    put(&app, "job", &state("2024-05-02", 10), None).await;
    put(&app, "job", &state("2024-05-01", 10), None).await;
    let versions = app.get("/v1/states/job/history").await.json()["versions"].clone();
    assert_eq!(versions[0]["regressed_streams"], json!(["orders"]));
}
