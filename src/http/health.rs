//! Liveness, readiness (per component) and Prometheus metrics.

use std::time::Instant;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::context::AppContext;

/// The process is up and serving; says nothing about ClickHouse on purpose,
/// so an orchestrator does not restart the gateway for an outage it cannot fix.
pub async fn healthz() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

/// Ready while ClickHouse answers: checked live on every call.
pub async fn readyz(State(ctx): State<AppContext>) -> Response {
    let started = Instant::now();
    let clickhouse = match ctx.clickhouse.ping().await {
        Ok(()) => json!({
            "status": "ok",
            "latency_ms": started.elapsed().as_secs_f64() * 1000.0,
        }),
        Err(err) => json!({ "status": "unavailable", "error": err.to_string() }),
    };
    let ready = clickhouse["status"] == "ok";
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "status": if ready { "ok" } else { "unavailable" },
        "components": { "clickhouse": clickhouse },
    });
    (status, Json(body)).into_response()
}

pub async fn metrics(State(ctx): State<AppContext>) -> Response {
    let mut response = ctx.metrics.render().into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    response
}
