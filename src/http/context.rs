//! What every handler and middleware is handed.

use std::sync::Arc;
use std::time::Duration;

use super::admission::Admission;
use crate::auth::live::LiveTokens;
use crate::locks::LockManager;
use crate::metrics::Metrics;
use crate::states::States;
use crate::store::{ClickHouse, LeaseHistoryStore};

/// What every handler shares; cheap to clone.
#[derive(Clone)]
pub struct AppContext {
    pub states: Arc<States>,
    pub locks: Arc<LockManager>,
    /// Each id's leases; none when history is off.
    pub lease_history: Option<LeaseHistoryStore>,
    pub clickhouse: ClickHouse,
    pub metrics: Arc<Metrics>,
    pub body_limit: usize,
    pub body_read_timeout: Duration,
    pub admission: Arc<Admission>,
    /// Replaced whole by a reload (SIGHUP, a change of the tokens file).
    pub tokens: Arc<LiveTokens>,
    pub protect_metrics: bool,
    /// mTLS: a request on a connection without a client certificate gets
    /// only the health checks and the dashboard page.
    pub client_certificates_required: bool,
}
