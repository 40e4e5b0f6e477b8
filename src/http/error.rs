//! Every error leaves as RFC 9457 problem+json with a stable `type`.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use super::locks::LockView;
use crate::domain::{DocumentError, StateIdError};
use crate::locks::{ForwardError, LockError, Peer};
use crate::states::StateError;
use crate::store::StoreError;
use crate::telemetry::ClientText;

pub const PROBLEM_JSON: &str = "application/problem+json";

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    InvalidStateId(#[from] StateIdError),
    #[error("{0}")]
    InvalidJson(String),
    #[error("{0}")]
    InvalidDocument(String),
    #[error("{0}")]
    InvalidQuery(String),
    #[error("{0}")]
    InvalidHeader(String),
    #[error("no state with id {0:?}")]
    StateNotFound(String),
    #[error("{0}")]
    PreconditionFailed(&'static str),
    #[error("request body is larger than the limit of {0} bytes")]
    PayloadTooLarge(usize),
    #[error("the request body did not arrive within {0:?} (--body-read-timeout)")]
    BodyTimeout(std::time::Duration),
    #[error("ClickHouse is unavailable: {0}")]
    ClickHouseUnavailable(StoreError),
    #[error("{0}")]
    CorruptState(StoreError),
    #[error("{0}")]
    InvalidBody(String),
    #[error("no lease is held on {0:?}")]
    LockNotFound(String),
    #[error(transparent)]
    Lock(LockError),
    #[error("the gateway holding this state_id's claim cannot be reached: {0}")]
    AuthorityUnreachable(ForwardError),
    #[error("the claim on this state_id is moving between gateways; retry shortly")]
    AuthorityMoving,
}

/// The problem types; their slugs are part of the API and never change.
#[derive(Clone, Copy, Debug)]
pub enum ProblemType {
    InvalidStateId,
    InvalidJson,
    InvalidStateDocument,
    InvalidQuery,
    InvalidHeader,
    NotFound,
    StateNotFound,
    MethodNotAllowed,
    PreconditionFailed,
    PayloadTooLarge,
    BodyTimeout,
    ClickHouseUnavailable,
    Overloaded,
    CorruptState,
    InvalidBody,
    LockNotFound,
    LockHeld,
    LeaseNotCurrent,
    LeaseHeldElsewhere,
    StateLocked,
    Misdirected,
    AuthorityUnreachable,
    Unauthorized,
    Forbidden,
    Internal,
    Other,
}

impl ProblemType {
    fn slug(self) -> &'static str {
        match self {
            Self::InvalidStateId => "invalid-state-id",
            Self::InvalidJson => "invalid-json",
            Self::InvalidStateDocument => "invalid-state-document",
            Self::InvalidQuery => "invalid-query",
            Self::InvalidHeader => "invalid-header",
            Self::NotFound => "not-found",
            Self::StateNotFound => "state-not-found",
            Self::MethodNotAllowed => "method-not-allowed",
            Self::PreconditionFailed => "precondition-failed",
            Self::PayloadTooLarge => "payload-too-large",
            Self::BodyTimeout => "body-timeout",
            Self::ClickHouseUnavailable => "clickhouse-unavailable",
            Self::Overloaded => "overloaded",
            Self::CorruptState => "corrupt-state",
            Self::InvalidBody => "invalid-body",
            Self::LockNotFound => "lock-not-found",
            Self::LockHeld => "lock-held",
            Self::LeaseNotCurrent => "lease-not-current",
            Self::LeaseHeldElsewhere => "lease-held-elsewhere",
            Self::StateLocked => "state-locked",
            Self::Misdirected => "misdirected",
            Self::AuthorityUnreachable => "authority-unreachable",
            Self::Unauthorized => "unauthorized",
            Self::Forbidden => "forbidden",
            Self::Internal => "internal",
            Self::Other => "http-error",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Self::InvalidStateId => "Invalid state id",
            Self::InvalidJson => "Invalid JSON",
            Self::InvalidStateDocument => "Invalid state document",
            Self::InvalidQuery => "Invalid query string",
            Self::InvalidHeader => "Invalid header",
            Self::NotFound => "Not found",
            Self::StateNotFound => "State not found",
            Self::MethodNotAllowed => "Method not allowed",
            Self::PreconditionFailed => "Precondition failed",
            Self::PayloadTooLarge => "Payload too large",
            Self::BodyTimeout => "Request body too slow",
            Self::ClickHouseUnavailable => "ClickHouse unavailable",
            Self::Overloaded => "Gateway overloaded",
            Self::CorruptState => "Stored state is unreadable",
            Self::InvalidBody => "Invalid request body",
            Self::LockNotFound => "No lock held",
            Self::LockHeld => "Lock held by another owner",
            Self::LeaseNotCurrent => "Lease is not current",
            Self::LeaseHeldElsewhere => "Lease is held through another gateway",
            Self::StateLocked => "State is locked",
            Self::Misdirected => "Another gateway is the authority",
            Self::AuthorityUnreachable => "Authority unreachable",
            Self::Unauthorized => "Unauthorized",
            Self::Forbidden => "Forbidden",
            Self::Internal => "Internal error",
            Self::Other => "HTTP error",
        }
    }

    /// The problem type for a bare status some layer produced without one.
    pub fn for_status(status: StatusCode) -> Self {
        match status {
            StatusCode::NOT_FOUND => Self::NotFound,
            StatusCode::METHOD_NOT_ALLOWED => Self::MethodNotAllowed,
            StatusCode::PAYLOAD_TOO_LARGE => Self::PayloadTooLarge,
            StatusCode::BAD_REQUEST => Self::InvalidQuery,
            StatusCode::INTERNAL_SERVER_ERROR => Self::Internal,
            _ => Self::Other,
        }
    }
}

#[derive(Serialize)]
struct ProblemBody<'a> {
    #[serde(rename = "type")]
    kind: String,
    title: &'a str,
    status: u16,
    detail: &'a str,
    /// Lock conflicts say who holds the lock (null when nobody can be named).
    #[serde(skip_serializing_if = "Option::is_none")]
    holder: Option<Option<LockView>>,
}

/// Builds a problem+json response.
pub fn problem(status: StatusCode, kind: ProblemType, detail: &str) -> Response {
    problem_with_holder(status, kind, detail, None)
}

fn problem_with_holder(
    status: StatusCode,
    kind: ProblemType,
    detail: &str,
    holder: Option<Option<LockView>>,
) -> Response {
    let body = ProblemBody {
        kind: format!("urn:statehouse:problem:{}", kind.slug()),
        title: kind.title(),
        status: status.as_u16(),
        detail,
        holder,
    };
    let mut response = (status, Json(body)).into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    response
}

impl ApiError {
    fn status_and_type(&self) -> (StatusCode, ProblemType) {
        match self {
            Self::InvalidStateId(_) => (StatusCode::BAD_REQUEST, ProblemType::InvalidStateId),
            Self::InvalidJson(_) => (StatusCode::BAD_REQUEST, ProblemType::InvalidJson),
            Self::InvalidDocument(_) => {
                (StatusCode::BAD_REQUEST, ProblemType::InvalidStateDocument)
            }
            Self::InvalidQuery(_) => (StatusCode::BAD_REQUEST, ProblemType::InvalidQuery),
            Self::InvalidHeader(_) => (StatusCode::BAD_REQUEST, ProblemType::InvalidHeader),
            Self::StateNotFound(_) => (StatusCode::NOT_FOUND, ProblemType::StateNotFound),
            Self::PreconditionFailed(_) => (
                StatusCode::PRECONDITION_FAILED,
                ProblemType::PreconditionFailed,
            ),
            Self::PayloadTooLarge(_) => {
                (StatusCode::PAYLOAD_TOO_LARGE, ProblemType::PayloadTooLarge)
            }
            Self::BodyTimeout(_) => (StatusCode::REQUEST_TIMEOUT, ProblemType::BodyTimeout),
            Self::ClickHouseUnavailable(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                ProblemType::ClickHouseUnavailable,
            ),
            // The data came from another writer; the gateway relays it faithfully or not at all.
            Self::CorruptState(_) => (StatusCode::BAD_GATEWAY, ProblemType::CorruptState),
            Self::InvalidBody(_) => (StatusCode::BAD_REQUEST, ProblemType::InvalidBody),
            Self::LockNotFound(_) => (StatusCode::NOT_FOUND, ProblemType::LockNotFound),
            Self::Lock(LockError::Held { .. }) => (StatusCode::CONFLICT, ProblemType::LockHeld),
            Self::Lock(LockError::NotCurrent(_)) => {
                (StatusCode::CONFLICT, ProblemType::LeaseNotCurrent)
            }
            Self::Lock(LockError::HeldElsewhere { .. }) => {
                (StatusCode::CONFLICT, ProblemType::LeaseHeldElsewhere)
            }
            Self::Lock(LockError::Locked { .. }) => {
                (StatusCode::CONFLICT, ProblemType::StateLocked)
            }
            Self::Lock(LockError::Elsewhere(_)) => {
                (StatusCode::MISDIRECTED_REQUEST, ProblemType::Misdirected)
            }
            Self::Lock(LockError::Store(_)) => (
                StatusCode::SERVICE_UNAVAILABLE,
                ProblemType::ClickHouseUnavailable,
            ),
            Self::AuthorityUnreachable(_) | Self::AuthorityMoving => (
                StatusCode::SERVICE_UNAVAILABLE,
                ProblemType::AuthorityUnreachable,
            ),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, kind) = self.status_and_type();
        if status.is_server_error() {
            // ClickHouse's own error text may quote what the client sent.
            let error = self.to_string();
            tracing::error!(error = %ClientText(&error), problem = kind.slug(), "request failed");
        }
        let holder = match &self {
            Self::Lock(LockError::Held { holder, .. }) => {
                Some(holder.as_deref().map(LockView::from))
            }
            Self::Lock(LockError::Locked { holder, .. }) => {
                Some(Some(LockView::from(holder.as_ref())))
            }
            _ => None,
        };
        let mut response = problem_with_holder(status, kind, &self.to_string(), holder);
        if let Self::BodyTimeout(_) = self {
            // The rest of the body may still be trickling in; only closing
            // the connection frees it.
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if let Self::Lock(LockError::Elsewhere(peer)) = self {
            // For the forwarding layer, which sends the request on to `peer`.
            response.extensions_mut().insert(Misrouted(peer));
        }
        response
    }
}

/// Marks a response whose request belongs to another gateway.
#[derive(Clone, Debug)]
pub struct Misrouted(pub Peer);

impl From<StoreError> for ApiError {
    fn from(err: StoreError) -> Self {
        match err {
            StoreError::Corrupt { .. } => Self::CorruptState(err),
            other => Self::ClickHouseUnavailable(other),
        }
    }
}

impl From<StateError> for ApiError {
    fn from(err: StateError) -> Self {
        match err {
            StateError::Store(store) => store.into(),
            StateError::PreconditionFailed(why) => Self::PreconditionFailed(why),
            StateError::Lock(lock) => lock.into(),
        }
    }
}

impl From<LockError> for ApiError {
    fn from(err: LockError) -> Self {
        match err {
            LockError::Store(store) => store.into(),
            other => Self::Lock(other),
        }
    }
}

impl From<DocumentError> for ApiError {
    fn from(err: DocumentError) -> Self {
        match err {
            DocumentError::InvalidJson(_) => Self::InvalidJson(err.to_string()),
            DocumentError::NotAState(_) => Self::InvalidDocument(err.to_string()),
        }
    }
}
