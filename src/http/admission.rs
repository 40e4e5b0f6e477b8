//! How many requests the gateway works on at once. Past a limit a request is
//! refused at once with 503 `overloaded` and `Retry-After`, instead of
//! queueing without bound.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::Response;
use tokio::sync::Semaphore;

use super::error::{ProblemType, problem};
use crate::config::Concurrency;
use crate::metrics::Metrics;

/// What an operation counts against; every operation in the table says which.
#[derive(Clone, Copy, Debug)]
pub enum Counts {
    /// `--max-concurrent-requests`.
    Request,
    /// `--max-lock-waiters`: lock acquires, which may wait up to their
    /// wait_seconds and would otherwise crowd out everything else.
    LockWaiter,
    /// Nothing: health checks and metrics answer under overload.
    Nothing,
}

/// The permits behind [`Counts`].
pub struct Admission {
    requests: Semaphore,
    lock_waiters: Semaphore,
    concurrency: Concurrency,
}

impl Admission {
    pub fn new(concurrency: Concurrency) -> Self {
        Self {
            requests: Semaphore::new(concurrency.requests as usize),
            lock_waiters: Semaphore::new(concurrency.lock_waiters as usize),
            concurrency,
        }
    }
}

/// The client should come back soon: a request's place frees up as soon as
/// one in progress is answered.
const RETRY_AFTER_SECONDS: HeaderValue = HeaderValue::from_static("1");

/// Lets the request through while it holds a permit of what it counts
/// against. It is handed the permits and the metrics, not the whole
/// `AppContext`: the context holds the [`Admission`], so this module stays
/// below it.
pub async fn admit(
    State((admission, metrics, counts)): State<(Arc<Admission>, Arc<Metrics>, Counts)>,
    request: Request,
    next: Next,
) -> Response {
    let (permits, limit, flag, label) = match counts {
        Counts::Nothing => return next.run(request).await,
        Counts::Request => (
            &admission.requests,
            admission.concurrency.requests,
            "--max-concurrent-requests",
            "requests",
        ),
        Counts::LockWaiter => (
            &admission.lock_waiters,
            admission.concurrency.lock_waiters,
            "--max-lock-waiters",
            "lock_waiters",
        ),
    };
    let Ok(_permit) = permits.try_acquire() else {
        metrics.request_shed(label);
        let mut response = problem(
            ProblemType::Overloaded,
            &format!(
                "the gateway is at its limit of {limit} at once ({flag}); retry after a second"
            ),
        );
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, RETRY_AFTER_SECONDS);
        return response;
    };
    next.run(request).await
}
