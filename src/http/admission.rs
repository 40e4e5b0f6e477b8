//! How many requests the gateway works on at once. Past a limit a request is
//! refused at once with 503 `overloaded` and `Retry-After`, instead of
//! queueing without bound. With tokens, one token name may hold at most its
//! share of each limit (`--max-share`): past it, 429 `too-many-requests`,
//! while the rest stays free for the others. A request holds its place
//! from admission to its answer, its body's arrival included, so a token's
//! slow uploads use up that token's share and no one else's.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Frame, SizeHint};
use tokio::sync::{Semaphore, SemaphorePermit};

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
    /// `--max-watchers` when the request asks to wait (`?wait=`, a
    /// long-poll), else `--max-concurrent-requests`: a waiting request holds
    /// no request permit, or a few idle watchers would starve every write.
    RequestOrWatcher,
    /// Nothing: health checks and metrics answer under overload.
    Nothing,
}

/// Whose share a request counts against; the token guard, which runs
/// first, leaves it in the request's extensions.
#[derive(Clone, Debug)]
pub enum Sharer {
    /// No tokens: every client is one, and only the limits apply.
    Everyone,
    /// A token's name, or `anonymous` for what needs none (the dashboard).
    Token(Arc<str>),
}

/// The permits behind [`Counts`].
pub struct Admission {
    requests: Limit,
    lock_waiters: Limit,
    watchers: Limit,
}

/// One limit: its permits, and who holds how many of them.
struct Limit {
    permits: Semaphore,
    size: u32,
    /// The most one token name may hold at once: at least one.
    share: u32,
    /// Permits held, by token name; a name leaves the map with its last one.
    held: Mutex<HashMap<Arc<str>, u32>>,
    flag: &'static str,
    label: &'static str,
}

impl Admission {
    pub fn new(concurrency: Concurrency) -> Self {
        Self {
            requests: Limit::new(
                concurrency.requests,
                concurrency.max_share,
                "--max-concurrent-requests",
                "requests",
            ),
            lock_waiters: Limit::new(
                concurrency.lock_waiters,
                concurrency.max_share,
                "--max-lock-waiters",
                "lock_waiters",
            ),
            watchers: Limit::new(
                concurrency.watchers,
                concurrency.max_share,
                "--max-watchers",
                "watchers",
            ),
        }
    }
}

impl Limit {
    fn new(size: u32, max_share: f64, flag: &'static str, label: &'static str) -> Self {
        // Truncated: a share never rounds up past what was asked.
        let share = ((f64::from(size) * max_share) as u32).max(1);
        Self {
            permits: Semaphore::new(size as usize),
            size,
            share,
            held: Mutex::new(HashMap::new()),
            flag,
            label,
        }
    }

    /// A place for one request of `sharer`'s, or why there is none.
    fn enter(&self, sharer: &Sharer) -> Result<Place<'_>, Refusal> {
        let name = match sharer {
            Sharer::Everyone => None,
            Sharer::Token(name) => Some(name.clone()),
        };
        // The share is taken before the permit and given back if no permit
        // is free: a token at its share never holds one of the others'.
        if let Some(name) = &name {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            let count = held.entry(name.clone()).or_insert(0);
            if *count >= self.share {
                return Err(Refusal::Share);
            }
            *count += 1;
        }
        let share = name.map(|name| Share {
            limit: self,
            name,
            kept: false,
        });
        let permit = self.permits.try_acquire().map_err(|_| Refusal::Limit)?;
        Ok(Place {
            _permit: permit,
            _share: share,
        })
    }
}

enum Refusal {
    /// The token holds its share.
    Share,
    /// Every permit is taken.
    Limit,
}

/// A request's place: its permit, and its token's count of them.
struct Place<'a> {
    _permit: SemaphorePermit<'a>,
    _share: Option<Share<'a>>,
}

impl Place<'_> {
    /// The place, kept past the handler's answer until the answer's body
    /// ends: a stream's, which waits for its whole life.
    fn outlive(self, admission: Arc<Admission>) -> StreamPlace {
        let Place {
            _permit: permit,
            _share: share,
        } = self;
        permit.forget();
        StreamPlace {
            admission,
            name: share.map(Share::keep),
        }
    }
}

/// One permit counted for a token name, until dropped (answered, or its
/// future dropped mid-request).
struct Share<'a> {
    limit: &'a Limit,
    name: Arc<str>,
    /// Handed on to a [`StreamPlace`], which gives it back.
    kept: bool,
}

impl Share<'_> {
    fn keep(mut self) -> Arc<str> {
        self.kept = true;
        self.name.clone()
    }
}

impl Drop for Share<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.limit.leave(&self.name);
        }
    }
}

impl Limit {
    /// `name` holds one permit fewer.
    fn leave(&self, name: &Arc<str>) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = held.get_mut(name) {
            *count -= 1;
            if *count == 0 {
                held.remove(name);
            }
        }
    }
}

/// A stream's place among the watchers, given back when its body ends
/// (the client hung up, or the stream ended).
struct StreamPlace {
    admission: Arc<Admission>,
    /// The token name whose share it counts against.
    name: Option<Arc<str>>,
}

impl Drop for StreamPlace {
    fn drop(&mut self) {
        let watchers = &self.admission.watchers;
        watchers.permits.add_permits(1);
        if let Some(name) = &self.name {
            watchers.leave(name);
        }
    }
}

/// A response body that holds its request's place until it ends.
struct Holding {
    /// The handler's body, passed through.
    body: Body,
    _place: StreamPlace,
}

impl http_body::Body for Holding {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The client should come back soon: a request's place frees up as soon as
/// one in progress is answered.
const RETRY_AFTER_SECONDS: HeaderValue = HeaderValue::from_static("1");

/// Lets the request through while it holds a place in what it counts
/// against. It is handed the permits and the metrics, not the whole
/// `AppContext`: the context holds the [`Admission`], so this module stays
/// below it.
pub async fn admit(
    State((admission, metrics, counts)): State<(Arc<Admission>, Arc<Metrics>, Counts)>,
    request: Request,
    next: Next,
) -> Response {
    let streams = matches!(counts, Counts::RequestOrWatcher) && asks_for_a_stream(&request);
    let limit = match counts {
        Counts::Nothing => return next.run(request).await,
        Counts::Request => &admission.requests,
        Counts::LockWaiter => &admission.lock_waiters,
        Counts::RequestOrWatcher if streams || asks_to_wait(&request) => &admission.watchers,
        Counts::RequestOrWatcher => &admission.requests,
    };
    let sharer = request
        .extensions()
        .get::<Sharer>()
        .cloned()
        .unwrap_or(Sharer::Everyone);
    let (kind, detail, shed) = match limit.enter(&sharer) {
        Ok(place) if streams => {
            let place = place.outlive(admission.clone());
            let response = next.run(request).await;
            return response.map(|body| {
                Body::new(Holding {
                    body,
                    _place: place,
                })
            });
        }
        Ok(_place) => return next.run(request).await,
        Err(Refusal::Share) => (
            ProblemType::TooManyRequests,
            format!(
                "this token already has {} requests of this kind in progress, its share of the gateway's {} ({} × --max-share); retry after a second",
                limit.share, limit.size, limit.flag
            ),
            "share",
        ),
        Err(Refusal::Limit) => (
            ProblemType::Overloaded,
            format!(
                "the gateway is at its limit of {} at once ({}); retry after a second",
                limit.size, limit.flag
            ),
            limit.label,
        ),
    };
    metrics.request_shed(shed);
    let mut response = problem(kind, &detail);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, RETRY_AFTER_SECONDS);
    response
}

/// Whether the client asks for Server-Sent Events: a stream waits for its
/// whole life, so it counts as a watcher until its body ends.
fn asks_for_a_stream(request: &Request) -> bool {
    request
        .headers()
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .any(accepts_event_stream)
}

/// Whether an `Accept` value names `text/event-stream`.
pub fn accepts_event_stream(accept: &str) -> bool {
    accept.split(',').any(|range| {
        range
            .split(';')
            .next()
            .is_some_and(|media| media.trim().eq_ignore_ascii_case("text/event-stream"))
    })
}

/// Whether the query string names `wait`, whatever its value: a bad one is
/// refused by the handler, after admission, as every other bad parameter is.
fn asks_to_wait(request: &Request) -> bool {
    request.uri().query().is_some_and(|query| {
        query
            .split('&')
            .any(|pair| pair.split('=').next() == Some("wait"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(name: &str) -> Sharer {
        Sharer::Token(Arc::from(name))
    }

    #[test]
    fn only_a_wait_parameter_makes_a_watcher() {
        let asks = |uri: &str| {
            asks_to_wait(
                &Request::builder()
                    .uri(uri)
                    .body(axum::body::Body::empty())
                    .unwrap(),
            )
        };
        assert!(asks("/v1/states/a?wait=5s"));
        assert!(asks("/v1/states/a?x=1&wait="));
        assert!(!asks("/v1/states/a"));
        assert!(!asks("/v1/states/a?waiting=1"));
        assert!(!asks("/v1/states/wait"));
    }

    #[test]
    fn a_stream_is_asked_for_by_accept_only() {
        assert!(accepts_event_stream("text/event-stream"));
        assert!(accepts_event_stream(
            "application/json, Text/Event-Stream;q=0.9"
        ));
        assert!(!accepts_event_stream("application/json"));
        assert!(!accepts_event_stream("text/event-streams"));
    }

    #[test]
    fn a_streams_place_is_given_back_when_it_ends() {
        let admission = Arc::new(Admission::new(crate::config::Concurrency {
            requests: 1,
            lock_waiters: 1,
            watchers: 2,
            max_share: 0.5,
        }));
        let place = admission.watchers.enter(&token("a")).ok().unwrap();
        let held = place.outlive(admission.clone());
        assert!(matches!(
            admission.watchers.enter(&token("a")),
            Err(Refusal::Share)
        ));
        assert_eq!(admission.watchers.permits.available_permits(), 1);
        drop(held);
        assert_eq!(admission.watchers.permits.available_permits(), 2);
        assert!(admission.watchers.held.lock().unwrap().is_empty());
    }

    #[test]
    fn a_token_past_its_share_is_refused_while_others_are_let_in() {
        let limit = Limit::new(8, 0.5, "--max-concurrent-requests", "requests");
        let a: Vec<_> = (0..4)
            .map(|_| limit.enter(&token("a")).ok().unwrap())
            .collect();
        assert!(matches!(limit.enter(&token("a")), Err(Refusal::Share)));
        let b: Vec<_> = (0..4)
            .map(|_| limit.enter(&token("b")).ok().unwrap())
            .collect();
        assert!(matches!(limit.enter(&token("c")), Err(Refusal::Limit)));
        drop(a);
        assert!(limit.enter(&token("a")).is_ok());
        drop(b);
        assert!(
            limit.held.lock().unwrap().is_empty(),
            "names leave with their last permit"
        );
    }

    #[test]
    fn a_refusal_for_the_limit_gives_the_share_back() {
        let limit = Limit::new(2, 0.5, "--max-lock-waiters", "lock_waiters");
        let _everyone: Vec<_> = (0..2)
            .map(|_| limit.enter(&Sharer::Everyone).ok().unwrap())
            .collect();
        assert!(matches!(limit.enter(&token("a")), Err(Refusal::Limit)));
        assert!(limit.held.lock().unwrap().is_empty());
    }

    #[test]
    fn without_tokens_only_the_limit_applies_and_a_share_is_at_least_one() {
        let limit = Limit::new(3, 0.5, "--max-concurrent-requests", "requests");
        let _all: Vec<_> = (0..3)
            .map(|_| limit.enter(&Sharer::Everyone).ok().unwrap())
            .collect();
        assert!(matches!(
            limit.enter(&Sharer::Everyone),
            Err(Refusal::Limit)
        ));
        let tiny = Limit::new(1, 0.1, "--max-lock-waiters", "lock_waiters");
        assert_eq!(tiny.share, 1);
        assert!(tiny.enter(&token("a")).is_ok());
    }
}
