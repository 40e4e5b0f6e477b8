//! The change feed (`GET /v1/changes`): following every state under a glob.
//!
//! One poller task per gateway runs while anyone follows: twice a second it
//! reads, in one statement (the changes joined with the current rows of
//! their ids), every change inserted since a little before its last read
//! into an in-memory [`Window`], and wakes the followers. A follower whose
//! cursor the window covers is answered from memory; an older cursor is
//! read from ClickHouse once. A commit through this gateway pokes the
//! poller to read at once ([`Feed::poke`]), so local followers need not
//! wait for the tick.
//!
//! The rules of what is delivered (each id once, its current row, late
//! changes again) are in `window`, the cursor in `cursor`; this module is
//! the I/O around them.

mod cursor;
mod window;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

pub use self::cursor::{CursorError, FeedCursor};
pub use self::window::{Delivered, Delivery};
use self::window::{RE_READ, Window, deliver};
use crate::domain::{Scope, StateId, StatePattern};
use crate::metrics::Metrics;
use crate::store::{ChangesStore, Selection, StoreError, now_ms};
use crate::worker::{Running, Worker};

/// How often the poller reads: twice a second, so that a change made
/// elsewhere is heard within the contract's 1 s at the 90th percentile (a
/// change lands anywhere in a period, and the read and answer take time).
pub const POLL_EVERY: Duration = Duration::from_millis(500);

/// How much the window keeps behind its newest read: a follower that comes
/// back within this is answered from memory.
const SPAN: Duration = Duration::from_secs(60);

fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

/// What a follower asks.
pub struct Follow {
    /// The glob the cursor is bound to.
    pub pattern: StatePattern,
    /// The token's: ids outside it are never delivered.
    pub scope: Scope,
    /// None: a first call, answered at once with the current cursor.
    pub since: Option<FeedCursor>,
    /// The most ids one answer delivers.
    pub limit: usize,
    /// When to answer without changes.
    pub deadline: Instant,
}

/// The feed of this gateway; cheap to clone.
#[derive(Clone)]
pub struct Feed {
    shared: Arc<Shared>,
}

/// What the handle, the followers and the poller share.
struct Shared {
    /// Where the changes are read.
    store: ChangesStore,
    /// The newest window; None while no poller runs.
    window: watch::Sender<Option<Arc<Window>>>,
    /// How many follow (requests, streams included), and the poller that
    /// runs while anyone does.
    followers: Worker<usize>,
    /// A local commit: the poller reads at once.
    poke: Notify,
    /// Turns true once, when the gateway stops: every follower answers then.
    closed: watch::Sender<bool>,
    /// Counts the followers and the delivery delay.
    metrics: Arc<Metrics>,
}

impl Feed {
    pub fn new(store: ChangesStore, metrics: Arc<Metrics>) -> Self {
        let window = watch::channel(None).0;
        let emptied = window.clone();
        // Under the lock as the poller ends, however it ends: a poller
        // started after it keeps its window.
        let followers = Worker::ending(0, move |_| {
            emptied.send_replace(None);
        });
        Self {
            shared: Arc::new(Shared {
                store,
                window,
                followers,
                poke: Notify::new(),
                closed: watch::channel(false).0,
                metrics,
            }),
        }
    }

    /// How long a cursor stays good (`--watch-retention`).
    pub fn retention(&self) -> Duration {
        self.shared.store.retention()
    }

    /// Something changed through this gateway: the poller, if one runs,
    /// reads at once.
    pub fn poke(&self) {
        if self.shared.followers.running() {
            self.shared.poke.notify_one();
        }
    }

    /// The gateway stops: every follower answers now.
    pub fn close(&self) {
        self.shared.closed.send_replace(true);
    }

    /// Whether the gateway stops: streams end.
    pub fn closing(&self) -> bool {
        *self.shared.closed.borrow()
    }

    /// The changes after `follow.since`, at once when there are some, else
    /// when some come or at the deadline (then none, and a cursor).
    pub async fn changes(&self, follow: &Follow) -> Result<Delivery, StoreError> {
        if follow.since.is_none() {
            return self.first(follow).await;
        }
        let follower = self.follow();
        self.next(&follower, follow).await
    }

    /// As [`Feed::changes`] with a `since`, for a follower that follows on
    /// (a stream): its place, and the poller, last across its calls.
    pub async fn next(
        &self,
        _follower: &Follower,
        follow: &Follow,
    ) -> Result<Delivery, StoreError> {
        let Some(mut cursor) = follow.since else {
            return self.first(follow).await;
        };
        // A poller that died while this follower followed is replaced.
        self.polled(|_| ());
        let mut windows = self.shared.window.subscribe();
        let mut closed = self.shared.closed.subscribe();
        // At most one read of its own: the window covers the cursor after it.
        let mut read = false;
        loop {
            let window = windows.borrow_and_update().clone();
            let in_time = Instant::now() < follow.deadline;
            let delivery = match window {
                Some(window) if window.covers(&cursor) => {
                    Some(self.deliver(&window, &cursor, follow))
                }
                // Older than the window: the poller never reads that far back.
                Some(window) if cursor.settled_us < window.from_us && !read => {
                    read = true;
                    Some(self.read_for(&cursor, follow).await?)
                }
                // Ahead of the window (made on another gateway) or no window
                // yet: the poller's next read covers it, if there is time.
                _ if !in_time && !read => {
                    read = true;
                    Some(self.read_for(&cursor, follow).await?)
                }
                _ => None,
            };
            if let Some(delivery) = delivery {
                if !delivery.changes.is_empty() {
                    return Ok(delivery);
                }
                cursor = delivery.cursor;
            }
            let nothing = || Delivery {
                changes: Vec::new(),
                cursor,
            };
            if *closed.borrow() {
                return Ok(nothing());
            }
            tokio::select! {
                _ = windows.changed() => {}
                _ = closed.wait_for(|closed| *closed) => return Ok(nothing()),
                () = tokio::time::sleep_until(follow.deadline) => return Ok(nothing()),
            }
        }
    }

    /// A first call: no changes, and the current cursor, from the window if
    /// a poller runs, else from one read.
    pub async fn first(&self, follow: &Follow) -> Result<Delivery, StoreError> {
        let window = self.shared.window.borrow().clone();
        let window = match window {
            Some(window) => window,
            None => {
                let from = now_ms() * 1000 - micros(RE_READ);
                Arc::new(self.read(from, follow, "feed").await?)
            }
        };
        Ok(deliver(
            &window,
            None,
            &follow.pattern,
            &follow.scope,
            follow.limit,
        ))
    }

    /// What a follower at `cursor` is delivered, read from ClickHouse.
    async fn read_for(&self, cursor: &FeedCursor, follow: &Follow) -> Result<Delivery, StoreError> {
        let window = self.read(cursor.settled_us, follow, "feed").await?;
        Ok(self.deliver(&window, cursor, follow))
    }

    /// Every change under the follower's glob and scope after `from_us`.
    async fn read(
        &self,
        from_us: i64,
        follow: &Follow,
        operation: &'static str,
    ) -> Result<Window, StoreError> {
        let selection = Selection::Matching(follow.pattern.clone(), follow.scope.clone());
        let read = self
            .shared
            .store
            .read(from_us, &selection, operation)
            .await?;
        Ok(Window::read(from_us, read))
    }

    fn deliver(&self, window: &Window, cursor: &FeedCursor, follow: &Follow) -> Delivery {
        let delivery = deliver(
            window,
            Some(cursor),
            &follow.pattern,
            &follow.scope,
            follow.limit,
        );
        let now_us = now_ms() * 1000;
        for change in &delivery.changes {
            let delay = (now_us - change.seen_us).max(0) as f64 / 1e6;
            self.shared.metrics.delivery_delay(delay);
        }
        delivery
    }

    /// The poller's reads, while one runs: the long-poll's waiters are
    /// woken from them instead of a read of their own.
    pub fn reads(&self) -> FeedReads {
        FeedReads(self.shared.window.subscribe())
    }

    /// One more follower: starts the poller if none runs.
    pub fn follow(&self) -> Follower {
        self.polled(|count| *count += 1);
        self.shared.metrics.feeds(1);
        Follower {
            shared: self.shared.clone(),
        }
    }

    /// Changes the count of followers, and starts the poller if none runs.
    fn polled(&self, change: impl FnOnce(&mut usize)) {
        self.shared
            .followers
            .add(change, |running| poll(self.shared.clone(), running));
    }
}

/// What the feed's poller read last, seen from a long-poll's poller.
pub struct FeedReads(watch::Receiver<Option<Arc<Window>>>);

impl FeedReads {
    /// Until the poller reads again, or starts or stops.
    pub async fn changed(&mut self) {
        if self.0.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// None while no poller runs. Else every id changed within the window,
    /// with its version at the newest read (None: gone): an id not in it
    /// has not changed for a while.
    pub fn versions(&mut self) -> Option<HashMap<StateId, Option<i64>>> {
        let window = self.0.borrow_and_update().clone()?;
        Some(
            window
                .current
                .iter()
                .map(|(id, row)| (id.clone(), row.as_ref().map(|row| row.updated_at_ms)))
                .collect(),
        )
    }
}

/// A follower's place, given back when dropped (answered, or hung up).
pub struct Follower {
    /// Where it is counted.
    shared: Arc<Shared>,
}

impl Drop for Follower {
    fn drop(&mut self) {
        *self.shared.followers.lock() -= 1;
        self.shared.metrics.feeds(-1);
    }
}

/// The poller: a read at once, then one every [`POLL_EVERY`] (500 ms) or at
/// a poke, while anyone follows. A failed read is logged and tried again at
/// the next tick; the followers keep waiting until their deadlines.
async fn poll(shared: Arc<Shared>, mut running: Running<usize>) {
    let mut tick = tokio::time::interval(POLL_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is at once, and so is the first read.
    tick.tick().await;
    let every_id = StatePattern::parse("*").expect("* is a glob");
    let everything = Selection::Matching(every_id, Scope::everything());
    while running
        .next(|followers| (*followers > 0).then_some(()))
        .is_some()
    {
        let previous = shared.window.borrow().clone();
        let from_us = previous.as_ref().map_or_else(
            || now_ms() * 1000 - micros(SPAN),
            |window| window.read_at_us - micros(RE_READ),
        );
        match shared.store.read(from_us, &everything, "watch").await {
            Ok(read) => {
                let mut window = match previous {
                    Some(previous) => {
                        let mut window = Window::clone(&previous);
                        window.merge(from_us, read);
                        window
                    }
                    None => Window::read(from_us, read),
                };
                window.trim(window.read_at_us - micros(SPAN));
                shared.window.send_replace(Some(Arc::new(window)));
            }
            Err(err) => {
                tracing::warn!(error = %err, "feed: reading the changes failed; trying again at the next tick");
            }
        }
        tokio::select! {
            _ = tick.tick() => {}
            () = shared.poke.notified() => {}
        }
    }
}

#[cfg(test)]
pub(in crate::states) mod tests {
    use std::future::Future;
    use std::time::Duration;

    use super::*;
    use crate::config::Config;
    use crate::store::{ClickHouse, History, Store};

    /// A gateway's configuration, and its tables on a ClickHouse at a closed
    /// port: every statement fails at once, and is counted in `metrics`.
    pub fn nowhere(metrics: &Arc<Metrics>) -> (Config, Store) {
        let mut config =
            Config::from_serve_args(&["--clickhouse-url=clickhouse://127.0.0.1:1"]).unwrap();
        // Whatever the environment says.
        config.clickhouse.host = "127.0.0.1".to_owned();
        config.clickhouse.port = 1;
        let ch = ClickHouse::new(&config.clickhouse, config.query_timeout, metrics.clone());
        let store = Store::new(ch, config.schema.clone(), &config.table, History::Off);
        (config, store)
    }

    /// The count of `series` (a histogram's `_count` with its labels).
    pub fn counted(metrics: &Metrics, series: &str) -> u64 {
        metrics
            .render()
            .lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0)
    }

    /// How many statements `operation` has sent.
    pub fn statements_sent(metrics: &Metrics, operation: &str) -> u64 {
        counted(
            metrics,
            &format!(
                "statehouse_clickhouse_query_duration_seconds_count{{operation=\"{operation}\"}}"
            ),
        )
    }

    /// `until`, in a test that fails rather than hangs when it never comes.
    pub async fn surely<T>(what: &str, until: impl Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(30), until)
            .await
            .unwrap_or_else(|_| panic!("never {what}"))
    }

    /// Until `operation` has sent a statement.
    pub async fn sent(metrics: &Metrics, operation: &str) {
        surely("sent", async {
            while statements_sent(metrics, operation) == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
    }

    /// Until `worker`'s task has ended.
    pub async fn stopped<S: Send + 'static>(worker: &Worker<S>) {
        surely("stopped", async {
            while worker.running() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
    }

    #[tokio::test]
    async fn a_poller_that_dies_is_replaced_for_the_next_follower() {
        let metrics = Arc::new(Metrics::default());
        let (_, store) = nowhere(&metrics);
        let feed = Feed::new(store.changes, metrics.clone());
        feed.shared.followers.fail_next_task();
        let first = feed.follow();
        stopped(&feed.shared.followers).await;
        assert_eq!(
            statements_sent(&metrics, "watch"),
            0,
            "it died before it read"
        );
        assert!(feed.shared.window.borrow().is_none());
        let second = feed.follow();
        sent(&metrics, "watch").await;
        assert!(feed.shared.followers.running(), "it reads for both");
        drop((first, second));
    }
}
