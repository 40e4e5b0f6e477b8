//! A failing or slow ClickHouse gives a clear 503, never a hang or a lost write.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::{TestApp, clickhouse_target, spawn_app_with};
use crate::proxy::Proxy;

async fn app_behind_proxy(query_timeout: Duration) -> (TestApp, Proxy) {
    let target = clickhouse_target();
    let upstream = tokio::net::lookup_host((target.host.as_str(), target.port))
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = Proxy::start(upstream).await;
    let app = spawn_app_with(|config| {
        config.clickhouse.host = proxy.addr.ip().to_string();
        config.clickhouse.port = proxy.addr.port();
        config.query_timeout = query_timeout;
    })
    .await;
    (app, proxy)
}

#[tokio::test]
async fn clickhouse_down_gives_503_and_the_gateway_recovers_by_itself() {
    let (app, proxy) = app_behind_proxy(Duration::from_secs(5)).await;
    let kept = app.put_state("kept", &json!({"completed": {"v": 1}})).await;
    assert_eq!(kept.status, StatusCode::CREATED);

    proxy.set_down(true);
    let read = app.get_state("kept").await;
    assert_eq!(
        read.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        read.text
    );
    assert_eq!(read.problem_type(), "clickhouse-unavailable");
    let write = app.put_state("lost", &json!({"completed": {"v": 2}})).await;
    assert_eq!(write.status, StatusCode::SERVICE_UNAVAILABLE);
    let listing = app.get("/v1/states").await;
    assert_eq!(listing.status, StatusCode::SERVICE_UNAVAILABLE);
    let ready = app.get("/readyz").await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        ready.json()["components"]["clickhouse"]["status"],
        "unavailable"
    );
    assert_eq!(
        app.get("/healthz").await.status,
        StatusCode::OK,
        "liveness does not depend on ClickHouse"
    );

    proxy.set_down(false);
    assert_eq!(app.get("/readyz").await.status, StatusCode::OK);
    assert_eq!(
        app.get_state("kept").await.json()["completed"]["v"],
        1,
        "acknowledged write survived"
    );
    assert_eq!(
        app.get_state("lost").await.status,
        StatusCode::NOT_FOUND,
        "the refused write did not happen"
    );
}

#[tokio::test]
async fn a_stalled_clickhouse_gives_503_at_the_query_timeout() {
    let (app, proxy) = app_behind_proxy(Duration::from_millis(300)).await;
    app.put_state("slow", &json!({})).await;
    proxy.set_delay(Duration::from_secs(3));
    // The client gives up far later than the gateway should: a hang fails here.
    let reply = tokio::time::timeout(Duration::from_secs(20), app.get_state("slow"))
        .await
        .expect("the gateway answers instead of hanging");
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.problem_type(), "clickhouse-unavailable");
    assert!(
        reply.json()["detail"]
            .as_str()
            .unwrap()
            .contains("did not answer")
    );
    let ready = app.get("/readyz").await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
    proxy.set_delay(Duration::ZERO);
    assert_eq!(app.get_state("slow").await.status, StatusCode::OK);
}
