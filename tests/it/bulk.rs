//! Bulk state: export with `include=documents`, import with `POST /v1/states`
//! (all or nothing), and stream surgery with `DELETE .../bookmarks/{stream}`.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::helpers::{Api, Reply, spawn_app};

async fn import(api: &Api, batch: &Value, headers: &[(&str, &str)]) -> Reply {
    api.request(
        Method::POST,
        "/v1/states",
        Some(&batch.to_string()),
        headers,
    )
    .await
}

async fn export(api: &Api, pattern: &str, limit: usize) -> Vec<Value> {
    let mut states = Vec::new();
    let mut path = format!("/v1/states?pattern={pattern}&include=documents&limit={limit}");
    loop {
        let page = api.get(&path).await.json();
        states.extend(page["states"].as_array().unwrap().iter().cloned());
        let Some(cursor) = page["next_cursor"].as_str() else {
            return states;
        };
        path =
            format!("/v1/states?pattern={pattern}&include=documents&limit={limit}&cursor={cursor}");
    }
}

#[tokio::test]
async fn a_batch_is_written_whole_with_a_version_each_and_exports_back_exactly() {
    let app = spawn_app().await;
    app.put_state("bulk:0", &json!({"completed": {"old": true}}))
        .await;
    let batch: Value = (0..250)
        .map(|n| {
            json!({
                "state_id": format!("bulk:{n}"),
                "completed": {"singer_state": {"bookmarks": {"s": {"n": n}}}},
                "partial": if n % 2 == 0 { json!({"p": n}) } else { Value::Null },
            })
        })
        .collect();
    let reply = import(&app, &batch, &[]).await;
    reply.expect(StatusCode::OK);
    assert_eq!(reply.json(), json!({"written": 250, "created": 249}));

    let exported = export(&app, "bulk:*", 100).await;
    assert_eq!(exported.len(), 250, "three pages, none skipped or repeated");
    let zero = exported.iter().find(|s| s["state_id"] == "bulk:0").unwrap();
    assert_eq!(
        zero["completed"],
        json!({"singer_state": {"bookmarks": {"s": {"n": 0}}}})
    );
    assert_eq!(
        zero["partial"],
        json!({"p": 0}),
        "the completed/partial split is kept"
    );
    let one = exported.iter().find(|s| s["state_id"] == "bulk:1").unwrap();
    assert_eq!(one["partial"], json!({}));

    let history = app.get("/v1/states/bulk:0/history").await.json();
    let versions = history["versions"].as_array().unwrap();
    assert_eq!(versions.len(), 2);
    assert_eq!(versions[0]["operation"], "import");
    assert_eq!(versions[0]["current"], true);
    assert_eq!(versions[0]["changed_streams"], json!(["s"]));
    // Numbers keep their text through import and export.
    let exact =
        r#"[{"state_id":"exact","completed":{"n":1E5,"big":12345678901234567890123456789}}]"#;
    let reply = app
        .request(Method::POST, "/v1/states", Some(exact), &[])
        .await;
    reply.expect(StatusCode::OK);
    let raw = app
        .client
        .get(format!(
            "{}/v1/states?pattern=exact&include=documents",
            app.base
        ))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        raw.contains(r#""n":1E5"#) && raw.contains("12345678901234567890123456789"),
        "{raw}"
    );
}

#[tokio::test]
async fn one_bad_entry_refuses_the_batch_naming_it_and_nothing_is_written() {
    let app = spawn_app().await;
    let (lease, _) = app.lease("locked", "worker", 30, 0.0).await;
    let good = json!({"state_id": "fine", "completed": {}});
    for (bad, kind, named) in [
        (
            json!({"state_id": "", "completed": {}}),
            "invalid-state-id",
            "entry 1",
        ),
        (
            json!({"state_id": "x", "completed": []}),
            "invalid-state-document",
            "entry 1",
        ),
        (
            json!({"state_id": "x", "colour": 1}),
            "invalid-state-document",
            "entry 1",
        ),
        (
            json!({"completed": {}}),
            "invalid-state-document",
            "entry 1",
        ),
        (
            json!({"state_id": "x", "lease_id": "nope"}),
            "invalid-state-document",
            "entry 1 (state_id \"x\")",
        ),
        (json!({"state_id": "fine"}), "invalid-body", "entry 1"),
        (
            json!({"state_id": "locked", "completed": {}}),
            "state-locked",
            "entry 1 (state_id \"locked\")",
        ),
        (
            json!({"state_id": "locked", "lease_id": uuid::Uuid::new_v4().to_string()}),
            "lease-not-current",
            "entry 1 (state_id \"locked\")",
        ),
    ] {
        let reply = import(&app, &json!([good, bad]), &[]).await;
        assert!(reply.status.is_client_error(), "{bad}: {}", reply.text);
        assert_eq!(reply.problem_type(), kind, "{bad}");
        let detail = reply.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains(named), "{bad}: {detail}");
        app.get_state("fine")
            .await
            .expect_because(StatusCode::NOT_FOUND, "nothing written");
    }
    for body in [
        "{}",
        "[1]",
        "[",
        r#"[{"state_id":"a","completed":{"k":1,"k":2}}]"#,
    ] {
        let reply = app
            .request(Method::POST, "/v1/states", Some(body), &[])
            .await;
        reply.expect_because(StatusCode::BAD_REQUEST, body);
    }
    // With the holder's lease, the locked state is written too.
    let with_lease =
        json!([good, {"state_id": "locked", "completed": {"v": 1}, "lease_id": lease}]);
    import(&app, &with_lease, &[]).await.expect(StatusCode::OK);
    let history = app.get("/v1/states/locked/history").await.json();
    assert_eq!(history["versions"][0]["lease_owner"], "worker");
    assert_eq!(
        import(&app, &json!([]), &[]).await.json(),
        json!({"written": 0, "created": 0})
    );
    app.get("/healthz").await.expect(StatusCode::OK);
}

#[tokio::test]
async fn resetting_a_stream_removes_its_bookmark_from_both_halves_and_nothing_else() {
    let app = spawn_app().await;
    let id = "dev:shop";
    app.put_state(
        id,
        &json!({
            "completed": {"singer_state": {"bookmarks": {"orders": {"v": 1}, "customers": {"v": 1}}}, "other": 1},
            "partial": {"singer_state": {"bookmarks": {"orders": {"v": 2}, "refunds": {"v": 2}}}}
        }),
    )
    .await;
    let reply = app
        .request(
            Method::DELETE,
            &format!("/v1/states/{id}/bookmarks/orders"),
            None,
            &[],
        )
        .await;
    reply.expect(StatusCode::OK);
    let state = app.get_state(id).await.json();
    assert_eq!(
        state["completed"],
        json!({"singer_state": {"bookmarks": {"customers": {"v": 1}}}, "other": 1})
    );
    assert_eq!(
        state["partial"],
        json!({"singer_state": {"bookmarks": {"refunds": {"v": 2}}}})
    );
    assert_eq!(
        reply.json()["completed"],
        state["completed"],
        "answers the new state"
    );
    let history = app.get(&format!("/v1/states/{id}/history")).await.json();
    assert_eq!(history["versions"][0]["operation"], "reset-stream");
    assert_eq!(history["versions"][0]["changed_streams"], json!(["orders"]));

    let again = app
        .request(
            Method::DELETE,
            &format!("/v1/states/{id}/bookmarks/orders"),
            None,
            &[],
        )
        .await;
    again.expect(StatusCode::NOT_FOUND);
    assert_eq!(again.problem_type(), "bookmark-not-found");
    let missing = app
        .request(
            Method::DELETE,
            "/v1/states/nobody/bookmarks/orders",
            None,
            &[],
        )
        .await;
    assert_eq!(missing.problem_type(), "state-not-found");

    // Lease-Id and If-Match hold as for any write.
    let (lease, _) = app.lease(id, "worker", 30, 0.0).await;
    let path = format!("/v1/states/{id}/bookmarks/customers");
    let refused = app.request(Method::DELETE, &path, None, &[]).await;
    assert_eq!(refused.problem_type(), "state-locked");
    let stale = app
        .request(
            Method::DELETE,
            &path,
            None,
            &[("lease-id", &lease), ("if-match", "\"0\"")],
        )
        .await;
    stale.expect(StatusCode::PRECONDITION_FAILED);
    let done = app
        .request(Method::DELETE, &path, None, &[("lease-id", &lease)])
        .await;
    done.expect(StatusCode::OK);
    assert_eq!(
        app.get_state(id).await.json()["completed"]["singer_state"]["bookmarks"],
        json!({})
    );
}
