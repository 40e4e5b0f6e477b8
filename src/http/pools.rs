//! `/v1/pools`: named semaphores of `limit` slots, each lease occupying
//! `slots` of them, and a line for the rest (highest `priority` first, first
//! come first served within one), on the same lock core as `/v1/locks` (one
//! authority per pool, fencing tokens, lock-delay), over tables of their own.

use axum::Json;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use super::context::AppContext;
use super::error::ApiError;
use super::extract::{ApiQuery, LeasePath, OptionalJson, StatePath};
use super::locks::{AcquireRequest, ForceUnlockParams, PoolPlace, RenewRequest, forced_by, ttl};
use super::pool_view::PoolView;
use super::wire::rfc3339_millis;
use crate::domain::{LeaseInfo, Provenance, Scope, StateId};
use crate::locks::{Lease, LockError};
use crate::telemetry::ClientText;

/// The most slots one pool may have.
pub const MAX_POOL_LIMIT: usize = 1000;

/// How far a waiter's priority may go either way from the default 0.
pub const MAX_PRIORITY: i32 = 1000;

/// A pool lease as its holder sees it: with the `lease_id` that proves holding it.
#[derive(Serialize)]
struct PoolLeaseBody<'a> {
    pool: &'a str,
    lease_id: String,
    fencing_token: u64,
    owner: &'a str,
    acquired_at: String,
    expires_at: String,
    limit: usize,
    slots: usize,
    lock_delay_seconds: u64,
    info: &'a LeaseInfo,
}

fn lease_body(lease: &Lease) -> PoolLeaseBody<'_> {
    PoolLeaseBody {
        pool: lease.state_id.as_str(),
        lease_id: lease.lease_id.to_string(),
        fencing_token: lease.fencing_token,
        owner: &lease.owner,
        acquired_at: rfc3339_millis(lease.acquired_ms),
        expires_at: rfc3339_millis(lease.expires_ms),
        limit: lease.limit,
        slots: lease.slots,
        lock_delay_seconds: lease.lock_delay.as_secs(),
        info: &lease.info,
    }
}

/// A whole number, 1 to [`MAX_POOL_LIMIT`]; JSON's `3.0` is the integer 3.
fn pool_limit(raw: Option<f64>) -> Result<usize, ApiError> {
    let Some(limit) = raw else {
        return Err(ApiError::InvalidBody(format!(
            "limit is required: how many may hold the pool at once, 1 to {MAX_POOL_LIMIT}"
        )));
    };
    if limit.fract() != 0.0 || !(1.0..=MAX_POOL_LIMIT as f64).contains(&limit) {
        return Err(ApiError::InvalidBody(format!(
            "limit must be a whole number between 1 and {MAX_POOL_LIMIT}, got {limit}"
        )));
    }
    Ok(limit as usize)
}

/// The lease's slots, a whole number 1 to `limit` (default 1), and the
/// waiter's priority, a whole number within ±[`MAX_PRIORITY`] (default 0).
fn pool_place(
    limit: usize,
    slots: Option<f64>,
    priority: Option<f64>,
) -> Result<PoolPlace, ApiError> {
    let slots = slots.unwrap_or(1.0);
    if slots.fract() != 0.0 || !(1.0..=limit as f64).contains(&slots) {
        return Err(ApiError::InvalidBody(format!(
            "slots must be a whole number between 1 and the limit, {limit}, got {slots}"
        )));
    }
    let priority = priority.unwrap_or(0.0);
    let bound = f64::from(MAX_PRIORITY);
    if priority.fract() != 0.0 || !(-bound..=bound).contains(&priority) {
        return Err(ApiError::InvalidBody(format!(
            "priority must be a whole number between -{MAX_PRIORITY} and {MAX_PRIORITY}, got {priority}"
        )));
    }
    Ok(PoolPlace {
        limit,
        slots: slots as usize,
        priority: priority as i32,
    })
}

pub async fn acquire(
    State(ctx): State<AppContext>,
    StatePath(name): StatePath,
    headers: HeaderMap,
    OptionalJson(mut request): OptionalJson<AcquireRequest>,
) -> Result<Response, ApiError> {
    let limit = pool_limit(request.limit.take())?;
    let place = pool_place(limit, request.slots.take(), request.priority.take())?;
    let ask = request.into_ask(place, &headers)?;
    match ctx.pools.acquire(&name, ask).await {
        Ok(lease) => Ok((StatusCode::CREATED, Json(lease_body(&lease))).into_response()),
        Err(LockError::Held { .. }) => Err(full(&ctx, name, limit, None).await?),
        Err(LockError::Delayed { free_at_ms, .. }) => {
            Err(full(&ctx, name, limit, Some(free_at_ms)).await?)
        }
        Err(err) => Err(err.into()),
    }
}

/// The 409 of a pool of `limit` that stayed full: who holds it now (an
/// earlier authority's leases that keep their places included, as `GET`
/// shows them), and when a place comes free if only lock-delays keep them.
async fn full(
    ctx: &AppContext,
    name: StateId,
    limit: usize,
    free_at_ms: Option<i64>,
) -> Result<ApiError, ApiError> {
    let occupancy = ctx.pools.occupancy(&name).await?;
    let view = match &occupancy {
        Some(occupancy) => PoolView::from(occupancy),
        None => PoolView::empty(&name, limit),
    };
    Ok(ApiError::PoolFull {
        name: name.as_str().to_owned(),
        view: Box::new(view),
        free_at_ms,
    })
}

pub async fn renew(
    State(ctx): State<AppContext>,
    LeasePath(name, lease_id): LeasePath,
    OptionalJson(request): OptionalJson<RenewRequest>,
) -> Result<Response, ApiError> {
    let lease = ctx
        .pools
        .renew(&name, lease_id, ttl(request.ttl_seconds)?)
        .await?;
    Ok(Json(lease_body(&lease)).into_response())
}

pub async fn release(
    State(ctx): State<AppContext>,
    LeasePath(name, lease_id): LeasePath,
) -> Result<StatusCode, ApiError> {
    ctx.pools.release(&name, lease_id).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn get(
    State(ctx): State<AppContext>,
    StatePath(name): StatePath,
) -> Result<Json<PoolView>, ApiError> {
    match ctx.pools.occupancy(&name).await? {
        Some(occupancy) => Ok(Json(PoolView::from(&occupancy))),
        None => Err(ApiError::PoolNotFound(name.as_str().to_owned())),
    }
}

#[derive(Serialize)]
pub struct PoolList {
    pools: Vec<PoolView>,
}

pub async fn list(
    State(ctx): State<AppContext>,
    Extension(scope): Extension<Scope>,
) -> Result<Json<PoolList>, ApiError> {
    let occupancies = ctx.pools.occupancies().await?;
    Ok(Json(PoolList {
        pools: occupancies
            .iter()
            .filter(|occupancy| scope.allows(&occupancy.id))
            .map(PoolView::from)
            .collect(),
    }))
}

/// Admin: ends every lease of the pool; succeeds when there is none. Each
/// lease's row keeps who did it (the token's name) and why.
pub async fn force_release(
    State(ctx): State<AppContext>,
    StatePath(name): StatePath,
    provenance: Provenance,
    ApiQuery(params): ApiQuery<ForceUnlockParams>,
) -> Result<StatusCode, ApiError> {
    let forced = forced_by(provenance, params)?;
    let released = ctx.pools.force_unlock(&name, forced.clone()).await?;
    tracing::warn!(
        pool = %name,
        released,
        actor = %ClientText(&forced.actor),
        reason = %ClientText(&forced.reason),
        "pool force-release"
    );
    Ok(StatusCode::NO_CONTENT)
}
