//! Bookmarks that go away (`--bookmark-loss warn|reject|off`): a stream of
//! the stored effective state whose bookmark a write drops is warned about
//! in an answer header, history and /metrics, refused with 409 unless
//! allowed, or not looked for. DELETE, stream reset and rollback are never
//! checked.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::helpers::{
    Api, Reply, TestApp, encode_id, metric, spawn_app, spawn_app_with, two_peers_with,
};
use statehouse::domain::GuardMode;

/// `orders` and `refunds` with values, in the completed half.
fn both() -> Value {
    json!({"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "id", "replication_key_value": 5},
        "refunds": {"replication_key": "updated_at", "replication_key_value": "2024-05-01T10:00:00Z"}
    }}}})
}

/// `orders` alone: `refunds` dropped.
fn orders_only(orders: u64) -> Value {
    json!({"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "id", "replication_key_value": orders}
    }}}})
}

async fn write(
    api: &Api,
    method: Method,
    id: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> Reply {
    let path = format!("/v1/states/{}", encode_id(id));
    api.request(method, &path, Some(&body.to_string()), headers)
        .await
}

async fn put(api: &Api, id: &str, body: &Value) -> Reply {
    write(api, Method::PUT, id, body, &[]).await
}

/// The streams a write was answered as losing.
fn lost(reply: &Reply) -> Option<&str> {
    reply.header("statehouse-bookmark-loss")
}

async fn losses_counted(api: &Api) -> f64 {
    let text = api.get("/metrics").await.text;
    metric(&text, "statehouse_bookmark_losses_total").unwrap()
}

async fn newest_version(api: &Api, id: &str) -> Value {
    let path = format!("/v1/states/{}/history", encode_id(id));
    api.get(&path).await.json()["versions"][0].clone()
}

async fn reject_app() -> TestApp {
    spawn_app_with(|config| config.bookmark_loss = GuardMode::Reject).await
}

#[tokio::test]
async fn by_default_a_loss_is_written_and_named_in_a_header_history_and_the_metric() {
    let app = spawn_app().await;
    put(&app, "job", &both()).await.expect(StatusCode::CREATED);
    let before = losses_counted(&app).await;
    let dropped = put(&app, "job", &orders_only(6)).await;
    dropped.expect(StatusCode::OK);
    assert_eq!(lost(&dropped), Some("refunds"));
    assert_eq!(
        newest_version(&app, "job").await["lost_streams"],
        json!(["refunds"])
    );
    assert_eq!(losses_counted(&app).await - before, 1.0);
    let bookmarks = &app.get_state("job").await.json()["completed"]["singer_state"]["bookmarks"];
    assert!(bookmarks.get("refunds").is_none(), "written");

    let forward = put(&app, "job", &orders_only(7)).await;
    forward.expect(StatusCode::OK);
    assert_eq!(lost(&forward), None);
    assert_eq!(newest_version(&app, "job").await["lost_streams"], json!([]));
}

#[tokio::test]
async fn an_emptied_state_loses_every_stream() {
    let app = spawn_app().await;
    for (n, empty) in [
        json!({}),
        json!({"completed": {}, "partial": {}}),
        json!({"completed": {"singer_state": {"bookmarks": {}}}}),
    ]
    .iter()
    .enumerate()
    {
        let id = format!("job-{n}");
        put(&app, &id, &both()).await.expect(StatusCode::CREATED);
        let emptied = put(&app, &id, empty).await;
        emptied.expect(StatusCode::OK);
        assert_eq!(lost(&emptied), Some("orders, refunds"), "{empty}");
    }
}

#[tokio::test]
async fn a_value_or_a_partition_gone_is_lost_a_new_key_stream_or_value_is_not() {
    let app = spawn_app().await;
    put(&app, "job", &both()).await;
    let valueless = json!({"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "id", "replication_key_value": 5},
        "refunds": {"replication_key": "updated_at"}
    }}}});
    assert_eq!(lost(&put(&app, "job", &valueless).await), Some("refunds"));

    put(&app, "job", &both()).await;
    let moved = json!({"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "created_at", "replication_key_value": "2020-01-01"},
        "refunds": {"replication_key": "updated_at", "replication_key_value": "2024-04-01T00:00:00Z"},
        "items": {"replication_key": "id", "replication_key_value": 1}
    }}}});
    let reply = put(&app, "job", &moved).await;
    reply.expect(StatusCode::OK);
    assert_eq!(
        lost(&reply),
        None,
        "a changed key, a new stream, a moved value"
    );

    let shops = |shops: &[&str]| {
        let partitions: Vec<Value> = shops
            .iter()
            .map(|shop| json!({"context": {"shop": shop}, "replication_key": "id", "replication_key_value": 3}))
            .collect();
        json!({"completed": {"singer_state": {"bookmarks": {"orders": {"partitions": partitions}}}}})
    };
    put(&app, "parts", &shops(&["a", "b"])).await;
    assert_eq!(lost(&put(&app, "parts", &shops(&["b", "a"])).await), None);
    assert_eq!(
        lost(&put(&app, "parts", &shops(&["a"])).await),
        Some("orders")
    );
}

#[tokio::test]
async fn the_effective_state_is_compared() {
    let app = spawn_app().await;
    let partial_refunds = json!({
        "completed": {"singer_state": {"bookmarks": {"orders": {"replication_key": "id", "replication_key_value": 5}}}},
        "partial": {"singer_state": {"bookmarks": {"refunds": {"replication_key": "id", "replication_key_value": 2}}}}
    });
    put(&app, "partial-only", &partial_refunds).await;
    assert_eq!(
        lost(&put(&app, "partial-only", &orders_only(5)).await),
        Some("refunds")
    );

    let in_both = json!({
        "completed": {"singer_state": {"bookmarks": {"refunds": {"replication_key": "id", "replication_key_value": 2}}}},
        "partial": {"singer_state": {"bookmarks": {"refunds": {"replication_key": "id", "replication_key_value": 3}}}}
    });
    put(&app, "in-both", &in_both).await;
    let completed_only = json!({"completed": in_both["completed"]});
    let reply = put(&app, "in-both", &completed_only).await;
    reply.expect(StatusCode::OK);
    assert_eq!(lost(&reply), None, "still in completed");

    put(&app, "patched", &both()).await;
    let patch = write(&app, Method::PATCH, "patched", &orders_only(6), &[]).await;
    patch.expect(StatusCode::OK);
    assert_eq!(lost(&patch), Some("refunds"), "a complete PATCH replaces");
}

#[tokio::test]
async fn reject_refuses_a_loss_naming_it_and_writes_nothing() {
    let app = reject_app().await;
    put(&app, "job", &both()).await.expect(StatusCode::CREATED);
    let etag = app.get_state("job").await.header("etag").map(str::to_owned);
    let history = app.get("/v1/states/job/history").await.json();

    let refused = put(&app, "job", &orders_only(6)).await;
    refused.expect(StatusCode::CONFLICT);
    assert_eq!(refused.problem_type(), "bookmark-loss");
    assert_eq!(
        refused.json()["losses"],
        json!([{"stream": "refunds", "from": "2024-05-01T10:00:00Z"}])
    );
    let now = app.get_state("job").await;
    assert_eq!(
        now.json()["completed"],
        both()["completed"],
        "nothing written"
    );
    assert_eq!(now.header("etag").map(str::to_owned), etag);
    assert_eq!(app.get("/v1/states/job/history").await.json(), history);

    let patch = write(&app, Method::PATCH, "job", &orders_only(6), &[]).await;
    assert_eq!(patch.problem_type(), "bookmark-loss");
}

#[tokio::test]
async fn the_allow_header_lets_named_streams_or_all_through_still_named() {
    let app = reject_app().await;
    put(&app, "job", &both()).await;
    let other = write(
        &app,
        Method::PUT,
        "job",
        &orders_only(6),
        &[("statehouse-allow-loss", "orders")],
    )
    .await;
    assert_eq!(other.problem_type(), "bookmark-loss");
    let named = write(
        &app,
        Method::PUT,
        "job",
        &orders_only(6),
        &[("statehouse-allow-loss", "refunds")],
    )
    .await;
    named.expect(StatusCode::OK);
    assert_eq!(lost(&named), Some("refunds"));
    put(&app, "job", &both()).await;
    let all = write(
        &app,
        Method::PUT,
        "job",
        &json!({}),
        &[("statehouse-allow-loss", "*")],
    )
    .await;
    all.expect(StatusCode::OK);
    assert_eq!(lost(&all), Some("orders, refunds"));
    assert_eq!(
        newest_version(&app, "job").await["lost_streams"],
        json!(["orders", "refunds"])
    );
}

#[tokio::test]
async fn reject_never_checks_a_stream_reset_a_rollback_or_a_delete() {
    let app = reject_app().await;
    put(&app, "job", &orders_only(5)).await;
    let first = newest_version(&app, "job").await["version"].clone();
    put(&app, "job", &both()).await;
    let reset = app
        .request(
            Method::DELETE,
            "/v1/states/job/bookmarks/refunds",
            None,
            &[],
        )
        .await;
    assert!(reset.status.is_success(), "{}", reset.text);
    put(&app, "job", &both()).await;
    let rollback = app
        .request(
            Method::POST,
            "/v1/states/job/rollback",
            Some(&json!({"version": first}).to_string()),
            &[],
        )
        .await;
    assert!(rollback.status.is_success(), "{}", rollback.text);
    assert_eq!(
        app.get_state("job").await.json()["completed"],
        orders_only(5)["completed"]
    );
    app.delete_state("job").await.expect(StatusCode::NO_CONTENT);
}

#[tokio::test]
async fn reject_refuses_a_bulk_import_whole_naming_the_entry_and_the_stream() {
    let app = reject_app().await;
    put(&app, "b", &both()).await;
    let batch = json!([
        {"state_id": "a", "completed": both()["completed"]},
        {"state_id": "b", "completed": orders_only(6)["completed"]}
    ])
    .to_string();
    let refused = app
        .request(Method::POST, "/v1/states", Some(&batch), &[])
        .await;
    refused.expect(StatusCode::CONFLICT);
    assert_eq!(refused.problem_type(), "bookmark-loss");
    let body = refused.json();
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.contains("entry 1") && detail.contains("refunds"),
        "{detail}"
    );
    assert_eq!(body["losses"][0]["stream"], "refunds");
    app.get_state("a")
        .await
        .expect_because(StatusCode::NOT_FOUND, "nothing written");
    assert_eq!(
        app.get_state("b").await.json()["completed"],
        both()["completed"]
    );
    let allowed = app
        .request(
            Method::POST,
            "/v1/states",
            Some(&batch),
            &[("statehouse-allow-loss", "refunds")],
        )
        .await;
    allowed.expect(StatusCode::OK);
    assert_eq!(
        app.get_state("b").await.json()["completed"],
        orders_only(6)["completed"]
    );
}

#[tokio::test]
async fn off_flags_nothing() {
    let app = spawn_app_with(|config| config.bookmark_loss = GuardMode::Off).await;
    put(&app, "job", &both()).await;
    let before = losses_counted(&app).await;
    let emptied = put(&app, "job", &json!({})).await;
    emptied.expect(StatusCode::OK);
    assert_eq!(lost(&emptied), None);
    assert_eq!(newest_version(&app, "job").await["lost_streams"], json!([]));
    assert_eq!(losses_counted(&app).await, before);
}

#[test]
fn an_unknown_mode_exits_non_zero_naming_the_flag() {
    for args in [&["serve", "--bookmark-loss", "maybe"][..], &["serve"][..]] {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_statehouse"))
            .args(args)
            .env_clear()
            .env("STATEHOUSE_BOOKMARK_LOSS", "maybe")
            .output()
            .expect("statehouse runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?}: {stderr}");
        assert!(
            stderr.contains("--bookmark-loss") && stderr.contains("maybe"),
            "{stderr}"
        );
    }
}

/// With a lease, through the gateway that is not the id's authority: the
/// request is forwarded with its allow header, and the answer comes back
/// with its loss header or its 409.
#[tokio::test]
async fn a_forwarded_write_under_a_lease_is_held_to_the_same_rules() {
    let (a, b) = two_peers_with(|_, config| config.bookmark_loss = GuardMode::Reject).await;
    let (lease, _) = a.lease("job", "w", 30, 0.0).await;
    a.put_state_with_lease("job", &both(), &lease)
        .await
        .expect(StatusCode::CREATED);
    let refused = write(
        &b,
        Method::PUT,
        "job",
        &orders_only(6),
        &[("lease-id", &lease)],
    )
    .await;
    refused.expect(StatusCode::CONFLICT);
    assert_eq!(refused.json()["losses"][0]["stream"], "refunds");
    let allowed = write(
        &b,
        Method::PUT,
        "job",
        &orders_only(6),
        &[("lease-id", &lease), ("statehouse-allow-loss", "refunds")],
    )
    .await;
    allowed.expect(StatusCode::OK);
    assert_eq!(lost(&allowed), Some("refunds"));
    assert_eq!(
        a.get_state("job").await.json()["completed"],
        orders_only(6)["completed"]
    );
}
