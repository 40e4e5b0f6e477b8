//! Sends a state_id's lock operations and lock-checked writes to the gateway
//! that is the id's authority (see `locks::forward`), so that a client never
//! needs to know which gateway granted its lease.

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::context::AppContext;
use super::error::{ApiError, Misrouted};
use super::extract::{LOCK_BODY_LIMIT, path_id, read_body};
use super::locks::MAX_WAIT_SECONDS;
use crate::locks::{FORWARDED_BY, ForwardError, LockError, LockManager, Peer, Route};

/// How long a forwarded request may take, beyond an acquire's own wait.
const FORWARD_DEADLINE: Duration = Duration::from_secs(30);

/// How many gateways a request is tried at before its client is told to
/// retry: the authority can move while a request looks for it.
const ATTEMPTS: usize = 3;

/// Serves the request here when this gateway is the id's authority (or
/// nobody is), else forwards it to the authority; an acquire that finds the
/// authority only by losing the claim to it is forwarded then. A request
/// that was itself forwarded is never forwarded again.
pub async fn to_authority(State(ctx): State<AppContext>, request: Request, next: Next) -> Response {
    let (mut parts, body) = request.into_parts();
    let Some(id) = path_id(&mut parts).await else {
        // A malformed id: the handler answers why.
        return next.run(Request::from_parts(parts, body)).await;
    };
    let forwarded = parts.headers.contains_key(FORWARDED_BY);
    let locks = lock_manager(&ctx, &parts);
    // Kept whole: the request may be sent on after it was looked at.
    // Lock requests have a small body limit of their own (`LOCK_BODY_LIMIT`).
    let limit = if is_lock_path(&parts) {
        LOCK_BODY_LIMIT.min(ctx.body_limit)
    } else {
        ctx.body_limit
    };
    let body = match read_body(Request::from_parts(parts.clone(), body), &ctx, limit).await {
        Ok(body) => body,
        Err(err) => return err.into_response(),
    };
    let rebuild = |parts: &Parts| Request::from_parts(parts.clone(), Body::from(body.clone()));
    let deadline = if parts.method == Method::POST {
        Duration::from_secs_f64(MAX_WAIT_SECONDS) + FORWARD_DEADLINE
    } else {
        FORWARD_DEADLINE
    };
    // The loop guard's side trusts no remembered authority: it answers 421
    // only when ClickHouse names another gateway.
    // A write's routing read brings the current row along: one statement
    // where it is served here, instead of a second read under its lock.
    let with_row = parts.uri.path().starts_with("/v1/states/");
    let mut route = locks.route(&id, !forwarded, with_row).await;
    for attempt in 1..=ATTEMPTS {
        let peer = match route {
            Err(err) => return ApiError::from(err).into_response(),
            Ok(Route::Peer(peer)) if forwarded => return misdirected(&peer),
            Ok(Route::Peer(peer)) => peer,
            Ok(Route::Here(seen)) => {
                // The lock check of the handler goes by what routing read.
                let mut here = rebuild(&parts);
                if let Some(seen) = seen {
                    here.extensions_mut().insert(seen);
                }
                let mut response = next.clone().run(here).await;
                let Some(Misrouted(peer)) = response.extensions_mut().remove::<Misrouted>() else {
                    return response;
                };
                if forwarded || attempt == ATTEMPTS {
                    return moving(response, forwarded);
                }
                route = Ok(Route::Peer(peer));
                continue;
            }
        };
        let response = match locks.forward(&peer, rebuild(&parts), deadline).await {
            Ok(response) => response,
            Err(err) => {
                // A gateway whose claim had lapsed, asked first, is passed
                // over once it leaves a request unanswered: looked up afresh,
                // the id is served here. A live authority stays the one.
                route = locks.route(&id, false, with_row).await;
                if attempt < ATTEMPTS && matches!(route, Ok(Route::Here(_))) {
                    continue;
                }
                unreachable_answer(err, &peer)
            }
        };
        if response.status() == StatusCode::CREATED && is_acquire(&parts) {
            return confirm_grant(locks, &peer, &parts, &body, response).await;
        }
        if response.status() != StatusCode::MISDIRECTED_REQUEST {
            return response;
        }
        // The peer is not the authority (any more): look it up afresh.
        locks.forget_authority(&id);
        if attempt == ATTEMPTS {
            return moving(response, false);
        }
        route = locks.route(&id, false, with_row).await;
    }
    unreachable!("every attempt returns or continues")
}

/// A pool's requests go by the pools' lock handle, a state_id's by the locks'.
fn lock_manager<'a>(ctx: &'a AppContext, parts: &Parts) -> &'a LockManager {
    if parts.uri.path().starts_with("/v1/pools/") {
        &ctx.pools
    } else {
        &ctx.locks
    }
}

/// A lease operation, on a state_id or a pool.
fn is_lock_path(parts: &Parts) -> bool {
    let path = parts.uri.path();
    path.starts_with("/v1/locks/") || path.starts_with("/v1/pools/")
}

fn is_acquire(parts: &Parts) -> bool {
    parts.method == Method::POST && is_lock_path(parts)
}

/// The authority grants a forwarded acquire for a few seconds only
/// (`locks::UNCONFIRMED_GRANT`); the grant has reached this gateway, so it renews the
/// lease to the TTL its client asked for and answers with that. A client
/// gone meanwhile (its future dropped here) leaves a lease that ends soon.
async fn confirm_grant(
    locks: &LockManager,
    peer: &Peer,
    acquire: &Parts,
    acquire_body: &Bytes,
    granted: Response,
) -> Response {
    let Some(lease_id) = lease_id_of(granted).await else {
        return ApiError::AuthorityMoving.into_response();
    };
    let ttl = serde_json::from_slice::<serde_json::Value>(acquire_body)
        .ok()
        .and_then(|body| body.get("ttl_seconds").cloned())
        .filter(|ttl| !ttl.is_null());
    let mut renew = acquire.clone();
    renew.method = Method::PUT;
    let path = format!("{}/{lease_id}", acquire.uri.path());
    renew.uri = match path.parse() {
        Ok(uri) => uri,
        Err(_) => return ApiError::AuthorityMoving.into_response(),
    };
    renew.headers.remove(header::CONTENT_LENGTH);
    let body = match ttl {
        Some(ttl) => Body::from(serde_json::json!({ "ttl_seconds": ttl }).to_string()),
        None => Body::empty(),
    };
    let confirmed = send(
        locks,
        peer,
        Request::from_parts(renew, body),
        FORWARD_DEADLINE,
    )
    .await;
    match confirmed.status() {
        StatusCode::OK => {
            let (mut parts, body) = confirmed.into_parts();
            parts.status = StatusCode::CREATED;
            Response::from_parts(parts, body)
        }
        // The grant ended before it was confirmed (the hop was too slow), or
        // the authority moved meanwhile.
        StatusCode::CONFLICT | StatusCode::MISDIRECTED_REQUEST => {
            ApiError::AuthorityMoving.into_response()
        }
        _ => confirmed,
    }
}

async fn lease_id_of(granted: Response) -> Option<String> {
    let bytes = axum::body::to_bytes(granted.into_body(), LOCK_BODY_LIMIT)
        .await
        .ok()?;
    let body: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let lease_id = body.get("lease_id")?.as_str()?;
    uuid::Uuid::parse_str(lease_id)
        .ok()
        .map(|id| id.to_string())
}

/// A 421 goes back to the gateway that forwarded the request; a client gets
/// a 503 to retry shortly instead, since the authority is moving.
fn moving(response: Response, forwarded: bool) -> Response {
    if forwarded {
        return response;
    }
    ApiError::AuthorityMoving.into_response()
}

async fn send(locks: &LockManager, peer: &Peer, request: Request, deadline: Duration) -> Response {
    match locks.forward(peer, request, deadline).await {
        Ok(response) => response,
        Err(err) => unreachable_answer(err, peer),
    }
}

/// The 503 for an authority that did not answer, with when to come back.
fn unreachable_answer(err: ForwardError, peer: &Peer) -> Response {
    let mut response = ApiError::AuthorityUnreachable(err).into_response();
    retry_after(&mut response, peer.lapses_in());
    response
}

/// The loop guard's answer: the forwarding gateway looks the authority up afresh.
fn misdirected(peer: &Peer) -> Response {
    let mut response = ApiError::Lock(LockError::Elsewhere(peer.clone())).into_response();
    response.extensions_mut().remove::<Misrouted>();
    response
}

fn retry_after(response: &mut Response, wait: Duration) {
    let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
}
