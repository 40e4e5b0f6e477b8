//! Prometheus metrics: HTTP traffic by route and status, ClickHouse latency and errors.

use axum::http::Method;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    method: &'static str,
    route: String,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    method: &'static str,
    route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueryLabels {
    operation: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReadLabels {
    read: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RunLabels {
    status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    pool: String,
}

/// The most pools `/metrics` shows, first by name: a pool exists only while
/// leases hold it or acquires wait on it, and this bounds the page whatever
/// clients name them.
pub const MAX_POOL_SERIES: usize = 500;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShedLabels {
    limit: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WatcherLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClosedLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeniedLabels {
    reason: &'static str,
}

/// Why a request was refused by the token guard, as
/// `statehouse_auth_denied_total{reason}` counts it.
/// The last four are JWTs' (workload identity): an invalid token, a wrong
/// or missing audience, an unknown issuer, no binding taking the token.
pub const DENIAL_REASONS: [&str; 8] = [
    "unknown", "expired", "role", "scope", "invalid", "audience", "issuer", "binding",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LockLabels {
    event: &'static str,
}

/// Things that happen to locks, counted by `statehouse_lock_events_total{event}`.
#[derive(Clone, Copy, Debug)]
pub enum LockEvent {
    /// A lease was granted.
    Grant,
    /// An acquire had to wait behind another holder or waiter.
    Wait,
    /// An acquire gave up at its wait_seconds.
    Timeout,
    /// This gateway won the ClickHouse claim of a state_id.
    ClaimWin,
    /// A claim attempt that did not win: another gateway's earlier
    /// candidate stayed ahead, or its own ran out first (a slow ClickHouse).
    ClaimLoss,
    /// A held claim could not be renewed in time, or its renewal found it
    /// run out: it lapsed (its leases are kept until it is re-won or found taken).
    ClaimLost,
    /// A claim that lapsed with leases running was re-won with nothing in
    /// between, and its leases run on.
    ClaimReadopted,
    /// This gateway claimed a state_id for its repeated unlocked writes.
    ClaimForWrites,
    /// A table-mode claim decided without settling: this gateway read that
    /// no other may claim (see `locks::claim::membership`).
    ClaimAlone,
    Renewal,
    /// A lease ran out without being released.
    Expiry,
    Release,
    ForcedRelease,
}

impl LockEvent {
    const ALL: [Self; 13] = [
        Self::Grant,
        Self::Wait,
        Self::Timeout,
        Self::ClaimWin,
        Self::ClaimLoss,
        Self::ClaimLost,
        Self::ClaimReadopted,
        Self::ClaimForWrites,
        Self::ClaimAlone,
        Self::Renewal,
        Self::Expiry,
        Self::Release,
        Self::ForcedRelease,
    ];

    fn label(self) -> &'static str {
        match self {
            Self::Grant => "grant",
            Self::Wait => "wait",
            Self::Timeout => "timeout",
            Self::ClaimWin => "claim_win",
            Self::ClaimLoss => "claim_loss",
            Self::ClaimLost => "claim_lapsed",
            Self::ClaimReadopted => "claim_readopted",
            Self::ClaimForWrites => "claim_for_writes",
            Self::ClaimAlone => "claim_alone",
            Self::Renewal => "renewal",
            Self::Expiry => "expiry",
            Self::Release => "release",
            Self::ForcedRelease => "forced_release",
        }
    }
}

/// The method as a label: the standard ones by name, any other as `other`,
/// since a client may send any token as a method and each new label value
/// is a new series held for the life of the process.
pub fn method_label(method: &Method) -> &'static str {
    static STANDARD: [Method; 9] = [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::PATCH,
        Method::DELETE,
        Method::OPTIONS,
        Method::CONNECT,
        Method::TRACE,
    ];
    STANDARD
        .iter()
        .find(|standard| *standard == method)
        .map_or("other", Method::as_str)
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    request_seconds: HistogramFamily<RouteLabels>,
    query_seconds: HistogramFamily<QueryLabels>,
    query_errors: Family<QueryLabels, Counter>,
    lock_events: Family<LockLabels, Counter>,
    shed: Family<ShedLabels, Counter>,
    connections_closed: Family<ClosedLabels, Counter>,
    write_batch_rows: Histogram,
    read_batch_keys: HistogramFamily<ReadLabels>,
    bookmark_regressions: Counter,
    bookmark_losses: Counter,
    stale_writes: Counter,
    auth_denied: Family<DeniedLabels, Counter>,
    pool_holders: Family<PoolLabels, Gauge>,
    pool_waiting: Family<PoolLabels, Gauge>,
    watchers: Family<WatcherLabels, Gauge>,
    delivery_delay: Histogram,
    runs: Family<RunLabels, Counter>,
    runs_running: Gauge,
    run_seconds: Histogram,
}

fn latency_histogram() -> Histogram {
    // 0.5 ms .. ~16 s: covers a point read on a quiet server up to the query timeout.
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("statehouse");
        let requests = Family::<RequestLabels, Counter>::default();
        let request_seconds: HistogramFamily<RouteLabels> =
            Family::new_with_constructor(latency_histogram);
        let query_seconds: HistogramFamily<QueryLabels> =
            Family::new_with_constructor(latency_histogram);
        let query_errors = Family::<QueryLabels, Counter>::default();
        let lock_events = Family::<LockLabels, Counter>::default();
        let shed = Family::<ShedLabels, Counter>::default();
        let connections_closed = Family::<ClosedLabels, Counter>::default();
        let bookmark_regressions = Counter::default();
        let bookmark_losses = Counter::default();
        let stale_writes = Counter::default();
        let auth_denied = Family::<DeniedLabels, Counter>::default();
        let pool_holders = Family::<PoolLabels, Gauge>::default();
        let pool_waiting = Family::<PoolLabels, Gauge>::default();
        let watchers = Family::<WatcherLabels, Gauge>::default();
        let runs = Family::<RunLabels, Counter>::default();
        for status in ["succeeded", "failed", "lost"] {
            let _ = runs.get_or_create(&RunLabels { status });
        }
        registry.register(
            "runs",
            "Runs this gateway ended, by status (succeeded, failed: by their PATCH; lost: found with their lease ended)",
            runs.clone(),
        );
        let runs_running = Gauge::default();
        registry.register(
            "runs_running",
            "Runs running across the fleet, as this gateway last counted them (every gateway counts the same runs: take the max, not the sum)",
            runs_running.clone(),
        );
        // 1 s .. ~9 h: a quick sync up to a long backfill.
        let run_seconds = Histogram::new(exponential_buckets(1.0, 2.0, 16));
        registry.register(
            "run_duration_seconds",
            "Duration of the runs this gateway ended",
            run_seconds.clone(),
        );
        registry.register(
            "watchers",
            "Requests waiting on a change, by kind (long_poll: GET /v1/states/{state_id}?wait=; feed: GET /v1/changes)",
            watchers.clone(),
        );
        let _ = watchers.get_or_create(&WatcherLabels { kind: "long_poll" });
        let _ = watchers.get_or_create(&WatcherLabels { kind: "feed" });
        // 1 ms .. ~33 s: a local poke up to a follower far behind.
        let delivery_delay = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        registry.register(
            "watch_delivery_delay_seconds",
            "Time from a change's insert into ClickHouse to its delivery by the change feed (this gateway's clock against ClickHouse's)",
            delivery_delay.clone(),
        );
        registry.register(
            "pool_holders",
            "Leases held on each pool this gateway is the authority for",
            pool_holders.clone(),
        );
        registry.register(
            "pool_waiting",
            "Acquires waiting on each pool this gateway is the authority for",
            pool_waiting.clone(),
        );
        registry.register(
            "auth_denied",
            "Requests refused for their token, by reason (unknown: none or not ours, expired, role: too weak, scope: a state_id outside the token's scope)",
            auth_denied.clone(),
        );
        registry.register(
            "bookmark_regressions",
            "Bookmarks that went backwards in a write (one per stream or partition), written or refused",
            bookmark_regressions.clone(),
        );
        registry.register(
            "bookmark_losses",
            "Bookmarks a write dropped (one per stream or partition), written or refused",
            bookmark_losses.clone(),
        );
        registry.register(
            "stale_writes",
            "INSERTs of state changes ClickHouse refused, nothing written: a state one was decided against had changed (another writer); its changes are decided again",
            stale_writes.clone(),
        );
        // 1 .. 1024 rows: a lone write up to a full batch.
        let write_batch_rows = Histogram::new(exponential_buckets(1.0, 2.0, 11));
        registry.register(
            "write_batch_rows",
            "Rows per INSERT of state changes (group commit: the changes that arrived together)",
            write_batch_rows.clone(),
        );
        // 1 .. 512 keys: a lone read up to a full query (`store::read_batch`).
        let read_batch_keys: HistogramFamily<ReadLabels> =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(1.0, 2.0, 10)));
        registry.register(
            "read_batch_keys",
            "Keys per coalesced ClickHouse point read, by read (state: current rows, locks: an id's lock rows)",
            read_batch_keys.clone(),
        );
        registry.register(
            "http_requests",
            "HTTP requests answered, by route and status",
            requests.clone(),
        );
        registry.register(
            "http_request_duration_seconds",
            "Time to answer an HTTP request, by route",
            request_seconds.clone(),
        );
        registry.register(
            "clickhouse_query_duration_seconds",
            "Time of ClickHouse round trips, by operation (failed ones included)",
            query_seconds.clone(),
        );
        registry.register(
            "clickhouse_query_errors",
            "ClickHouse round trips that failed or timed out, by operation",
            query_errors.clone(),
        );
        registry.register(
            "lock_events",
            "Lock grants, waits, timeouts, claim wins and losses, renewals, expiries and releases",
            lock_events.clone(),
        );
        registry.register(
            "requests_shed",
            "Requests refused because a concurrency limit was reached, by limit (requests, lock_waiters, watchers: 503 for everyone; share: 429, a token at its --max-share of one)",
            shed.clone(),
        );
        registry.register(
            "trace_spans_dropped",
            "Spans that never reached the OpenTelemetry collector: the export queue was full (a collector down or slow), or their export failed",
            crate::traces::spans_dropped(),
        );
        registry.register(
            "connections_closed",
            "Connections the gateway closed on a client, by reason (header_timeout, idle_timeout, tls_handshake: a failed TLS handshake, plain HTTP to the HTTPS port among them)",
            connections_closed.clone(),
        );
        // Counters exist at zero from the start, so that a dashboard's rate()
        // sees their first increment and shows 0 instead of no data.
        for event in LockEvent::ALL {
            let _ = lock_events.get_or_create(&LockLabels {
                event: event.label(),
            });
        }
        for limit in ["requests", "lock_waiters", "watchers", "share"] {
            let _ = shed.get_or_create(&ShedLabels { limit });
        }
        for read in ["state", "locks", "route"] {
            let _ = read_batch_keys.get_or_create(&ReadLabels { read });
        }
        for reason in ["header_timeout", "idle_timeout", "tls_handshake"] {
            let _ = connections_closed.get_or_create(&ClosedLabels { reason });
        }
        for reason in DENIAL_REASONS {
            let _ = auth_denied.get_or_create(&DeniedLabels { reason });
        }
        Self {
            watchers,
            delivery_delay,
            runs,
            runs_running,
            run_seconds,
            auth_denied,
            pool_holders,
            pool_waiting,
            write_batch_rows,
            read_batch_keys,
            bookmark_regressions,
            bookmark_losses,
            stale_writes,
            lock_events,
            shed,
            connections_closed,
            registry,
            requests,
            request_seconds,
            query_seconds,
            query_errors,
        }
    }
}

impl Metrics {
    /// One answered request. `route` is a route template or `unmatched`,
    /// never a raw path, and the method is one of [`method_label`]'s: no
    /// label takes a value that a client chooses.
    pub fn observe_request(&self, method: &Method, route: &str, status: u16, seconds: f64) {
        let route_labels = RouteLabels {
            method: method_label(method),
            route: route.to_owned(),
        };
        self.request_seconds
            .get_or_create(&route_labels)
            .observe(seconds);
        self.requests
            .get_or_create(&RequestLabels {
                method: route_labels.method,
                route: route_labels.route,
                status,
            })
            .inc();
    }

    pub fn bookmark_regressions(&self, count: usize) {
        self.bookmark_regressions.inc_by(count as u64);
    }

    pub fn bookmark_losses(&self, count: usize) {
        self.bookmark_losses.inc_by(count as u64);
    }

    pub fn stale_write(&self) {
        self.stale_writes.inc();
    }

    pub fn observe_write_batch(&self, rows: usize) {
        self.write_batch_rows.observe(rows as f64);
    }

    pub fn observe_read_batch(&self, read: &'static str, keys: usize) {
        self.read_batch_keys
            .get_or_create(&ReadLabels { read })
            .observe(keys as f64);
    }

    pub fn observe_query(&self, operation: &'static str, seconds: f64, ok: bool) {
        let labels = QueryLabels { operation };
        self.query_seconds.get_or_create(&labels).observe(seconds);
        // Created at zero by the operation's first query, failed or not.
        let errors = self.query_errors.get_or_create(&labels);
        if !ok {
            errors.inc();
        }
    }

    pub fn lock_event(&self, event: LockEvent) {
        self.lock_events
            .get_or_create(&LockLabels {
                event: event.label(),
            })
            .inc();
    }

    /// A request refused because `limit` was reached.
    pub fn request_shed(&self, limit: &'static str) {
        self.shed.get_or_create(&ShedLabels { limit }).inc();
    }

    /// A connection closed by the gateway: a client too slow with its headers, or idle too long.
    pub fn connection_closed(&self, reason: &'static str) {
        self.connections_closed
            .get_or_create(&ClosedLabels { reason })
            .inc();
    }

    /// A request refused for its token; `reason` is one of [`DENIAL_REASONS`].
    pub fn auth_denied(&self, reason: &'static str) {
        self.auth_denied
            .get_or_create(&DeniedLabels { reason })
            .inc();
    }

    /// The pools as they are now, (name, holders, waiting) in name order:
    /// those gone since the last look leave the page.
    pub fn pools(&self, pools: &[(&str, usize, usize)]) {
        self.pool_holders.clear();
        self.pool_waiting.clear();
        for (pool, holders, waiting) in pools.iter().take(MAX_POOL_SERIES) {
            let labels = PoolLabels {
                pool: (*pool).to_owned(),
            };
            let count = |n: &usize| i64::try_from(*n).unwrap_or(i64::MAX);
            self.pool_holders.get_or_create(&labels).set(count(holders));
            self.pool_waiting.get_or_create(&labels).set(count(waiting));
        }
    }

    /// One more long-poll waits (`delta` 1), or one answered (-1).
    pub fn long_polls(&self, delta: i64) {
        self.watchers
            .get_or_create(&WatcherLabels { kind: "long_poll" })
            .inc_by(delta);
    }

    /// One more feed follower waits (`delta` 1), or one answered (-1).
    pub fn feeds(&self, delta: i64) {
        self.watchers
            .get_or_create(&WatcherLabels { kind: "feed" })
            .inc_by(delta);
    }

    /// A change delivered by the feed, `seconds` after ClickHouse took it.
    pub fn delivery_delay(&self, seconds: f64) {
        self.delivery_delay.observe(seconds);
    }

    /// A run ended here, as `status`, after `millis`.
    pub fn run_ended(&self, status: &'static str, millis: i64) {
        self.runs.get_or_create(&RunLabels { status }).inc();
        self.run_seconds.observe(millis.max(0) as f64 / 1000.0);
    }

    /// How many runs are running, as counted now.
    pub fn runs_running(&self, count: usize) {
        self.runs_running
            .set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_made_up_method_is_counted_as_other_and_adds_no_series() {
        let metrics = Metrics::default();
        metrics.observe_request(&Method::GET, "/v1/states", 200, 0.001);
        let before = metrics.render();
        for n in 0..50 {
            let made_up = Method::from_bytes(format!("M{n:0>2000}").as_bytes()).unwrap();
            metrics.observe_request(&made_up, "unmatched", 405, 0.001);
        }
        let after = metrics.render();
        assert!(after.contains(r#"method="other""#), "{after}");
        assert!(!after.contains("M00"), "a client's method became a label");
        assert!(
            after.len() < before.len() + 4096,
            "grew by {}",
            after.len() - before.len()
        );
    }
}
