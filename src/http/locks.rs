//! `/v1/locks`: leases on state_ids for workers, and views for operators.

use std::time::Duration;

use axum::Json;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::context::AppContext;
use super::error::ApiError;
use super::extract::{ApiQuery, LeasePath, OptionalJson, StatePath};
use super::lock_view::LockView;
use super::wire::rfc3339_millis;
use crate::domain::{Forced, LeaseInfo, MAX_REASON_BYTES, Provenance, Scope, parse_reason};
use crate::locks::{Ask, FORWARDED_BY, Lease, SeenLease, UNCONFIRMED_GRANT};
use crate::telemetry::ClientText;

pub const DEFAULT_TTL_SECONDS: u64 = 30;
pub const MAX_TTL_SECONDS: u64 = 3600;
pub const MAX_WAIT_SECONDS: f64 = 300.0;
pub const MAX_OWNER_BYTES: usize = 256;

/// The body of an acquire, on a state_id or a pool.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct AcquireRequest {
    owner: Option<String>,
    ttl_seconds: Option<f64>,
    wait_seconds: Option<f64>,
    lock_delay_seconds: Option<f64>,
    info: Option<serde_json::Value>,
    /// A pool's only: how many slots it has.
    pub limit: Option<f64>,
    /// A pool's only: how many of its slots the lease occupies.
    pub slots: Option<f64>,
    /// A pool's only: the waiter's place in line.
    pub priority: Option<f64>,
}

/// Where a pool acquire waits, and how much of the pool it takes.
#[derive(Clone, Copy)]
pub struct PoolPlace {
    pub limit: usize,
    pub slots: usize,
    pub priority: i32,
}

impl PoolPlace {
    /// A state_id's: its one place, at the default priority.
    const LOCK: Self = Self {
        limit: 1,
        slots: 1,
        priority: 0,
    };
}

impl AcquireRequest {
    /// The lease asked for, taking `place`. A forwarded acquire is granted
    /// for a few seconds until the forwarding gateway confirms it
    /// (`http::forward`).
    pub fn into_ask(self, place: PoolPlace, headers: &HeaderMap) -> Result<Ask, ApiError> {
        let owner = self.owner.unwrap_or_default();
        if owner.is_empty() || owner.len() > MAX_OWNER_BYTES {
            return Err(ApiError::InvalidBody(format!(
                "owner is required: who takes the lease, 1 to {MAX_OWNER_BYTES} bytes"
            )));
        }
        let mut ttl = ttl(self.ttl_seconds)?;
        if headers.contains_key(FORWARDED_BY) {
            ttl = ttl.min(UNCONFIRMED_GRANT);
        }
        let lock_delay = lock_delay(self.lock_delay_seconds)?;
        let wait = self.wait_seconds.unwrap_or(0.0);
        if !(0.0..=MAX_WAIT_SECONDS).contains(&wait) {
            return Err(ApiError::InvalidBody(format!(
                "wait_seconds must be between 0 and {MAX_WAIT_SECONDS}"
            )));
        }
        let info = match self.info {
            Some(value) => {
                LeaseInfo::parse(value).map_err(|e| ApiError::InvalidBody(e.to_string()))?
            }
            None => LeaseInfo::default(),
        };
        Ok(Ask {
            owner,
            limit: place.limit,
            slots: place.slots,
            priority: place.priority,
            ttl,
            wait: Duration::from_secs_f64(wait),
            lock_delay,
            info,
        })
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RenewRequest {
    pub ttl_seconds: Option<f64>,
}

/// A lease as its holder sees it: with the `lease_id` that proves holding it.
#[derive(Serialize)]
struct LeaseBody<'a> {
    state_id: &'a str,
    lease_id: String,
    fencing_token: u64,
    owner: &'a str,
    acquired_at: String,
    expires_at: String,
    lock_delay_seconds: u64,
    info: &'a LeaseInfo,
}

fn lease_body(lease: &Lease) -> LeaseBody<'_> {
    LeaseBody {
        state_id: lease.state_id.as_str(),
        lease_id: lease.lease_id.to_string(),
        fencing_token: lease.fencing_token,
        owner: &lease.owner,
        acquired_at: rfc3339_millis(lease.acquired_ms),
        expires_at: rfc3339_millis(lease.expires_ms),
        lock_delay_seconds: lease.lock_delay.as_secs(),
        info: &lease.info,
    }
}

/// A whole number of seconds, 1 to 3600; JSON's `30.0` is the integer 30.
pub fn ttl(raw: Option<f64>) -> Result<Duration, ApiError> {
    let seconds = raw.unwrap_or(DEFAULT_TTL_SECONDS as f64);
    if seconds.fract() != 0.0 || !(1.0..=MAX_TTL_SECONDS as f64).contains(&seconds) {
        return Err(ApiError::InvalidBody(format!(
            "ttl_seconds must be a whole number between 1 and {MAX_TTL_SECONDS}, got {seconds}"
        )));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// A whole number of seconds, at least 0, read as `ttl` reads its own: JSON's
/// `5.0` is the integer 5. Any size is taken; the lock core cuts it to
/// `--max-lock-delay`.
fn lock_delay(raw: Option<f64>) -> Result<Duration, ApiError> {
    let seconds = raw.unwrap_or(0.0);
    if seconds.fract() != 0.0 || seconds < 0.0 {
        return Err(ApiError::InvalidBody(format!(
            "lock_delay_seconds must be a whole number, at least 0, got {seconds}"
        )));
    }
    Ok(Duration::try_from_secs_f64(seconds).unwrap_or(Duration::MAX))
}

pub async fn acquire(
    State(ctx): State<AppContext>,
    StatePath(id): StatePath,
    headers: HeaderMap,
    OptionalJson(request): OptionalJson<AcquireRequest>,
) -> Result<Response, ApiError> {
    if request.limit.is_some() || request.slots.is_some() || request.priority.is_some() {
        return Err(ApiError::InvalidBody(
            "limit, slots and priority are a pool's (POST /v1/pools/{name}); a state_id has one lease at a time, first come first served".into(),
        ));
    }
    let lease = ctx
        .locks
        .acquire(&id, request.into_ask(PoolPlace::LOCK, &headers)?)
        .await?;
    Ok((StatusCode::CREATED, Json(lease_body(&lease))).into_response())
}

pub async fn renew(
    State(ctx): State<AppContext>,
    LeasePath(id, lease_id): LeasePath,
    OptionalJson(request): OptionalJson<RenewRequest>,
) -> Result<Response, ApiError> {
    let lease = ctx
        .locks
        .renew(&id, lease_id, ttl(request.ttl_seconds)?)
        .await?;
    Ok(Json(lease_body(&lease)).into_response())
}

pub async fn release(
    State(ctx): State<AppContext>,
    LeasePath(id, lease_id): LeasePath,
) -> Result<StatusCode, ApiError> {
    ctx.locks.release(&id, lease_id).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn get(
    State(ctx): State<AppContext>,
    StatePath(id): StatePath,
    seen: Option<Extension<SeenLease>>,
) -> Result<Json<LockView>, ApiError> {
    match ctx.locks.holder(&id, seen.as_deref()).await? {
        Some(lease) => Ok(Json(LockView::from(&lease))),
        None => Err(ApiError::LockNotFound(id.as_str().to_owned())),
    }
}

#[derive(Serialize)]
pub struct LockList {
    locks: Vec<LockView>,
}

pub async fn list(
    State(ctx): State<AppContext>,
    Extension(scope): Extension<Scope>,
) -> Result<Json<LockList>, ApiError> {
    let leases = ctx.locks.all().await?;
    Ok(Json(LockList {
        locks: leases
            .iter()
            .filter(|lease| scope.allows(&lease.state_id))
            .map(LockView::from)
            .collect(),
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForceUnlockParams {
    reason: Option<String>,
}

/// Who forces a lease's end and why: the token's name, and `?reason=`.
pub fn forced_by(provenance: Provenance, params: ForceUnlockParams) -> Result<Forced, ApiError> {
    let reason = parse_reason(params.reason).map_err(|bytes| {
        ApiError::InvalidQuery(format!(
            "reason takes at most {MAX_REASON_BYTES} bytes, got {bytes}"
        ))
    })?;
    Ok(Forced {
        actor: provenance.actor,
        reason,
    })
}

/// Admin: ends the lease on `state_id` whoever holds it; succeeds when there
/// is none. The id's history keeps who did it (the token's name) and why.
pub async fn force_unlock(
    State(ctx): State<AppContext>,
    StatePath(id): StatePath,
    provenance: Provenance,
    ApiQuery(params): ApiQuery<ForceUnlockParams>,
) -> Result<StatusCode, ApiError> {
    let forced = forced_by(provenance, params)?;
    let released = ctx.locks.force_unlock(&id, forced.clone()).await?;
    tracing::warn!(
        state_id = %id,
        released,
        actor = %ClientText(&forced.actor),
        reason = %ClientText(&forced.reason),
        "force-unlock"
    );
    Ok(StatusCode::NO_CONTENT)
}
