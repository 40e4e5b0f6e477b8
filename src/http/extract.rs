//! Extractors that parse requests into domain types and turn every rejection
//! into an [`ApiError`], so no plain-text axum error ever reaches a client.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use super::error::ApiError;
use crate::AppContext;
use crate::domain::{StateDocument, StateId};
use crate::states::IfMatch;

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

/// A query string deserialized into `T`; unknown or malformed parameters are a 400.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(value)| Self(value))
            .map_err(|rejection| ApiError::InvalidQuery(rejection.body_text()))
    }
}

/// A request body holding a state document, within the body limit.
pub struct StateBody(pub StateDocument);

impl FromRequest<AppContext> for StateBody {
    type Rejection = ApiError;

    async fn from_request(request: Request, ctx: &AppContext) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(request, ctx)
            .await
            .map_err(|rejection| body_rejection(rejection, ctx.body_limit))?;
        Ok(Self(StateDocument::from_request(&bytes)?))
    }
}

fn body_rejection(rejection: BytesRejection, limit: usize) -> ApiError {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::PayloadTooLarge(limit)
    } else {
        ApiError::InvalidJson(format!(
            "could not read the request body: {}",
            rejection.body_text()
        ))
    }
}

/// The optional `If-Match` header.
pub struct IfMatchHeader(pub Option<IfMatch>);

impl<S: Send + Sync> FromRequestParts<S> for IfMatchHeader {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        let Some(value) = parts.headers.get(axum::http::header::IF_MATCH) else {
            return Ok(Self(None));
        };
        value
            .to_str()
            .ok()
            .and_then(IfMatch::parse)
            .map(|precondition| Self(Some(precondition)))
            .ok_or_else(|| {
                ApiError::InvalidHeader(
                    "If-Match must be \"*\" or a list of quoted entity tags".into(),
                )
            })
    }
}
