//! A database the seed plugin (meltano-state-backend-clickhouse) wrote is served as it is.

use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::{raw_sql, spawn_configured, test_config, unique_schema};

#[tokio::test]
async fn rows_written_by_another_writer_are_served() {
    let schema = unique_schema();
    raw_sql(&format!("CREATE DATABASE `{schema}`")).await;
    // The seed's own DDL, and its lock table, which must stay untouched.
    raw_sql(&format!(
        "CREATE TABLE `{schema}`.state (state_id String, partial_state Nullable(String), completed_state Nullable(String), updated_at DateTime64(3) DEFAULT now64(3)) ENGINE = ReplacingMergeTree(updated_at) ORDER BY state_id"
    ))
    .await;
    raw_sql(&format!(
        "CREATE TABLE `{schema}`.state_lock (state_id String, lock_id String, locked_at DateTime DEFAULT now()) ENGINE = MergeTree ORDER BY state_id"
    ))
    .await;
    raw_sql(&format!(
        "INSERT INTO `{schema}`.state (state_id, partial_state, completed_state, updated_at) SETTINGS async_insert=0 VALUES
         ('dev:tap-a-to-b', NULL, '{{\"singer_state\": {{\"bookmarks\": {{\"users\": {{\"since\": \"2024-01-01\"}}}}}}}}', '2024-05-01 10:00:00.000'),
         ('dev:tap-a-to-b', NULL, '{{\"singer_state\": {{\"bookmarks\": {{\"users\": {{\"since\": \"2024-02-01\"}}}}}}}}', '2024-05-01 10:00:00.123'),
         ('only-partial', '{{\"singer_state\": {{\"p\": 1}}}}', NULL, '2024-05-02 00:00:00.000')"
    ))
    .await;
    raw_sql(&format!("INSERT INTO `{schema}`.state_lock (state_id, lock_id) SETTINGS async_insert=0 VALUES ('x', 'y')")).await;

    let app = spawn_configured(test_config(&schema)).await;
    let got = app.get_state("dev:tap-a-to-b").await;
    got.expect(StatusCode::OK);
    let body = got.json();
    assert_eq!(
        body["completed"],
        json!({"singer_state": {"bookmarks": {"users": {"since": "2024-02-01"}}}}),
        "latest version wins"
    );
    assert_eq!(body["partial"], json!({}), "NULL reads as {{}}");
    assert_eq!(body["updated_at"], "2024-05-01T10:00:00.123Z");

    let partial = app.get_state("only-partial").await.json();
    assert_eq!(partial["completed"], json!({}));
    assert_eq!(partial["partial"], json!({"singer_state": {"p": 1}}));

    let listing = app.get("/v1/states").await.json();
    assert_eq!(listing["states"].as_array().unwrap().len(), 2);

    let merged = app
        .patch_state(
            "only-partial",
            &json!({"partial": {"singer_state": {"q": 2}}}),
        )
        .await;
    merged.expect(StatusCode::OK);
    assert_eq!(
        merged.json()["partial"],
        json!({"singer_state": {"p": 1, "q": 2}})
    );

    assert_eq!(
        raw_sql(&format!("SELECT count() FROM `{schema}`.state_lock"))
            .await
            .trim(),
        "1"
    );
}

#[tokio::test]
async fn unreadable_stored_state_is_reported_not_served() {
    let schema = unique_schema();
    let app = spawn_configured(test_config(&schema)).await;
    raw_sql(&format!(
        "INSERT INTO `{schema}`.state (state_id, completed_state) SETTINGS async_insert=0 VALUES ('broken', 'not json')"
    ))
    .await;
    let reply = app.get_state("broken").await;
    reply.expect(StatusCode::BAD_GATEWAY);
    assert_eq!(reply.problem_type(), "corrupt-state");
    // A merge needs the stored content and refuses; a replacement repairs it.
    let merge = app
        .patch_state("broken", &json!({"partial": {"p": 1}}))
        .await;
    merge.expect(StatusCode::BAD_GATEWAY);
    let repaired = app
        .put_state("broken", &json!({"completed": {"ok": true}}))
        .await;
    repaired.expect(StatusCode::OK);
    assert_eq!(
        app.get_state("broken").await.json()["completed"],
        json!({"ok": true})
    );
}
