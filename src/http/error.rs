//! Every error leaves as RFC 9457 problem+json with a stable `type`.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use uuid::Uuid;

use super::lock_view::LockView;
use super::pool_view::PoolView;
use super::wire::rfc3339_millis;
use crate::domain::{DocumentError, Loss, Regression, StateIdError};
use crate::locks::{ForwardError, GATEWAY_ID, LockError, Peer, uuid_header};
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
    InvalidVersion(String),
    #[error("{0}")]
    VersionNotFound(String),
    #[error("{0}")]
    HistoryOff(String),
    #[error("{0}")]
    BookmarkNotFound(String),
    /// One entry of a batch refused the whole batch.
    #[error("entry {index} (state_id {state_id:?}): {inner}")]
    InBatch {
        index: usize,
        state_id: String,
        inner: Box<ApiError>,
    },
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
    /// A forwarded request reached a gateway other than the one it was
    /// sent to: one now answers at the address the claim names.
    #[error("this is gateway {me}, not gateway {asked} that the request was forwarded to")]
    NotThisGateway { asked: Uuid, me: Uuid },
    #[error("{0}")]
    BookmarkRegression(String, Vec<Regression>),
    #[error("{0}")]
    BookmarkLoss(String, Vec<Loss>),
    /// No slot of the pool within the acquire's wait: who holds it.
    #[error("pool {name:?} is full ({} of {} slots held)", .view.used(), .view.limit())]
    PoolFull {
        name: String,
        view: Box<PoolView>,
        /// When a place comes free, when lock-delays keep them all.
        free_at_ms: Option<i64>,
    },
    #[error("nobody holds or waits on pool {0:?}")]
    PoolNotFound(String),
    /// The state_id is outside the token's scope.
    #[error("this token's scope ({0}) does not cover this state_id")]
    OutOfScope(String),
    /// A change feed cursor older than `--watch-retention`.
    #[error("{0}")]
    CursorExpired(String),
    /// An `at=` older than the history retention keeps: the oldest to ask.
    #[error("{0}")]
    HistoryExpired(String, i64),
    /// A write ClickHouse refused, each time it was decided, because
    /// another writer had changed the state meanwhile.
    #[error("{0}")]
    StateContended(String),
    #[error("no run with id {0:?}")]
    RunNotFound(String),
    #[error("the lease is not the state_id's current one")]
    RunLeaseNotCurrent,
    /// One lease holds at most one run: this one.
    #[error("this lease already holds run {0}")]
    RunExists(uuid::Uuid),
    #[error("run {0} has ended")]
    RunEnded(uuid::Uuid),
    /// A JWT past its `exp` by more than its issuer's leeway.
    #[error("the token has expired (its exp is past by more than the leeway); get a new one")]
    TokenExpired,
    /// A JWT that does not verify: why, never quoting it.
    #[error("{0}")]
    TokenInvalid(String),
    #[error("{0}")]
    WrongAudience(String),
    #[error("the token's issuer (iss) is none this gateway trusts")]
    UnknownIssuer,
    /// A valid JWT that no binding of its issuer takes.
    #[error("{0}")]
    NoBinding(String),
    /// The token's issuer has not given its keys yet: come back after this long.
    #[error(
        "the keys of the token's issuer have not been fetched yet (is it reachable?); retry later"
    )]
    IssuerUnavailable(std::time::Duration),
}

/// The one table of problem types: each with its status, its slug (part of
/// the API, never changed) and its title. Adding one touches this table and
/// the `ApiError` variant that maps to it.
macro_rules! problem_types {
    ($($kind:ident => $status:ident, $slug:literal, $title:literal;)*) => {
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum ProblemType {
            $($kind,)*
        }

        impl ProblemType {
            fn spec(self) -> (StatusCode, &'static str, &'static str) {
                match self {
                    $(Self::$kind => (StatusCode::$status, $slug, $title),)*
                }
            }
        }
    };
}

problem_types! {
    InvalidStateId => BAD_REQUEST, "invalid-state-id", "Invalid state id";
    InvalidJson => BAD_REQUEST, "invalid-json", "Invalid JSON";
    InvalidStateDocument => BAD_REQUEST, "invalid-state-document", "Invalid state document";
    InvalidQuery => BAD_REQUEST, "invalid-query", "Invalid query string";
    InvalidHeader => BAD_REQUEST, "invalid-header", "Invalid header";
    InvalidBody => BAD_REQUEST, "invalid-body", "Invalid request body";
    InvalidVersion => BAD_REQUEST, "invalid-version", "Invalid version";
    Unauthorized => UNAUTHORIZED, "unauthorized", "Unauthorized";
    TokenExpired => UNAUTHORIZED, "token-expired", "Token expired";
    TokenInvalid => UNAUTHORIZED, "token-invalid", "Token invalid";
    WrongAudience => UNAUTHORIZED, "wrong-audience", "Token meant for another audience";
    UnknownIssuer => UNAUTHORIZED, "unknown-issuer", "Unknown token issuer";
    NoBinding => FORBIDDEN, "no-binding", "No binding takes the token";
    Forbidden => FORBIDDEN, "forbidden", "Forbidden";
    OutOfScope => FORBIDDEN, "out-of-scope", "Outside the token's scope";
    CrossOrigin => FORBIDDEN, "cross-origin", "Cross-origin change refused";
    NotFound => NOT_FOUND, "not-found", "Not found";
    StateNotFound => NOT_FOUND, "state-not-found", "State not found";
    LockNotFound => NOT_FOUND, "lock-not-found", "No lock held";
    PoolNotFound => NOT_FOUND, "pool-not-found", "No such pool";
    VersionNotFound => NOT_FOUND, "version-not-found", "No such version";
    BookmarkNotFound => NOT_FOUND, "bookmark-not-found", "No such bookmark";
    RunNotFound => NOT_FOUND, "run-not-found", "No such run";
    HistoryOff => NOT_FOUND, "history-off", "History is off";
    CursorExpired => GONE, "cursor-expired", "Cursor expired";
    HistoryExpired => GONE, "history-expired", "Instant older than history keeps";
    MethodNotAllowed => METHOD_NOT_ALLOWED, "method-not-allowed", "Method not allowed";
    BodyTimeout => REQUEST_TIMEOUT, "body-timeout", "Request body too slow";
    LockHeld => CONFLICT, "lock-held", "Lock held by another owner";
    LockDelay => CONFLICT, "lock-delay", "Lock in its lock-delay";
    PoolFull => CONFLICT, "pool-full", "Pool full";
    PoolLimitMismatch => CONFLICT, "pool-limit-mismatch", "Pool in use with another limit";
    LeaseNotCurrent => CONFLICT, "lease-not-current", "Lease is not current";
    LeaseHeldElsewhere => CONFLICT, "lease-held-elsewhere", "Lease is held through another gateway";
    StateLocked => CONFLICT, "state-locked", "State is locked";
    RunExists => CONFLICT, "run-exists", "The lease holds a run";
    RunEnded => CONFLICT, "run-ended", "Run ended";
    BookmarkRegression => CONFLICT, "bookmark-regression", "Bookmark goes backwards";
    BookmarkLoss => CONFLICT, "bookmark-loss", "Bookmark lost";
    TooManyRequests => TOO_MANY_REQUESTS, "too-many-requests", "Over the token's share";
    PreconditionFailed => PRECONDITION_FAILED, "precondition-failed", "Precondition failed";
    PayloadTooLarge => PAYLOAD_TOO_LARGE, "payload-too-large", "Payload too large";
    Misdirected => MISDIRECTED_REQUEST, "misdirected", "Another gateway is the authority";
    UnknownHost => MISDIRECTED_REQUEST, "unknown-host", "Host not served";
    Internal => INTERNAL_SERVER_ERROR, "internal", "Internal error";
    // The data came from another writer; the gateway relays it faithfully or not at all.
    CorruptState => BAD_GATEWAY, "corrupt-state", "Stored state is unreadable";
    ClickHouseUnavailable => SERVICE_UNAVAILABLE, "clickhouse-unavailable", "ClickHouse unavailable";
    Overloaded => SERVICE_UNAVAILABLE, "overloaded", "Gateway overloaded";
    AuthorityUnreachable => SERVICE_UNAVAILABLE, "authority-unreachable", "Authority unreachable";
    StateContended => SERVICE_UNAVAILABLE, "state-contended", "State changed by another writer";
    IssuerUnavailable => SERVICE_UNAVAILABLE, "issuer-unavailable", "Token issuer's keys not fetched yet";
    // A status some layer answered bare, with no type of ours: it keeps its own status.
    Other => BAD_REQUEST, "http-error", "HTTP error";
}

impl ProblemType {
    fn status(self) -> StatusCode {
        self.spec().0
    }

    fn slug(self) -> &'static str {
        self.spec().1
    }

    fn title(self) -> &'static str {
        self.spec().2
    }

    /// The problem's `type` member.
    pub fn uri(self) -> String {
        format!("urn:statehouse:problem:{}", self.slug())
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
    /// A refused regression says which bookmarks went from what to what.
    #[serde(skip_serializing_if = "Option::is_none")]
    regressions: Option<&'a [Regression]>,
    /// A refused loss says which bookmarks went, and what they were.
    #[serde(skip_serializing_if = "Option::is_none")]
    losses: Option<&'a [Loss]>,
    /// A lock-delay says when the id is free again.
    #[serde(skip_serializing_if = "Option::is_none")]
    free_at: Option<String>,
    /// An expired instant says the oldest that can be asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    oldest: Option<String>,
    /// A full pool says who holds it and how many wait.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pool: Option<&'a PoolView>,
    /// A limit mismatch names the pool and its limit.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pool_limit: Option<PoolLimit<'a>>,
    /// A lease's second run names its first.
    #[serde(skip_serializing_if = "Option::is_none")]
    run_id: Option<String>,
}

#[derive(Serialize)]
struct PoolLimit<'a> {
    pool: &'a str,
    limit: usize,
}

/// Builds a problem+json response, with the problem type's status.
pub fn problem(kind: ProblemType, detail: &str) -> Response {
    problem_with(kind.status(), kind, detail, Extras::default())
}

/// A problem+json response for a bare `status` some layer answered.
pub fn bare_problem(status: StatusCode, detail: &str) -> Response {
    problem_with(
        status,
        ProblemType::for_status(status),
        detail,
        Extras::default(),
    )
}

/// The members some problems have besides the standard ones.
#[derive(Default)]
struct Extras<'a> {
    holder: Option<Option<LockView>>,
    regressions: Option<&'a [Regression]>,
    losses: Option<&'a [Loss]>,
    free_at: Option<String>,
    oldest: Option<String>,
    pool: Option<&'a PoolView>,
    pool_limit: Option<PoolLimit<'a>>,
    run_id: Option<String>,
}

fn problem_with(
    status: StatusCode,
    kind: ProblemType,
    detail: &str,
    extras: Extras<'_>,
) -> Response {
    let body = ProblemBody {
        kind: kind.uri(),
        title: kind.title(),
        status: status.as_u16(),
        detail,
        holder: extras.holder,
        regressions: extras.regressions,
        losses: extras.losses,
        free_at: extras.free_at,
        oldest: extras.oldest,
        pool: extras.pool,
        pool_limit: extras.pool_limit,
        run_id: extras.run_id,
    };
    let mut response = (status, Json(body)).into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    response
}

impl ApiError {
    fn kind(&self) -> ProblemType {
        match self {
            Self::InvalidStateId(_) => ProblemType::InvalidStateId,
            Self::InvalidJson(_) => ProblemType::InvalidJson,
            Self::InvalidDocument(_) => ProblemType::InvalidStateDocument,
            Self::InvalidQuery(_) => ProblemType::InvalidQuery,
            Self::InvalidHeader(_) => ProblemType::InvalidHeader,
            Self::InvalidVersion(_) => ProblemType::InvalidVersion,
            Self::StateNotFound(_) => ProblemType::StateNotFound,
            Self::VersionNotFound(_) => ProblemType::VersionNotFound,
            Self::HistoryOff(_) => ProblemType::HistoryOff,
            Self::BookmarkNotFound(_) => ProblemType::BookmarkNotFound,
            Self::InBatch { inner, .. } => inner.kind(),
            Self::PreconditionFailed(_) => ProblemType::PreconditionFailed,
            Self::PayloadTooLarge(_) => ProblemType::PayloadTooLarge,
            Self::BodyTimeout(_) => ProblemType::BodyTimeout,
            Self::ClickHouseUnavailable(_) | Self::Lock(LockError::Store(_)) => {
                ProblemType::ClickHouseUnavailable
            }
            Self::CorruptState(_) => ProblemType::CorruptState,
            Self::InvalidBody(_) => ProblemType::InvalidBody,
            Self::OutOfScope(_) => ProblemType::OutOfScope,
            Self::CursorExpired(_) => ProblemType::CursorExpired,
            Self::HistoryExpired(..) => ProblemType::HistoryExpired,
            Self::StateContended(_) => ProblemType::StateContended,
            Self::RunNotFound(_) => ProblemType::RunNotFound,
            Self::RunLeaseNotCurrent => ProblemType::LeaseNotCurrent,
            Self::RunExists(_) => ProblemType::RunExists,
            Self::RunEnded(_) => ProblemType::RunEnded,
            Self::TokenExpired => ProblemType::TokenExpired,
            Self::TokenInvalid(_) => ProblemType::TokenInvalid,
            Self::WrongAudience(_) => ProblemType::WrongAudience,
            Self::UnknownIssuer => ProblemType::UnknownIssuer,
            Self::NoBinding(_) => ProblemType::NoBinding,
            Self::IssuerUnavailable(_) => ProblemType::IssuerUnavailable,
            Self::LockNotFound(_) => ProblemType::LockNotFound,
            Self::PoolNotFound(_) => ProblemType::PoolNotFound,
            Self::PoolFull { .. } => ProblemType::PoolFull,
            Self::Lock(LockError::LimitMismatch { .. }) => ProblemType::PoolLimitMismatch,
            Self::BookmarkRegression(..) => ProblemType::BookmarkRegression,
            Self::BookmarkLoss(..) => ProblemType::BookmarkLoss,
            Self::Lock(LockError::Held { .. }) => ProblemType::LockHeld,
            Self::Lock(LockError::Delayed { .. }) => ProblemType::LockDelay,
            Self::Lock(LockError::NotCurrent(_)) => ProblemType::LeaseNotCurrent,
            Self::Lock(LockError::HeldElsewhere { .. }) => ProblemType::LeaseHeldElsewhere,
            Self::Lock(LockError::Locked { .. } | LockError::LockedElsewhere(_)) => {
                ProblemType::StateLocked
            }
            Self::Lock(LockError::Elsewhere(_) | LockError::NotAuthority(_))
            | Self::NotThisGateway { .. } => ProblemType::Misdirected,
            Self::AuthorityUnreachable(_)
            | Self::AuthorityMoving
            | Self::Lock(LockError::Moving(_) | LockError::Lapsed(_) | LockError::Unsettled(_)) => {
                ProblemType::AuthorityUnreachable
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = self.kind();
        let status = kind.status();
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
        // A batch's refusal carries its entry's.
        let refusal = match &self {
            Self::InBatch { inner, .. } => inner.as_ref(),
            other => other,
        };
        let regressions = match refusal {
            Self::BookmarkRegression(_, found) => Some(found.as_slice()),
            _ => None,
        };
        let losses = match refusal {
            Self::BookmarkLoss(_, found) => Some(found.as_slice()),
            _ => None,
        };
        let free_at = match &self {
            Self::Lock(LockError::Delayed { free_at_ms, .. })
            | Self::PoolFull {
                free_at_ms: Some(free_at_ms),
                ..
            } => Some(rfc3339_millis(*free_at_ms)),
            _ => None,
        };
        let oldest = match &self {
            Self::HistoryExpired(_, oldest_ms) => Some(rfc3339_millis(*oldest_ms)),
            _ => None,
        };
        let pool = match &self {
            Self::PoolFull { view, .. } => Some(view.as_ref()),
            _ => None,
        };
        let pool_limit = match &self {
            Self::Lock(LockError::LimitMismatch { state_id, limit }) => Some(PoolLimit {
                pool: state_id.as_str(),
                limit: *limit,
            }),
            _ => None,
        };
        let run_id = match &self {
            Self::RunExists(run) => Some(run.to_string()),
            _ => None,
        };
        let extras = Extras {
            holder,
            regressions,
            losses,
            free_at,
            oldest,
            pool,
            pool_limit,
            run_id,
        };
        let mut response = problem_with(status, kind, &self.to_string(), extras);
        if let Self::BodyTimeout(_) = self {
            // The rest of the body may still be trickling in; only closing
            // the connection frees it.
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if status == StatusCode::SERVICE_UNAVAILABLE {
            // Every 503 is a passing state (ClickHouse or Keeper out of
            // reach, a claim between gateways): the client is told when to
            // come back. The forwarding layer puts its own, longer wait over
            // this one when it knows when a claim lapses.
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let Self::IssuerUnavailable(wait) = self {
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(wait.as_secs_f64().ceil().max(1.0) as u64),
            );
        }
        if status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"statehouse\""),
            );
        }
        if let Self::NotThisGateway { me, .. } = self {
            // For the forwarding gateway, which takes its peer for gone.
            response.headers_mut().insert(GATEWAY_ID, uuid_header(me));
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
        let text = err.to_string();
        match err {
            StateError::Store(store) => store.into(),
            StateError::PreconditionFailed(why) => Self::PreconditionFailed(why),
            StateError::Lock(lock) => lock.into(),
            StateError::HistoryOff => Self::HistoryOff(text),
            StateError::BookmarkRegression(found) => Self::BookmarkRegression(text, found),
            StateError::BookmarkLoss(found) => Self::BookmarkLoss(text, found),
            StateError::VersionNotFound(_) => Self::VersionNotFound(text),
            StateError::FutureInstant(_) => Self::InvalidQuery(text),
            StateError::TooManyIds(_) => Self::InvalidBody(text),
            StateError::HistoryExpired { oldest_ms, .. } => Self::HistoryExpired(text, oldest_ms),
            StateError::NotFound(id) => Self::StateNotFound(id),
            StateError::NoBookmark(_) => Self::BookmarkNotFound(text),
            StateError::Duplicate { .. } => Self::InvalidBody(text),
            StateError::Stale { .. } => Self::StateContended(text),
            StateError::InBatch {
                index,
                state_id,
                source,
            } => Self::InBatch {
                index,
                state_id,
                inner: Box::new((*source).into()),
            },
        }
    }
}

impl From<LockError> for ApiError {
    fn from(err: LockError) -> Self {
        match err {
            LockError::Store(store) => store.into(),
            LockError::Moving(_) => Self::AuthorityMoving,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn every_503_carries_retry_after() {
        let unavailable = [
            ApiError::from(StoreError::Timeout(Duration::from_secs(1))),
            ApiError::Lock(LockError::Store(StoreError::Timeout(Duration::from_secs(
                1,
            )))),
            ApiError::AuthorityMoving,
            ApiError::from(StateError::Stale { attempts: 3 }),
        ];
        for err in unavailable {
            let response = err.into_response();
            assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(
                response.headers().get(header::RETRY_AFTER),
                Some(&HeaderValue::from_static("1"))
            );
        }
    }

    #[test]
    fn other_statuses_carry_no_retry_after() {
        let response = ApiError::Lock(LockError::NotCurrent(uuid::Uuid::nil())).into_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert!(!response.headers().contains_key(header::RETRY_AFTER));
    }
}
