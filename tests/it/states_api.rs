//! The state endpoints against the local ClickHouse.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::helpers::{encode_id, raw_sql, spawn_app, spawn_configured, test_config, unique_schema};

#[tokio::test]
async fn put_creates_then_replaces_and_get_returns_it_with_its_etag() {
    let app = spawn_app().await;
    let first = app
        .put_state("dev:tap-a-to-b", &json!({"completed": {"v": 1}}))
        .await;
    first.expect(StatusCode::CREATED);
    let second = app
        .put_state(
            "dev:tap-a-to-b",
            &json!({"completed": {"v": 2}, "partial": {"p": true}}),
        )
        .await;
    second.expect(StatusCode::OK);
    assert_ne!(first.header("etag"), second.header("etag"));

    let got = app.get_state("dev:tap-a-to-b").await;
    got.expect(StatusCode::OK);
    assert_eq!(got.header("etag"), second.header("etag"));
    let body = got.json();
    assert_eq!(body["state_id"], "dev:tap-a-to-b");
    assert_eq!(body["completed"], json!({"v": 2}));
    assert_eq!(body["partial"], json!({"p": true}));
    assert_eq!(body["updated_at"], second.json()["updated_at"]);
}

#[tokio::test]
async fn get_of_a_missing_state_is_404() {
    let app = spawn_app().await;
    let reply = app.get_state("nope").await;
    reply.expect(StatusCode::NOT_FOUND);
    assert_eq!(reply.problem_type(), "state-not-found");
}

#[tokio::test]
async fn numbers_and_strings_come_back_exactly() {
    let app = spawn_app().await;
    let body = r#"{"completed":{"singer_state":{"bookmarks":{"big":123456789012345678901234567890,"precise":0.1000000000000000055511151231257827,"neg":-0.0,"text":"ünï 🚀 \"q\" \\ back \u0000 nul \n line"}}}}"#;
    let put = app
        .request(Method::PUT, "/v1/states/exact", Some(body), &[])
        .await;
    put.expect(StatusCode::CREATED);
    let got = app.get_state("exact").await;
    for needle in [
        "123456789012345678901234567890",
        "0.1000000000000000055511151231257827",
        "-0.0",
        r#""ünï 🚀 \"q\" \\ back \u0000 nul \n line""#,
    ] {
        assert!(
            got.text.contains(needle),
            "{needle} missing from {}",
            got.text
        );
    }
    let sent: Value = serde_json::from_str(body).unwrap();
    assert_eq!(got.json()["completed"], sent["completed"]);
    // What ClickHouse holds is the same JSON, not a lossy re-encoding.
    let stored = raw_sql(&format!(
        "SELECT completed_state FROM `{}`.state FINAL WHERE state_id = 'exact' FORMAT RawBLOB",
        app.schema
    ))
    .await;
    assert_eq!(
        serde_json::from_str::<Value>(&stored).unwrap(),
        sent["completed"]
    );
}

#[tokio::test]
async fn numbers_and_strings_keep_their_text_through_put_patch_and_get() {
    let app = spawn_app().await;
    let sent = r#"{"completed":{"n":1E5,"m":2.5E-3,"k":1e5,"p":1e+5,"big":12345678901234567890123456789E-40,"s":"caf\u00e9 \/ \ud83d\ude80"},"partial":{"a":{"x":-0.0E0}}}"#;
    let put = app
        .request(Method::PUT, "/v1/states/exact-text", Some(sent), &[])
        .await;
    put.expect(StatusCode::CREATED);
    let completed = r#""completed":{"n":1E5,"m":2.5E-3,"k":1e5,"p":1e+5,"big":12345678901234567890123456789E-40,"s":"caf\u00e9 \/ \ud83d\ude80"}"#;
    for reply in [&put, &app.get_state("exact-text").await] {
        assert!(reply.text.contains(completed), "{}", reply.text);
        assert!(
            reply.text.contains(r#""partial":{"a":{"x":-0.0E0}}"#),
            "{}",
            reply.text
        );
    }
    // A merge keeps the text of what it keeps and of what it brings.
    let patch = app
        .request(
            Method::PATCH,
            "/v1/states/exact-text",
            Some(r#"{"partial": {"a": {"y": 7E-1}, "b": [1E0, {"c": 3.0E+2}]}}"#),
            &[],
        )
        .await;
    patch.expect(StatusCode::OK);
    let merged = r#""partial":{"a":{"x":-0.0E0,"y":7E-1},"b":[1E0,{"c":3.0E+2}]}"#;
    assert!(patch.text.contains(completed), "{}", patch.text);
    assert!(patch.text.contains(merged), "{}", patch.text);
    // ClickHouse holds the same text (compact), which the seed plugin reads as JSON.
    let stored = raw_sql(&format!(
        "SELECT completed_state, partial_state FROM `{}`.state FINAL WHERE state_id = 'exact-text' FORMAT JSONEachRow",
        app.schema
    ))
    .await;
    let row: Value = serde_json::from_str(&stored).unwrap();
    assert_eq!(
        format!("{{{completed}}}"),
        format!(
            "{{\"completed\":{}}}",
            row["completed_state"].as_str().unwrap()
        )
    );
    assert_eq!(
        format!("{{{merged}}}"),
        format!("{{\"partial\":{}}}", row["partial_state"].as_str().unwrap())
    );
}

#[tokio::test]
async fn any_utf8_id_up_to_900_bytes_is_stored_safely() {
    let app = spawn_app().await;
    let long = "é".repeat(450);
    let ids = [
        "dev:tap-github-to-target-jsonl",
        "with/slash and space.dot",
        "quote ' double \" back \\",
        "'; DROP TABLE state; --",
        "{x:String}",
        "ünïcødé 🚀",
        long.as_str(),
    ];
    for (n, id) in ids.iter().enumerate() {
        let put = app.put_state(id, &json!({"completed": {"n": n}})).await;
        put.expect_because(StatusCode::CREATED, id);
        assert_eq!(put.json()["state_id"], *id);
    }
    for (n, id) in ids.iter().enumerate() {
        let got = app.get_state(id).await;
        got.expect_because(StatusCode::OK, id);
        assert_eq!(got.json()["completed"]["n"], n);
    }
    let listing = app.get("/v1/states?limit=1000").await.json();
    let listed: Vec<&str> = listing["states"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["state_id"].as_str().unwrap())
        .collect();
    let mut expected = ids.to_vec();
    expected.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    assert_eq!(listed, expected, "listing is in byte order");
    assert_eq!(
        app.table_snapshot().await.len(),
        ids.len(),
        "the injection attempt dropped nothing"
    );
}

#[tokio::test]
async fn if_match_guards_writes() {
    let app = spawn_app().await;
    let path = "/v1/states/guarded";
    let created = app
        .put_state("guarded", &json!({"completed": {"v": 1}}))
        .await;
    let etag = created.header("etag").unwrap().to_owned();

    let stale = app
        .request(
            Method::PUT,
            path,
            Some(r#"{"completed":{"v":2}}"#),
            &[("if-match", "\"0000000000000000\"")],
        )
        .await;
    stale.expect(StatusCode::PRECONDITION_FAILED);
    assert_eq!(stale.problem_type(), "precondition-failed");
    assert_eq!(
        app.get_state("guarded").await.json()["completed"],
        json!({"v": 1})
    );

    let fresh = app
        .request(
            Method::PUT,
            path,
            Some(r#"{"completed":{"v":3}}"#),
            &[("if-match", &etag)],
        )
        .await;
    fresh.expect(StatusCode::OK);
    // The old tag is now stale.
    let again = app
        .request(
            Method::PATCH,
            path,
            Some(r#"{"partial":{"x":1}}"#),
            &[("if-match", &etag)],
        )
        .await;
    again.expect(StatusCode::PRECONDITION_FAILED);
    let any = app
        .request(
            Method::PATCH,
            path,
            Some(r#"{"partial":{"x":1}}"#),
            &[("if-match", "*")],
        )
        .await;
    any.expect(StatusCode::OK);
    let delete_stale = app
        .request(Method::DELETE, path, None, &[("if-match", &etag)])
        .await;
    delete_stale.expect(StatusCode::PRECONDITION_FAILED);
    app.get_state("guarded").await.expect(StatusCode::OK);

    let missing = app
        .request(
            Method::PUT,
            "/v1/states/absent",
            Some("{}"),
            &[("if-match", "*")],
        )
        .await;
    missing.expect(StatusCode::PRECONDITION_FAILED);
    app.get_state("absent").await.expect(StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn if_none_match_answers_304_while_unchanged() {
    let app = spawn_app().await;
    let etag = app
        .put_state("cached", &json!({}))
        .await
        .header("etag")
        .unwrap()
        .to_owned();
    let unchanged = app
        .request(
            Method::GET,
            "/v1/states/cached",
            None,
            &[("if-none-match", &etag)],
        )
        .await;
    unchanged.expect(StatusCode::NOT_MODIFIED);
    app.put_state("cached", &json!({"completed": {"v": 1}}))
        .await;
    let changed = app
        .request(
            Method::GET,
            "/v1/states/cached",
            None,
            &[("if-none-match", &etag)],
        )
        .await;
    changed.expect(StatusCode::OK);
}

#[tokio::test]
async fn patch_follows_meltano_update_semantics() {
    let app = spawn_app().await;
    let created = app
        .patch_state(
            "job",
            &json!({"partial": {"singer_state": {"bookmarks": {"s1": {"ts": 1}}}}}),
        )
        .await;
    created.expect_because(StatusCode::CREATED, "PATCH of a missing id creates it");

    app.put_state(
        "job",
        &json!({
            "completed": {"singer_state": {"bookmarks": {"done": 1}}},
            "partial": {"singer_state": {"bookmarks": {"s1": {"ts": 1, "keep": "yes"}, "s2": [1, 2, 3]}}}
        }),
    )
    .await;
    let merged = app
        .patch_state("job", &json!({"partial": {"singer_state": {"bookmarks": {"s1": {"ts": 2}, "s2": [9], "s3": {"new": true}}}}}))
        .await;
    merged.expect(StatusCode::OK);
    let body = app.get_state("job").await.json();
    assert_eq!(
        body["completed"],
        json!({"singer_state": {"bookmarks": {"done": 1}}}),
        "completed kept"
    );
    assert_eq!(
        body["partial"],
        json!({"singer_state": {"bookmarks": {"s1": {"ts": 2, "keep": "yes"}, "s2": [9], "s3": {"new": true}}}}),
        "nested objects merge, incoming wins, lists are replaced"
    );

    app.patch_state("job", &json!({"completed": {"singer_state": {"final": 1}}}))
        .await;
    let body = app.get_state("job").await.json();
    assert_eq!(body["completed"], json!({"singer_state": {"final": 1}}));
    assert_eq!(
        body["partial"],
        json!({}),
        "a complete state replaces everything"
    );
}

#[tokio::test]
async fn delete_is_idempotent() {
    let app = spawn_app().await;
    app.put_state("gone", &json!({"completed": {"a": 1}})).await;
    app.delete_state("gone")
        .await
        .expect(StatusCode::NO_CONTENT);
    app.get_state("gone").await.expect(StatusCode::NOT_FOUND);
    app.delete_state("gone")
        .await
        .expect(StatusCode::NO_CONTENT);
    app.delete_state("never-was")
        .await
        .expect(StatusCode::NO_CONTENT);
    // A state written again after its deletion is visible again.
    app.put_state("gone", &json!({"completed": {"a": 2}})).await;
    assert_eq!(app.get_state("gone").await.json()["completed"]["a"], 2);
}

async fn listed(app: &crate::helpers::TestApp, pattern: &str) -> Vec<String> {
    let reply = app
        .get(&format!(
            "/v1/states?limit=1000&pattern={}",
            encode_id(pattern)
        ))
        .await;
    reply.expect(StatusCode::OK);
    reply.json()["states"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["state_id"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn glob_has_fnmatch_meaning_with_percent_and_underscore_literal() {
    let app = spawn_app().await;
    for id in [
        "a%b", "a_b", "axb", "aéb", "a/b/c", "A_b", "ab", "dev:x", "a.b", "a*b",
    ] {
        app.put_state(id, &json!({})).await;
    }
    assert_eq!(listed(&app, "a%b").await, ["a%b"]);
    assert_eq!(listed(&app, "a_b").await, ["a_b"]);
    assert_eq!(
        listed(&app, "a?b").await,
        ["a%b", "a*b", "a.b", "a_b", "axb", "aéb"]
    );
    assert_eq!(
        listed(&app, "a*").await,
        ["a%b", "a*b", "a.b", "a/b/c", "a_b", "ab", "axb", "aéb"]
    );
    assert_eq!(listed(&app, "a*c").await, ["a/b/c"], "* crosses /");
    assert_eq!(listed(&app, "A*").await, ["A_b"], "case-sensitive");
    assert_eq!(listed(&app, "a.b").await, ["a.b"], ". is literal");
    assert_eq!(listed(&app, "*:*").await, ["dev:x"]);
    assert_eq!(listed(&app, "*").await.len(), 10);
    assert!(listed(&app, "zzz*").await.is_empty());
}

#[tokio::test]
async fn delete_many_deletes_matches_and_counts_them() {
    let app = spawn_app().await;
    for id in ["dev:a", "dev:b", "prod:a"] {
        app.put_state(id, &json!({})).await;
    }
    let reply = app
        .request(Method::DELETE, "/v1/states?pattern=dev:*", None, &[])
        .await;
    reply.expect(StatusCode::OK);
    assert_eq!(
        reply.json(),
        json!({"deleted": 2, "skipped_locked": 0, "locked": []})
    );
    assert_eq!(listed(&app, "*").await, ["prod:a"]);
    let none = app
        .request(Method::DELETE, "/v1/states?pattern=dev:*", None, &[])
        .await;
    assert_eq!(
        none.json(),
        json!({"deleted": 0, "skipped_locked": 0, "locked": []})
    );
    let all = app
        .request(Method::DELETE, "/v1/states?pattern=*", None, &[])
        .await;
    assert_eq!(
        all.json(),
        json!({"deleted": 1, "skipped_locked": 0, "locked": []})
    );
    assert!(listed(&app, "*").await.is_empty());
}

#[tokio::test]
async fn pagination_neither_skips_nor_repeats() {
    let app = spawn_app().await;
    let mut ids: Vec<String> = (0..137)
        .map(|n| format!("job-{:x}-{}", n * 7919 % 1000, "é".repeat(n % 3)))
        .collect();
    // Bulk-load through ClickHouse directly: the listing must serve any writer's rows.
    let values: Vec<String> = ids
        .iter()
        .map(|id| format!("('{id}', '{{}}', '{{}}')"))
        .collect();
    raw_sql(&format!(
        "INSERT INTO `{}`.state (state_id, partial_state, completed_state) SETTINGS async_insert=0 VALUES {}",
        app.schema,
        values.join(",")
    ))
    .await;
    ids.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    ids.dedup();

    for limit in [1, 7, 100, 1000] {
        let mut seen = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let path = match &cursor {
                Some(c) => format!("/v1/states?limit={limit}&cursor={c}"),
                None => format!("/v1/states?limit={limit}"),
            };
            let page = app.get(&path).await.json();
            let states = page["states"].as_array().unwrap();
            assert!(states.len() <= limit);
            seen.extend(
                states
                    .iter()
                    .map(|s| s["state_id"].as_str().unwrap().to_owned()),
            );
            match page["next_cursor"].as_str() {
                Some(next) => {
                    assert_eq!(states.len(), limit, "only the last page is short");
                    cursor = Some(next.to_owned());
                }
                None => break,
            }
        }
        assert_eq!(seen, ids, "limit {limit}");
    }
    let default_page = app.get("/v1/states").await.json();
    assert_eq!(
        default_page["states"].as_array().unwrap().len(),
        100,
        "default limit is 100"
    );
}

#[tokio::test]
async fn a_cursor_resumes_its_own_pattern_through_any_gateway_and_no_other() {
    let schema = unique_schema();
    let a = spawn_configured(test_config(&schema)).await;
    let b = spawn_configured(test_config(&schema)).await;
    let mut ids: Vec<String> = (0..25).map(|n| format!("dev:{n:02}")).collect();
    ids.extend((0..5).map(|n| format!("prod:{n}")));
    for id in &ids {
        a.put_state(id, &json!({})).await;
    }
    // Pages alternate between the gateways: a cursor holds no per-process secret.
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    for turn in 0.. {
        let gateway = if turn % 2 == 0 { &a } else { &b };
        let path = match &cursor {
            Some(c) => format!("/v1/states?pattern=dev:*&limit=4&cursor={c}"),
            None => "/v1/states?pattern=dev:*&limit=4".to_owned(),
        };
        let page = gateway.get(&path).await;
        page.expect(StatusCode::OK);
        let page = page.json();
        seen.extend(
            page["states"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["state_id"].as_str().unwrap().to_owned()),
        );
        match page["next_cursor"].as_str() {
            Some(next) => {
                // Used with another pattern, or none (`*`), it is refused.
                for other in ["&pattern=*", "", "&pattern=dev:", "&pattern=prod:*"] {
                    let misused = gateway
                        .get(&format!("/v1/states?limit=4&cursor={next}{other}"))
                        .await;
                    misused.expect_because(StatusCode::BAD_REQUEST, other);
                    assert_eq!(misused.problem_type(), "invalid-query");
                }
                cursor = Some(next.to_owned());
            }
            None => break,
        }
    }
    assert_eq!(seen, ids[..25], "every dev: id once, in byte order");
}

#[tokio::test]
async fn the_later_of_two_acknowledged_writes_wins_even_within_a_millisecond() {
    let app = spawn_app().await;
    let mut last_updated_at = String::new();
    for n in 0..300 {
        let reply = app.put_state("racy", &json!({"completed": {"n": n}})).await;
        assert!(reply.status.is_success(), "{}", reply.text);
        let updated_at = reply.json()["updated_at"].as_str().unwrap().to_owned();
        assert!(
            updated_at > last_updated_at,
            "versions strictly increase: {updated_at} after {last_updated_at}"
        );
        last_updated_at = updated_at;
    }
    assert_eq!(app.get_state("racy").await.json()["completed"]["n"], 299);
    let stored = raw_sql(&format!(
        "SELECT completed_state FROM `{}`.state FINAL WHERE state_id = 'racy' FORMAT RawBLOB",
        app.schema
    ))
    .await;
    assert_eq!(stored, r#"{"n":299}"#);
}

#[tokio::test]
async fn a_write_wins_over_a_row_stamped_by_a_clock_ahead_of_ours() {
    let app = spawn_app().await;
    raw_sql(&format!(
        "INSERT INTO `{}`.state (state_id, completed_state, updated_at) SETTINGS async_insert=0 VALUES ('skewed', '{{\"from\":\"future\"}}', now64(3) + INTERVAL 1 HOUR)",
        app.schema
    ))
    .await;
    let reply = app
        .put_state("skewed", &json!({"completed": {"from": "us"}}))
        .await;
    reply.expect(StatusCode::OK);
    assert_eq!(
        app.get_state("skewed").await.json()["completed"],
        json!({"from": "us"})
    );
}

#[tokio::test]
async fn responses_carry_a_request_id_and_metrics_count_them() {
    let app = spawn_app().await;
    let reply = app.get_state("nothing").await;
    let generated = reply
        .header("x-request-id")
        .expect("a request id is generated");
    assert_eq!(uuid::Uuid::parse_str(generated).map(|_| ()), Ok(()));
    let echoed = app
        .request(
            Method::GET,
            "/healthz",
            None,
            &[("x-request-id", "abc-123")],
        )
        .await;
    assert_eq!(echoed.header("x-request-id"), Some("abc-123"));

    let metrics = app.get("/metrics").await;
    metrics.expect(StatusCode::OK);
    for needle in [
        r#"statehouse_http_requests_total{method="GET",route="/v1/states/{state_id}",status="404"} 1"#,
        r#"statehouse_http_request_duration_seconds_bucket{le="#,
        r#"statehouse_clickhouse_query_duration_seconds_count{operation="get"} 1"#,
    ] {
        assert!(
            metrics.text.contains(needle),
            "{needle} not in\n{}",
            metrics.text
        );
    }
}

#[tokio::test]
async fn health_and_readiness_answer() {
    let app = spawn_app().await;
    assert_eq!(app.get("/healthz").await.json(), json!({"status": "ok"}));
    let ready = app.get("/readyz").await;
    ready.expect(StatusCode::OK);
    assert_eq!(ready.json()["components"]["clickhouse"]["status"], "ok");
}
