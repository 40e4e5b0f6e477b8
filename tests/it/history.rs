//! History: every change through the gateway records a version, a version
//! can be read back and rolled back to, and a failed change never shows as
//! the current version.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::helpers::{Api, encode_id, raw_sql, spawn_app, spawn_app_with};
use crate::proxy::spawn_app_behind_proxy;

fn bookmarks(streams: Value) -> Value {
    json!({"completed": {"singer_state": {"bookmarks": streams}}})
}

async fn history(api: &Api, id: &str) -> Vec<Value> {
    let reply = api
        .get(&format!("/v1/states/{}/history", encode_id(id)))
        .await;
    reply.expect(StatusCode::OK);
    reply.json()["versions"].as_array().unwrap().clone()
}

async fn rollback(
    api: &Api,
    id: &str,
    version: &Value,
    headers: &[(&str, &str)],
) -> crate::helpers::Reply {
    api.request(
        Method::POST,
        &format!("/v1/states/{}/rollback", encode_id(id)),
        Some(&json!({"version": version}).to_string()),
        headers,
    )
    .await
}

#[tokio::test]
async fn every_change_records_a_version_newest_first_with_what_it_changed() {
    let app = spawn_app().await;
    let id = "dev:tap-a-to-target-b";
    let headers = [
        ("user-agent", "meltano/4.4.1"),
        ("x-request-id", "req-put-1"),
    ];
    let put = app
        .request(
            Method::PUT,
            &format!("/v1/states/{}", encode_id(id)),
            Some(
                &bookmarks(json!({"issues": {"since": "1"}, "pulls": {"since": "1"}})).to_string(),
            ),
            &headers,
        )
        .await;
    put.expect(StatusCode::CREATED);
    let patched = app
        .patch_state(
            id,
            &json!({"partial": {"singer_state": {"bookmarks": {"pulls": {"since": "2"}}}}}),
        )
        .await;
    patched.expect(StatusCode::OK);
    app.delete_state(id).await.expect(StatusCode::NO_CONTENT);
    // Deleting what is gone changes nothing and records nothing.
    app.delete_state(id).await.expect(StatusCode::NO_CONTENT);

    let versions = history(&app, id).await;
    let operations: Vec<&str> = versions
        .iter()
        .map(|v| v["operation"].as_str().unwrap())
        .collect();
    assert_eq!(operations, ["delete", "patch", "put"]);
    let (deleted, patch, first) = (&versions[0], &versions[1], &versions[2]);
    assert_eq!(first["changed_streams"], json!(["issues", "pulls"]));
    assert_eq!(
        first["version"],
        put.json()["updated_at"],
        "a version is its updated_at"
    );
    assert_eq!(first["actor"], "anonymous");
    assert_eq!(first["user_agent"], "meltano/4.4.1");
    assert_eq!(first["request_id"], "req-put-1");
    assert_eq!(first["lease_owner"], Value::Null);
    assert_eq!(
        patch["changed_streams"],
        json!(["pulls"]),
        "partial merged over completed"
    );
    assert_eq!(patch["version"], patched.json()["updated_at"]);
    assert_eq!(deleted["deleted"], true);
    assert_eq!(deleted["changed_streams"], json!(["issues", "pulls"]));
    let current: Vec<bool> = versions.iter().map(|v| v["current"] == true).collect();
    assert_eq!(current, [true, false, false], "the tombstone is current");
    assert!(
        versions
            .windows(2)
            .all(|w| w[0]["version"].as_str() > w[1]["version"].as_str()),
        "newest first"
    );

    // One version with its document; a tombstone has none.
    let one = app
        .get(&format!(
            "/v1/states/{}/history/{}",
            encode_id(id),
            first["version"].as_str().unwrap()
        ))
        .await;
    one.expect(StatusCode::OK);
    assert_eq!(
        one.json()["completed"]["singer_state"]["bookmarks"]["pulls"]["since"],
        "1"
    );
    let tombstone = app
        .get(&format!(
            "/v1/states/{}/history/{}",
            encode_id(id),
            deleted["version"].as_str().unwrap()
        ))
        .await;
    assert_eq!(tombstone.json()["completed"], Value::Null);
    assert_eq!(tombstone.json()["deleted"], true);
}

#[tokio::test]
async fn a_rollback_writes_an_old_document_anew_and_restores_a_deleted_state() {
    let app = spawn_app().await;
    let id = "job";
    let good = bookmarks(json!({"orders": {"id": 100}}));
    app.put_state(id, &good).await;
    app.put_state(id, &bookmarks(json!({"orders": {"id": 0}})))
        .await;
    let versions = history(&app, id).await;
    let good_version = versions[1]["version"].clone();

    let rolled = rollback(&app, id, &good_version, &[]).await;
    rolled.expect(StatusCode::OK);
    assert_eq!(
        app.get_state(id).await.json()["completed"],
        good["completed"]
    );
    let versions = history(&app, id).await;
    assert_eq!(versions.len(), 3);
    assert_eq!(versions[0]["operation"], "rollback");
    assert_eq!(versions[0]["changed_streams"], json!(["orders"]));
    assert_eq!(versions[0]["current"], true);

    // History survives a delete, and a rollback brings the state back.
    app.delete_state(id).await;
    app.get_state(id).await.expect(StatusCode::NOT_FOUND);
    let restored = rollback(&app, id, &good_version, &[]).await;
    restored.expect(StatusCode::CREATED);
    assert_eq!(
        app.get_state(id).await.json()["completed"],
        good["completed"]
    );

    // Rolling back to a tombstone deletes the state.
    let tombstone = history(&app, id).await[1].clone();
    assert_eq!(tombstone["deleted"], true);
    let deleted = rollback(&app, id, &tombstone["version"], &[]).await;
    deleted.expect(StatusCode::NO_CONTENT);
    app.get_state(id).await.expect(StatusCode::NOT_FOUND);
    let newest = &history(&app, id).await[0];
    assert_eq!(
        (newest["operation"].as_str(), newest["deleted"].as_bool()),
        (Some("rollback"), Some(true))
    );

    let missing = rollback(&app, id, &json!("2001-01-01T00:00:00.000Z"), &[]).await;
    missing.expect(StatusCode::NOT_FOUND);
    assert_eq!(missing.problem_type(), "version-not-found");
}

#[tokio::test]
async fn a_rollback_obeys_the_lock_and_if_match_and_records_the_lease() {
    let app = spawn_app().await;
    let id = "locked-job";
    app.put_state(id, &bookmarks(json!({"s": {"v": 1}}))).await;
    let first = history(&app, id).await[0]["version"].clone();
    app.put_state(id, &bookmarks(json!({"s": {"v": 2}}))).await;

    let (lease, token) = app.lease(id, "operator", 30, 0.0).await;
    let refused = rollback(&app, id, &first, &[]).await;
    refused.expect(StatusCode::CONFLICT);
    assert_eq!(refused.problem_type(), "state-locked");
    let stale = rollback(
        &app,
        id,
        &first,
        &[("lease-id", &lease), ("if-match", "\"0000000000000000\"")],
    )
    .await;
    stale.expect(StatusCode::PRECONDITION_FAILED);
    assert_eq!(
        history(&app, id).await.len(),
        2,
        "refused rollbacks record nothing"
    );

    let done = rollback(&app, id, &first, &[("lease-id", &lease)]).await;
    done.expect(StatusCode::OK);
    let newest = &history(&app, id).await[0];
    assert_eq!(newest["lease_owner"], "operator");
    assert_eq!(newest["fencing_token"], token);
    app.release(id, &lease).await.expect(StatusCode::NO_CONTENT);
}

#[tokio::test]
async fn history_pages_resume_through_their_cursor_and_only_for_their_state() {
    let app = spawn_app().await;
    for n in 0..5 {
        app.put_state("paged", &json!({"completed": {"n": n}}))
            .await;
    }
    app.put_state("other", &json!({})).await;
    let mut seen = Vec::new();
    let mut path = "/v1/states/paged/history?limit=2".to_owned();
    loop {
        let page = app.get(&path).await.json();
        for v in page["versions"].as_array().unwrap() {
            seen.push(v["version"].as_str().unwrap().to_owned());
        }
        let Some(cursor) = page["next_cursor"].as_str() else {
            break;
        };
        let foreign = app
            .get(&format!("/v1/states/other/history?cursor={cursor}"))
            .await;
        foreign.expect(StatusCode::BAD_REQUEST);
        path = format!("/v1/states/paged/history?limit=2&cursor={cursor}");
    }
    assert_eq!(seen.len(), 5);
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.reverse();
    assert_eq!(seen, sorted, "newest first, none twice");
}

#[tokio::test]
async fn a_failed_change_may_leave_a_version_that_is_never_current() {
    let (app, proxy) = spawn_app_behind_proxy(|_| {}).await;
    let id = "faulty";
    let kept = app.put_state(id, &json!({"completed": {"v": 1}})).await;
    kept.expect(StatusCode::CREATED);

    // The write runs in ClickHouse but its answer is lost: the client is told
    // it failed. Whether or not it landed, history marks only the version the
    // state is at as current.
    let history_insert = format!("INSERT INTO `{}`.`state_history`", app.schema);
    proxy.lose_answers_to(Some(&history_insert));
    let failed = app.put_state(id, &json!({"completed": {"v": 2}})).await;
    failed.expect(StatusCode::SERVICE_UNAVAILABLE);
    proxy.lose_answers_to(None);
    let landed = app.get_state(id).await.json();

    let after = app.put_state(id, &json!({"completed": {"v": 3}})).await;
    after.expect(StatusCode::OK);
    let versions = history(&app, id).await;
    assert_eq!(
        versions.len(),
        3,
        "the failed change left its version: {versions:?}"
    );
    let current: Vec<&Value> = versions.iter().filter(|v| v["current"] == true).collect();
    assert_eq!(current.len(), 1);
    assert_eq!(current[0]["version"], after.json()["updated_at"]);
    let lost = &versions[1];
    assert_eq!(lost["current"], false);
    assert_eq!(
        lost["version"], landed["updated_at"],
        "it had landed, as the state showed"
    );
    assert_ne!(
        lost["version"],
        after.json()["updated_at"],
        "no two changes share a version"
    );
    // Every acknowledged change has its version.
    for written in [&kept, &after] {
        assert!(
            versions
                .iter()
                .any(|v| v["version"] == written.json()["updated_at"])
        );
    }
    assert_eq!(app.get_state(id).await.json()["completed"]["v"], 3);

    // A change whose version cannot be recorded is not made at all.
    let history_insert = format!("INSERT INTO `{}`.`state_history`", app.schema);
    proxy.refuse_requests_containing(Some(&history_insert));
    let unrecorded = app.put_state(id, &json!({"completed": {"v": 4}})).await;
    unrecorded.expect(StatusCode::SERVICE_UNAVAILABLE);
    let undeleted = app.delete_state(id).await;
    undeleted.expect(StatusCode::SERVICE_UNAVAILABLE);
    proxy.refuse_requests_containing(None);
    assert_eq!(app.get_state(id).await.json()["completed"]["v"], 3);
    assert_eq!(history(&app, id).await.len(), 3);
}

#[tokio::test]
async fn delete_by_pattern_leaves_a_tombstone_per_state() {
    let app = spawn_app().await;
    for id in ["batch:a", "batch:b", "keep"] {
        app.put_state(id, &bookmarks(json!({id: {"v": 1}}))).await;
    }
    let deleted = app
        .request(Method::DELETE, "/v1/states?pattern=batch:*", None, &[])
        .await;
    assert_eq!(deleted.json()["deleted"], 2);
    for id in ["batch:a", "batch:b"] {
        let versions = history(&app, id).await;
        assert_eq!(versions[0]["operation"], "delete-by-pattern");
        assert_eq!(versions[0]["deleted"], true);
        assert_eq!(versions[0]["current"], true);
        assert_eq!(versions[0]["changed_streams"], json!([id]));
    }
    assert_eq!(history(&app, "keep").await.len(), 1);
}

#[tokio::test]
async fn with_history_off_no_versions_are_kept_and_the_endpoints_say_why() {
    let app = spawn_app_with(|config| config.history = statehouse::config::History::Off).await;
    app.put_state("quiet", &json!({})).await;
    let listing = app.get("/v1/states/quiet/history").await;
    listing.expect(StatusCode::NOT_FOUND);
    assert_eq!(listing.problem_type(), "history-off");
    assert!(
        listing.json()["detail"]
            .as_str()
            .unwrap()
            .contains("--history")
    );
    let reply = rollback(&app, "quiet", &json!("2001-01-01T00:00:00.000Z"), &[]).await;
    assert_eq!(reply.problem_type(), "history-off");
    let tables = raw_sql(&format!(
        "SELECT name FROM system.tables WHERE database = '{}' ORDER BY name",
        app.schema
    ))
    .await;
    assert_eq!(
        tables.trim(),
        "state\nstate_changes\nstate_changes_writes\nstate_gateways\nstate_lease\nstate_members\nstate_pool_lease",
        "no history table (the feed's changes table has no tombstone view)"
    );
}

#[tokio::test]
async fn the_retention_is_the_history_tables_ttl_and_zero_keeps_forever() {
    let engine = |schema: String| async move {
        raw_sql(&format!(
            "SELECT engine_full FROM system.tables WHERE database = '{schema}' AND name = 'state_history'"
        ))
        .await
    };
    let app = spawn_app().await;
    assert!(
        engine(app.schema.clone())
            .await
            .contains("TTL toDateTime(version) + toIntervalSecond(7776000)"),
        "90 days by default"
    );
    let schema = app.schema.clone();
    app.shut_down().await;
    // A restart with another retention changes the table's TTL; 0 removes it.
    for (retention, expected) in [("12h", Some("toIntervalSecond(43200)")), ("0", None)] {
        let mut config = crate::helpers::test_config(&schema);
        let args = statehouse::config::Config::from_serve_args(&[
            "--clickhouse-url",
            &crate::helpers::clickhouse_url(),
            "--history-retention",
            retention,
        ])
        .unwrap();
        config.history = args.history;
        let app = crate::helpers::spawn_configured(config).await;
        let full = engine(schema.clone()).await;
        match expected {
            Some(ttl) => assert!(full.contains(ttl), "{full}"),
            None => assert!(!full.contains(" TTL "), "{full}"),
        }
        app.shut_down().await;
    }
}

#[tokio::test]
async fn bad_history_requests_get_a_clear_400() {
    let app = spawn_app().await;
    app.put_state("h", &json!({})).await;
    for (path, kind) in [
        ("/v1/states/h/history/yesterday", "invalid-version"),
        (
            "/v1/states/h/history/2026-12-01T10:00:00Z",
            "invalid-version",
        ),
        ("/v1/states/h/history?limit=0", "invalid-query"),
        ("/v1/states/h/history?cursor=00", "invalid-query"),
        ("/v1/states/h/history?colour=red", "invalid-query"),
    ] {
        let reply = app.get(path).await;
        reply.expect_because(StatusCode::BAD_REQUEST, path);
        assert_eq!(reply.problem_type(), kind, "{path}");
    }
    for body in [
        r#"{}"#,
        r#"{"version": "soon"}"#,
        r#"{"version": "2026-12-01T10:00:00.000Z", "x": 1}"#,
        "[",
    ] {
        let reply = app
            .request(Method::POST, "/v1/states/h/rollback", Some(body), &[])
            .await;
        reply.expect_because(StatusCode::BAD_REQUEST, body);
    }
    assert_eq!(history(&app, "h").await.len(), 1, "nothing was written");
    let missing = app
        .get("/v1/states/h/history/2001-01-01T00:00:00.000Z")
        .await;
    assert_eq!(missing.problem_type(), "version-not-found");
}
