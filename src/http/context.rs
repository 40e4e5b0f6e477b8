//! What every handler and middleware is handed.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::FromRef;

use super::admission::Admission;
use super::browser::OwnHosts;
use super::health::Readiness;
use crate::auth::live::LiveTokens;
use crate::locks::LockManager;
use crate::metrics::Metrics;
use crate::states::States;
use crate::store::{ClickHouse, Journal};

/// What every handler shares; cheap to clone.
#[derive(Clone)]
pub struct AppContext {
    pub states: Arc<States>,
    pub locks: Arc<LockManager>,
    /// The pools' leases: the same lock core over the pool tables.
    pub pools: Arc<LockManager>,
    /// Each id's past leases, unless history is off.
    pub journal: Journal,
    pub clickhouse: ClickHouse,
    /// The newest readiness check, which every `/readyz` probe shares.
    pub readiness: Arc<Readiness>,
    pub metrics: Arc<Metrics>,
    pub body_limit: usize,
    pub body_read_timeout: Duration,
    pub admission: Arc<Admission>,
    /// Replaced whole by a reload (SIGHUP, a change of the tokens file).
    pub tokens: Arc<LiveTokens>,
    pub protect_metrics: bool,
    /// The hosts a gateway without tokens answers to (see `browser`).
    pub own_hosts: Arc<OwnHosts>,
    /// mTLS: a request on a connection without a client certificate gets
    /// only the health checks and the dashboard page.
    pub client_certificates_required: bool,
}

impl FromRef<AppContext> for Arc<Readiness> {
    fn from_ref(ctx: &AppContext) -> Self {
        ctx.readiness.clone()
    }
}
