//! The routing vocabulary: which gateway is a state_id's authority, as
//! peers reach it, and where a request about the id is served.

use std::time::{Duration, Instant};

use axum::http::{HeaderName, HeaderValue};
use uuid::Uuid;

use crate::domain::Lease;
use crate::store::{Candidate, now_ms};

pub const FORWARDED_BY: HeaderName = HeaderName::from_static("x-statehouse-forwarded-by");

/// The gateway a forwarded request was sent to: a gateway that is not it
/// acts on nothing (another one answers at the address its claim names,
/// say one of another cluster, or started there since) and answers 421
/// naming itself in [`GATEWAY_ID`].
pub const FORWARDED_TO: HeaderName = HeaderName::from_static("x-statehouse-forwarded-to");

/// The gateway that answered a forwarded request meant for another one.
pub const GATEWAY_ID: HeaderName = HeaderName::from_static("x-statehouse-gateway-id");

/// A gateway id as the value of one of these headers.
pub fn uuid_header(id: Uuid) -> HeaderValue {
    HeaderValue::from_str(&id.to_string()).expect("a UUID is a valid header value")
}

/// The gateway that is the authority for a state_id, as peers reach it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub gateway_id: Uuid,
    pub url: String,
    /// When its claim lapses unless renewed (ms since the epoch, ClickHouse's
    /// clock): until then nobody else can become the authority.
    pub lapses_at_ms: i64,
}

impl Peer {
    pub(super) fn of(candidate: &Candidate) -> Self {
        Self {
            gateway_id: candidate.gateway_id,
            url: candidate.advertise_url.trim_end_matches('/').to_owned(),
            lapses_at_ms: candidate.expires_ms,
        }
    }

    /// How long until another gateway may take the id over, for `Retry-After`.
    pub fn lapses_in(&self) -> Duration {
        Duration::from_millis(u64::try_from(self.lapses_at_ms - now_ms()).unwrap_or(0))
    }
}

/// Where a request about a state_id is served.
#[derive(Clone, Debug)]
pub enum Route {
    /// With the lease ClickHouse records, when finding the route read it.
    Here(Option<SeenLease>),
    Peer(Peer),
}

/// The lease in force on a state_id that no gateway holds a claim on, as a
/// request's routing read it: its lock check need not read it again (see
/// `Coordinator::recorded_lease`). A write's routing read also reads the
/// id's current row, which the store keeps for the write (see
/// `LockManager::seen_at`).
#[derive(Clone, Debug)]
pub struct SeenLease {
    pub(super) lease: Option<Lease>,
    /// When the read was asked for: it sees every write acknowledged before.
    pub(super) at: Instant,
}
