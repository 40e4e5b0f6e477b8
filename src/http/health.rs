//! Liveness, readiness (per component) and Prometheus metrics. Handed the
//! readiness check and the metrics, not the whole `AppContext` (see its
//! `FromRef`s): the context holds the [`Readiness`], so this module stays
//! below it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::error::ProblemType;
use crate::store::ClickHouse;
use crate::telemetry::ClientText;

/// How old a readiness check may be and still answer a probe.
const FRESH_FOR: Duration = Duration::from_secs(1);

/// The process is up and serving; says nothing about ClickHouse on purpose,
/// so an orchestrator does not restart the gateway for an outage it cannot fix.
pub async fn healthz() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

/// Ready while ClickHouse answers, from a check at most [`FRESH_FOR`] old.
pub async fn readyz(State(readiness): State<Arc<Readiness>>) -> Response {
    let clickhouse = match readiness.check().await {
        Outcome::Ready { latency_ms } => json!({ "status": "ok", "latency_ms": latency_ms }),
        // Anyone may probe: ClickHouse's own text (hosts, users, what a
        // query quoted) goes to the log, the answer names only the problem.
        Outcome::Unavailable => json!({
            "status": "unavailable",
            "problem": ProblemType::ClickHouseUnavailable.uri(),
        }),
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

/// What one readiness check found.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Outcome {
    Ready { latency_ms: f64 },
    Unavailable,
}

/// The newest readiness check, shared by every probe: probes cost
/// ClickHouse at most one ping a second however many arrive.
pub struct Readiness {
    clickhouse: ClickHouse,
    /// The newest check and when it ended. An async lock, held across the
    /// ping on purpose: probes that arrive during a check wait for its
    /// outcome instead of sending pings of their own. A probe dropped
    /// mid-ping frees the lock, and the next one checks anew.
    newest: tokio::sync::Mutex<Option<(Instant, Outcome)>>,
}

impl Readiness {
    pub fn new(clickhouse: ClickHouse) -> Self {
        Self {
            clickhouse,
            newest: tokio::sync::Mutex::new(None),
        }
    }

    pub async fn check(&self) -> Outcome {
        let mut newest = self.newest.lock().await;
        if let Some((at, outcome)) = *newest
            && at.elapsed() < FRESH_FOR
        {
            return outcome;
        }
        let started = Instant::now();
        let outcome = match self.clickhouse.ping().await {
            Ok(()) => Outcome::Ready {
                // Whole microseconds: at most 3 decimals, not the 15 a
                // float's nanoseconds print with.
                latency_ms: started.elapsed().as_micros() as f64 / 1000.0,
            },
            Err(err) => {
                let error = err.to_string();
                tracing::warn!(error = %ClientText(&error), "not ready: ClickHouse does not answer");
                Outcome::Unavailable
            }
        };
        *newest = Some((Instant::now(), outcome));
        outcome
    }
}
