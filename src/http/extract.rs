//! Extractors that parse requests into domain types and turn every rejection
//! into an [`ApiError`], so no plain-text axum error ever reaches a client.

use std::collections::HashMap;

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, header};
use http_body::Body as _;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use percent_encoding::percent_decode_str;
use serde::de::DeserializeOwned;
use uuid::Uuid;

use super::context::AppContext;
use super::error::ApiError;
use super::wire::REQUEST_ID;
use crate::auth::Actor;
use crate::domain::{
    Allowed, AllowedStreams, IfMatch, PageLimit, Provenance, StateDocument, StateId,
};
use crate::locks::SeenLease;
use crate::states::WriteConditions;

/// The header that carries a lease on writes to a locked state.
pub const LEASE_ID: HeaderName = HeaderName::from_static("lease-id");

/// The streams a write lets go backwards (see `domain::bookmark_guard`).
pub const ALLOW_REGRESSION: HeaderName = HeaderName::from_static("statehouse-allow-regression");

/// The streams a write lets lose their bookmarks (see `domain::bookmark_guard`).
pub const ALLOW_LOSS: HeaderName = HeaderName::from_static("statehouse-allow-loss");

/// The `{state_id}` path segment, percent-decoded and validated.
pub struct StatePath(pub StateId);

impl<S: Send + Sync> FromRequestParts<S> for StatePath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|rejection| {
                ApiError::InvalidQuery(format!("state_id in the path: {}", rejection.body_text()))
            })?;
        Ok(Self(StateId::parse(raw)?))
    }
}

/// The id a route is about, its `{state_id}` or a pool's `{name}`, if it
/// has one and it is valid (an invalid one is the handler's 400 to give):
/// token scopes and forwarding to the id's authority go by it.
pub async fn path_id(parts: &mut Parts) -> Option<StateId> {
    let Path(params) = Path::<HashMap<String, String>>::from_request_parts(parts, &())
        .await
        .ok()?;
    let raw = params.get("state_id").or_else(|| params.get("name"))?;
    StateId::parse(raw.clone()).ok()
}

/// A page's `limit` query parameter: 1 to 1000, 100 when absent.
pub fn page_limit(raw: Option<String>) -> Result<PageLimit, ApiError> {
    let limit = raw
        .map(|raw| {
            raw.parse::<u32>()
                .map_err(|_| ApiError::InvalidQuery(format!("limit {raw:?} is not a whole number")))
        })
        .transpose()?;
    PageLimit::parse(limit).map_err(|e| ApiError::InvalidQuery(e.to_string()))
}

/// A query string deserialized into `T`; unknown or malformed parameters are a 400.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        refuse_invalid_utf8(parts.uri.query().unwrap_or_default())?;
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(value)| Self(value))
            .map_err(|rejection| ApiError::InvalidQuery(rejection.body_text()))
    }
}

/// `Query` turns bytes that are not UTF-8 (`pattern=%FF`) into U+FFFD without
/// a word: a glob or cursor changed that way would quietly mean something else.
fn refuse_invalid_utf8(query: &str) -> Result<(), ApiError> {
    for pair in query.split('&') {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let Ok(decoded_name) = percent_decode_str(name).decode_utf8() else {
            return Err(ApiError::InvalidQuery(
                "a query parameter name is not UTF-8 once percent-decoded".into(),
            ));
        };
        if percent_decode_str(value).decode_utf8().is_err() {
            return Err(ApiError::InvalidQuery(format!(
                "query parameter {decoded_name:?} is not UTF-8 once percent-decoded"
            )));
        }
    }
    Ok(())
}

/// Lock requests are a few small fields (an owner is at most 256 bytes). Lock
/// acquires count against --max-lock-waiters, not --max-concurrent-requests,
/// so their bodies get a small limit of their own to keep the memory that
/// request bodies can take bounded by the request limit.
pub const LOCK_BODY_LIMIT: usize = 64 * 1024;

/// Reads a whole request body under the gateway's body limit, keeping the
/// request's parts (a batch's refusals are logged with them).
pub async fn read_request(request: Request, ctx: &AppContext) -> Result<(Parts, Bytes), ApiError> {
    let (parts, body) = request.into_parts();
    let bytes = read_body(
        Request::from_parts(parts.clone(), body),
        ctx,
        ctx.body_limit,
    )
    .await?;
    Ok((parts, bytes))
}

/// Reads a whole body of at most `limit` bytes. The body read timeout is a
/// deadline for all of it, not per chunk, so a client trickling a byte at a
/// time cannot hold a request (and its place under the request limit) open.
pub async fn read_body(
    request: Request,
    ctx: &AppContext,
    limit: usize,
) -> Result<Bytes, ApiError> {
    let mut body = Limited::new(request.into_body(), limit);
    // Sized up front from Content-Length (at most the limit) and filled frame
    // by frame, so a large body is held once, not as its frames plus a copy.
    let expected = usize::try_from(body.size_hint().lower()).unwrap_or(limit);
    let mut bytes = Vec::with_capacity(expected.min(limit));
    let read = async {
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame?.into_data() {
                bytes.extend_from_slice(&data);
            }
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    };
    match tokio::time::timeout(ctx.body_read_timeout, read).await {
        Ok(Ok(())) => Ok(Bytes::from(bytes)),
        Ok(Err(err)) if err.is::<LengthLimitError>() => Err(ApiError::PayloadTooLarge(limit)),
        Ok(Err(err)) => Err(ApiError::InvalidJson(format!(
            "could not read the request body: {err}"
        ))),
        Err(_) => Err(ApiError::BodyTimeout(ctx.body_read_timeout)),
    }
}

/// A request body holding a state document, within the body limit.
pub struct StateBody(pub StateDocument);

impl FromRequest<AppContext> for StateBody {
    type Rejection = ApiError;

    async fn from_request(request: Request, ctx: &AppContext) -> Result<Self, ApiError> {
        let bytes = read_body(request, ctx, ctx.body_limit).await?;
        Ok(Self(StateDocument::from_request(&bytes)?))
    }
}

/// A write's `If-Match` and `Lease-Id` headers.
impl<S: Send + Sync> FromRequestParts<S> for WriteConditions {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        let if_match =
            match parts.headers.get(header::IF_MATCH) {
                None => None,
                Some(value) => Some(value.to_str().ok().and_then(IfMatch::parse).ok_or_else(
                    || {
                        ApiError::InvalidHeader(
                            "If-Match must be \"*\" or a list of quoted entity tags".into(),
                        )
                    },
                )?),
            };
        let lease_id = match parts.headers.get(LEASE_ID) {
            None => None,
            Some(value) => Some(
                value
                    .to_str()
                    .ok()
                    .and_then(|v| Uuid::parse_str(v.trim()).ok())
                    .ok_or_else(|| {
                        ApiError::InvalidHeader("Lease-Id must be a lease_id (a UUID)".into())
                    })?,
            ),
        };
        let allowed = allowed_streams(&parts.headers)?;
        Ok(Self {
            if_match,
            lease_id,
            seen_lease: parts.extensions.get::<SeenLease>().cloned(),
            allowed,
        })
    }
}

/// The request's `Statehouse-Allow-Regression` and `Statehouse-Allow-Loss`:
/// none when absent.
pub fn allowed_streams(headers: &HeaderMap) -> Result<Allowed, ApiError> {
    let allowed = |name: &HeaderName, title: &str| match headers.get(name) {
        None => Ok(AllowedStreams::None),
        Some(value) => value.to_str().map(AllowedStreams::parse).map_err(|_| {
            ApiError::InvalidHeader(format!(
                "{title} must be stream names, comma-separated, or *"
            ))
        }),
    };
    Ok(Allowed {
        regressions: allowed(&ALLOW_REGRESSION, "Statehouse-Allow-Regression")?,
        losses: allowed(&ALLOW_LOSS, "Statehouse-Allow-Loss")?,
    })
}

/// Longest request id or User-Agent history keeps, in bytes.
const MAX_PROVENANCE_TEXT: usize = 1024;

/// Who a change came from: the actor the auth guard found, the request id
/// and the User-Agent.
impl<S: Send + Sync> FromRequestParts<S> for Provenance {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        let text = |name: HeaderName| {
            parts.headers.get(name).map_or_else(String::new, |value| {
                let text = String::from_utf8_lossy(value.as_bytes());
                let mut end = text.len().min(MAX_PROVENANCE_TEXT);
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                text[..end].to_owned()
            })
        };
        Ok(Self {
            actor: parts
                .extensions
                .get::<Actor>()
                .cloned()
                .unwrap_or_else(Actor::anonymous)
                .0,
            request_id: text(REQUEST_ID),
            user_agent: text(header::USER_AGENT),
            reason: String::new(),
        })
    }
}

/// The `{lease_id}` path segment of `/v1/locks/{state_id}/{lease_id}`.
pub struct LeasePath(pub StateId, pub Uuid);

impl<S: Send + Sync> FromRequestParts<S> for LeasePath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Path((raw_id, raw_lease)) = Path::<(String, String)>::from_request_parts(parts, state)
            .await
            .map_err(|rejection| {
                ApiError::InvalidQuery(format!("path: {}", rejection.body_text()))
            })?;
        let lease = Uuid::parse_str(&raw_lease)
            .map_err(|_| ApiError::InvalidQuery(format!("lease_id {raw_lease:?} is not a UUID")))?;
        Ok(Self(StateId::parse(raw_id)?, lease))
    }
}

/// A lock request's optional JSON body: absent or empty means `T::default()`.
pub struct OptionalJson<T>(pub T);

impl<T: DeserializeOwned + Default> FromRequest<AppContext> for OptionalJson<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, ctx: &AppContext) -> Result<Self, ApiError> {
        let bytes = read_body(request, ctx, LOCK_BODY_LIMIT.min(ctx.body_limit)).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self(T::default()));
        }
        serde_json::from_slice(&bytes)
            .map(Self)
            .map_err(|e| match e.classify() {
                serde_json::error::Category::Data => ApiError::InvalidBody(e.to_string()),
                _ => ApiError::InvalidJson(format!("body is not valid JSON: {e}")),
            })
    }
}
