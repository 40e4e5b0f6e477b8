//! Sends a state_id's lock operations and lock-checked writes to the gateway
//! that is the id's authority (see `locks::forward`), so that a client never
//! needs to know which gateway granted its lease.

use std::time::{Duration, Instant};

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

/// Every client request is answered within its acquire's wait and this,
/// whatever a peer does (design.md, "Several gateways").
const ANSWER_SLACK: Duration = Duration::from_secs(5);

/// What a forward leaves of the answer's time, for the answer itself.
const ANSWER_MARGIN: Duration = Duration::from_millis(500);

/// How long past an acquire's wait a peer that answers its probes is waited
/// for: it is alive, and its answer (a write's outcome above all) is worth
/// more than a 503 that cannot say whether the write will land.
const PATIENCE: Duration = Duration::from_secs(30);

/// How many gateways a request is tried at before its client is told to
/// retry: the authority can move while a request looks for it.
const ATTEMPTS: usize = 3;

/// Refuses, acting on nothing, a request forwarded to another gateway that
/// reached this one (see `locks::FORWARDED_TO`): an authority's lock
/// operations, its writes and its tickets are its own.
pub async fn meant_here(State(ctx): State<AppContext>, request: Request, next: Next) -> Response {
    if let Some(asked) = ctx.locks.meant_for_another(request.headers()) {
        let me = ctx.locks.gateway_id();
        return ApiError::NotThisGateway { asked, me }.into_response();
    }
    next.run(request).await
}

/// Serves the request here when this gateway is the id's authority (or
/// nobody is), else forwards it to the authority; an acquire that finds the
/// authority only by losing the claim to it is forwarded then. A request
/// that was itself forwarded is never forwarded again. A peer that leaves a
/// forward unanswered past its claim is passed over, and the request is
/// answered within its wait and [`ANSWER_SLACK`] whatever the peer does.
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
    let mut body = match read_body(Request::from_parts(parts.clone(), body), &ctx, limit).await {
        Ok(body) => body,
        Err(err) => return err.into_response(),
    };
    let wait = if is_acquire(&parts) {
        wait_of(&body)
    } else {
        Duration::ZERO
    };
    let wait_until = Instant::now() + wait;
    let answer_by = wait_until + ANSWER_SLACK;
    // The loop guard's side trusts no remembered authority: it answers 421
    // only when ClickHouse names another gateway.
    // A write's routing read brings the current row along: one statement
    // where it is served here, instead of a second read under its lock.
    let with_row = parts.uri.path().starts_with("/v1/states/");
    let mut route = locks.route(&id, !forwarded, with_row).await;
    for attempt in 1..=ATTEMPTS {
        // A request tried again waits only what is left of its client's wait.
        if attempt > 1 && !wait.is_zero() {
            body = with_wait(&body, wait_until.saturating_duration_since(Instant::now()));
            parts
                .headers
                .insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        }
        let rebuild = |parts: &Parts| Request::from_parts(parts.clone(), Body::from(body.clone()));
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
        let answer_within = answer_by.saturating_duration_since(Instant::now() + ANSWER_MARGIN);
        let patience = wait_until.saturating_duration_since(Instant::now()) + PATIENCE;
        let forwarding = locks.forward(&peer, rebuild(&parts), answer_within, patience);
        let response = match forwarding.await {
            Ok(response) => response,
            Err(err) => {
                // A peer that left the request unanswered past its claim is
                // passed over (a lapsed holder asked first among them):
                // looked up afresh, the id is served here or by a new
                // authority, within what is left of the answer's time.
                route = locks.route(&id, false, with_row).await;
                let moved = match &route {
                    Ok(Route::Here(_)) => true,
                    Ok(Route::Peer(next)) => next.gateway_id != peer.gateway_id,
                    Err(_) => false,
                };
                if moved && attempt < ATTEMPTS && Instant::now() + ANSWER_MARGIN < answer_by {
                    continue;
                }
                unreachable_answer(err, &peer)
            }
        };
        if response.status() == StatusCode::CREATED && is_acquire(&parts) {
            return confirm_grant(locks, &peer, &parts, &body, response, answer_by).await;
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

/// An acquire's `wait_seconds`, as its handler reads it; a body it refuses
/// waits nothing.
fn wait_of(body: &Bytes) -> Duration {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|body| body.get("wait_seconds")?.as_f64())
        .and_then(|seconds| Duration::try_from_secs_f64(seconds.min(MAX_WAIT_SECONDS)).ok())
        .unwrap_or(Duration::ZERO)
}

/// The acquire `body` with its `wait_seconds` cut to `left`, in whole
/// milliseconds.
fn with_wait(body: &Bytes, left: Duration) -> Bytes {
    let Ok(serde_json::Value::Object(mut fields)) = serde_json::from_slice(body) else {
        return body.clone();
    };
    let seconds = left.as_millis() as f64 / 1000.0;
    fields.insert("wait_seconds".into(), seconds.into());
    Bytes::from(serde_json::Value::Object(fields).to_string())
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
    answer_by: Instant,
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
        answer_by.saturating_duration_since(Instant::now()),
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
    match locks.forward(peer, request, deadline, PATIENCE).await {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_acquire_tried_again_waits_what_is_left_of_its_wait() {
        let body = Bytes::from(r#"{"owner":"w","wait_seconds":30,"ttl_seconds":6}"#);
        assert_eq!(wait_of(&body), Duration::from_secs(30));
        let left = with_wait(&body, Duration::from_millis(12_345));
        let fields: serde_json::Value = serde_json::from_slice(&left).unwrap();
        assert_eq!(fields["wait_seconds"], 12.345);
        assert_eq!(fields["owner"], "w");
        assert_eq!(fields["ttl_seconds"], 6);
    }

    #[test]
    fn a_body_the_handler_refuses_waits_nothing_and_is_sent_as_it_came() {
        for raw in [
            &b"not json"[..],
            br#"{"wait_seconds":"long"}"#,
            br#"{"wait_seconds":-1}"#,
        ] {
            assert_eq!(wait_of(&Bytes::from_static(raw)), Duration::ZERO);
        }
        let bad = Bytes::from_static(b"[1,2]");
        assert_eq!(with_wait(&bad, Duration::from_secs(1)), bad);
        assert_eq!(
            wait_of(&Bytes::from_static(br#"{"wait_seconds":1e9}"#)),
            Duration::from_secs_f64(MAX_WAIT_SECONDS)
        );
    }
}
