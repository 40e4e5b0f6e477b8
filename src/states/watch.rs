//! Waiting on one state (a long-poll): who waits on which id, and how they
//! hear of a change.
//!
//! A change through this gateway wakes the waiters of its id at once (the
//! one commit path calls [`Watches::changed`]). A change through another
//! gateway, or a row another writer INSERTed, is found by one poller task
//! per gateway: it runs only while someone waits and, twice a second, reads
//! the current version of every id waited on in one statement (a few only
//! when the ids are very long, see [`POLL_BYTES`]), so watching costs
//! ClickHouse two statements a second whatever the number of waiters. While
//! the change feed's poller runs (someone follows the feed), its reads wake
//! the waiters instead and the two share its statement. A waiter whose
//! known version differs from what the poller read is woken. A wake is only
//! a hint: the waiter reads the state again and decides for itself whether
//! it changed.
//!
//! As in mini-redis's `db.rs`, the handle ([`Watches`]), the state it
//! shares ([`Shared`], its registry in a [`Worker`], under a std mutex never
//! held across an `.await`) and the background task ([`poll`]) are kept
//! apart. Waiters are woken after the registry's lock is released.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::{Notify, watch};

use super::feed::{Feed, POLL_EVERY};
use crate::domain::StateId;
use crate::metrics::Metrics;
use crate::store::StateStore;
use crate::worker::{Running, Worker};

/// The most bytes of ids one poll statement names: the ids travel in the
/// URL, and ClickHouse refuses one longer than `http_max_uri_size` (1 MiB by
/// default) once percent-encoded. Ids of usual length fit a thousand
/// waiters in one statement; only very long ones take a second.
const POLL_BYTES: usize = 256 << 10;

/// The version a waiter last read of its id: `None` when the state did not
/// exist, else its `updated_at` in milliseconds.
pub type Known = Option<i64>;

/// The waiters of this gateway; cheap to clone.
#[derive(Clone)]
pub struct Watches {
    shared: Arc<Shared>,
}

/// What the handle, the waiters' guards and the poller share.
struct Shared {
    /// Who waits on what, and the poller that runs while anyone does.
    registry: Worker<Registry>,
    /// Where the poller reads versions.
    store: StateStore,
    /// Turns true once, when the gateway stops: every waiter answers then.
    closed: watch::Sender<bool>,
    /// Counts the waiters (`statehouse_watchers`).
    metrics: Arc<Metrics>,
    /// Told of every local change too, so its followers hear at once.
    feed: Feed,
}

/// Who waits on which id. Pure bookkeeping, no I/O, so its rules are unit
/// tested on their own.
#[derive(Default)]
struct Registry {
    /// The waiters of each id; an id leaves with its last waiter.
    ids: HashMap<StateId, Vec<Waiter>>,
    /// The key of the next waiter, unique for the gateway's life.
    next_key: u64,
}

/// One waiting request.
struct Waiter {
    /// Tells it apart from the other waiters of its id.
    key: u64,
    /// What it last read; `None` until it has read, so the poller does not
    /// wake it against a version it never saw.
    known: Option<Known>,
    /// Woken on a change; a wake before it waits is kept (a permit), so a
    /// change between its read and its wait is never lost.
    wake: Arc<Notify>,
}

impl Registry {
    /// Adds a waiter on `id`; answers its key and wake.
    fn add(&mut self, id: &StateId) -> (u64, Arc<Notify>) {
        let key = self.next_key;
        self.next_key += 1;
        let wake = Arc::new(Notify::new());
        self.ids.entry(id.clone()).or_default().push(Waiter {
            key,
            known: None,
            wake: wake.clone(),
        });
        (key, wake)
    }

    fn remove(&mut self, id: &StateId, key: u64) {
        if let Some(waiters) = self.ids.get_mut(id) {
            waiters.retain(|w| w.key != key);
            if waiters.is_empty() {
                self.ids.remove(id);
            }
        }
    }

    fn set_known(&mut self, id: &StateId, key: u64, known: Known) {
        let waiter = self
            .ids
            .get_mut(id)
            .and_then(|waiters| waiters.iter_mut().find(|w| w.key == key));
        if let Some(waiter) = waiter {
            waiter.known = Some(known);
        }
    }

    /// Every waiter of `id`, to wake (a change through this gateway).
    fn waiters_of<'a>(&'a self, id: &StateId) -> impl Iterator<Item = Arc<Notify>> + 'a {
        self.ids
            .get(id)
            .into_iter()
            .flatten()
            .map(|waiter| waiter.wake.clone())
    }

    /// The ids to read: those with a waiter that knows what it read. None
    /// when no one waits at all: the poller stops.
    fn ids_to_poll(&self) -> Option<Vec<StateId>> {
        if self.ids.is_empty() {
            return None;
        }
        let ids = self
            .ids
            .iter()
            .filter(|(_, waiters)| waiters.iter().any(|w| w.known.is_some()))
            .map(|(id, _)| id.clone())
            .collect();
        Some(ids)
    }

    /// What the poller read of `polled` (`found`: the versions of those that
    /// exist): the waiters to wake, each whose known version is not the
    /// current one.
    fn observed(&self, polled: &[StateId], found: &HashMap<StateId, i64>) -> Vec<Arc<Notify>> {
        polled
            .iter()
            .flat_map(|id| self.moved(id, found.get(id).copied()))
            .collect()
    }

    /// What the feed's poller read (`seen`: the ids changed lately, each
    /// with its version, None when gone): the waiters to wake, each of one
    /// of them whose known version is not that one; an id not seen has not
    /// moved.
    fn observed_changes(
        &self,
        polled: &[StateId],
        seen: &HashMap<StateId, Option<i64>>,
    ) -> Vec<Arc<Notify>> {
        polled
            .iter()
            .filter_map(|id| Some(self.moved(id, *seen.get(id)?)))
            .flatten()
            .collect()
    }

    /// The waiters of `id` that read another version than `current`.
    fn moved<'a>(&'a self, id: &StateId, current: Known) -> impl Iterator<Item = Arc<Notify>> + 'a {
        self.ids
            .get(id)
            .into_iter()
            .flatten()
            .filter(move |waiter| waiter.known.is_some_and(|known| known != current))
            .map(|waiter| waiter.wake.clone())
    }
}

/// Wakes `waiters`, once the registry's lock is released: a woken waiter
/// that runs at once on another thread does not find it held.
fn wake(waiters: impl IntoIterator<Item = Arc<Notify>>) {
    for waiter in waiters {
        waiter.notify_one();
    }
}

impl Watches {
    pub fn new(store: StateStore, metrics: Arc<Metrics>, feed: Feed) -> Self {
        Self {
            shared: Arc::new(Shared {
                registry: Worker::new(Registry::default()),
                store,
                metrics,
                feed,
                closed: watch::channel(false).0,
            }),
        }
    }

    /// Starts waiting on `id`: from now on, no change of it is missed. Read
    /// the state after this, then tell the guard what was read.
    pub fn watch(&self, id: &StateId) -> Watching {
        let ((key, wake), _) = self.shared.registry.add(
            |registry| registry.add(id),
            |running| poll(self.shared.clone(), running),
        );
        self.shared.metrics.long_polls(1);
        Watching {
            shared: self.shared.clone(),
            id: id.clone(),
            key,
            wake,
            closed: self.shared.closed.subscribe(),
        }
    }

    /// `ids` changed through this gateway (or may have: a write whose
    /// outcome is unknown): their waiters look again at once, and the feed
    /// reads at once.
    pub fn changed<'a>(&self, ids: impl IntoIterator<Item = &'a StateId>) {
        self.shared.feed.poke();
        let waiters: Vec<Arc<Notify>> = {
            let registry = self.shared.registry.lock();
            if registry.ids.is_empty() {
                return;
            }
            ids.into_iter()
                .flat_map(|id| registry.waiters_of(id))
                .collect()
        };
        wake(waiters);
    }

    /// The gateway stops: every waiter answers now, and so does every one
    /// that comes after.
    pub fn close(&self) {
        self.shared.closed.send_replace(true);
        self.shared.feed.close();
    }
}

/// One waiting request's place; it leaves the registry when dropped
/// (answered, or the client hung up).
pub struct Watching {
    shared: Arc<Shared>,
    id: StateId,
    key: u64,
    wake: Arc<Notify>,
    /// The gateway's stop, seen from here.
    closed: watch::Receiver<bool>,
}

/// Why a wait ended.
#[derive(Debug, PartialEq, Eq)]
pub enum WaitEnd {
    /// The id may have changed: read it again.
    Changed,
    /// The gateway stops: answer with what is known now.
    Closing,
}

impl Watching {
    /// What the waiter read of its id, for the poller to compare with.
    pub fn read(&self, known: Known) {
        self.shared
            .registry
            .lock()
            .set_known(&self.id, self.key, known);
    }

    /// Until the id may have changed or the gateway stops. The caller bounds
    /// it with its deadline.
    pub async fn next(&mut self) -> WaitEnd {
        if *self.closed.borrow() {
            return WaitEnd::Closing;
        }
        tokio::select! {
            () = self.wake.notified() => WaitEnd::Changed,
            _ = self.closed.wait_for(|closed| *closed) => WaitEnd::Closing,
        }
    }

    /// Whether the gateway stops.
    pub fn closing(&self) -> bool {
        *self.closed.borrow()
    }
}

impl Drop for Watching {
    fn drop(&mut self) {
        self.shared.registry.lock().remove(&self.id, self.key);
        self.shared.metrics.long_polls(-1);
    }
}

/// The poller, while anyone waits: twice a second, one read of the versions
/// of every id waited on. While the feed's poller runs, its reads, which see
/// every change, wake the waiters instead, so the two cost one statement. A
/// failed read is logged and tried again at the next tick: the waiters keep
/// waiting until their deadlines.
async fn poll(shared: Arc<Shared>, mut running: Running<Registry>) {
    let mut tick = tokio::time::interval(POLL_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut feed = shared.feed.reads();
    // The first tick is at once; the waiter that started this has not read yet.
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = feed.changed() => {}
        }
        let Some(ids) = running.next(|registry| registry.ids_to_poll()) else {
            return;
        };
        if ids.is_empty() {
            continue;
        }
        if let Some(seen) = feed.versions() {
            let moved = shared.registry.lock().observed_changes(&ids, &seen);
            wake(moved);
            continue;
        }
        for ids in statements(&ids) {
            match shared.store.versions(ids).await {
                Ok(found) => {
                    let found: HashMap<StateId, i64> = found.into_iter().collect();
                    let moved = shared.registry.lock().observed(ids, &found);
                    wake(moved);
                }
                Err(err) => {
                    tracing::warn!(error = %err, ids = ids.len(), "watch: reading the versions of watched states failed; trying again");
                }
            }
        }
    }
}

/// `ids` cut into runs of at most [`POLL_BYTES`] of names (at least one id
/// each): one run, one statement.
fn statements(ids: &[StateId]) -> Vec<&[StateId]> {
    let mut runs = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (index, id) in ids.iter().enumerate() {
        let more = id.as_str().len();
        if index > start && bytes + more > POLL_BYTES {
            runs.push(&ids[start..index]);
            (start, bytes) = (index, 0);
        }
        bytes += more;
    }
    if start < ids.len() {
        runs.push(&ids[start..]);
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::super::feed::tests::{nowhere, sent, statements_sent, stopped};
    use super::*;

    fn id(name: &str) -> StateId {
        StateId::parse(name.to_owned()).unwrap()
    }

    /// Whether `wake` holds a wake: polled once, without waiting.
    fn woken(wake: &Notify) -> bool {
        use std::future::Future;
        let notified = std::pin::pin!(wake.notified());
        let waker = std::task::Waker::noop();
        notified
            .poll(&mut std::task::Context::from_waker(waker))
            .is_ready()
    }

    #[test]
    fn the_poller_has_work_while_anyone_waits() {
        let mut registry = Registry::default();
        assert_eq!(registry.ids_to_poll(), None);
        let (a, _) = registry.add(&id("a"));
        let (b, _) = registry.add(&id("a"));
        registry.remove(&id("a"), a);
        assert_eq!(
            registry.ids_to_poll(),
            Some(vec![]),
            "b waits, but has not read yet"
        );
        registry.remove(&id("a"), b);
        assert_eq!(registry.ids_to_poll(), None, "the poller stops");
    }

    #[test]
    fn the_poller_reads_every_id_once_and_wakes_only_the_waiters_it_moved_past() {
        let mut registry = Registry::default();
        let (a1, wake_a1) = registry.add(&id("a"));
        let (a2, wake_a2) = registry.add(&id("a"));
        let (b, wake_b) = registry.add(&id("b"));
        let (_, wake_c) = registry.add(&id("c"));
        registry.set_known(&id("a"), a1, Some(10));
        registry.set_known(&id("a"), a2, Some(20));
        registry.set_known(&id("b"), b, None);
        let mut polled = registry.ids_to_poll().unwrap();
        polled.sort();
        assert_eq!(polled, vec![id("a"), id("b")], "c has not read yet");
        let found = HashMap::from([(id("a"), 20)]);
        let moved = registry.observed(&polled, &found);
        assert_eq!(moved.len(), 1);
        wake(moved);
        assert!(woken(&wake_a1), "a moved past what a1 read");
        assert!(!woken(&wake_a2), "a2 read the current version");
        assert!(!woken(&wake_b), "b is still absent");
        assert!(!woken(&wake_c));
        let created = HashMap::from([(id("a"), 20), (id("b"), 5)]);
        wake(registry.observed(&polled, &created));
        assert!(woken(&wake_b), "b was created");
        let deleted = HashMap::new();
        wake(registry.observed(&polled, &deleted));
        assert!(woken(&wake_a2), "a was deleted");
    }

    #[test]
    fn the_feeds_reads_wake_only_the_waiters_of_ids_it_saw_move() {
        let mut registry = Registry::default();
        let (a, wake_a) = registry.add(&id("a"));
        let (b, wake_b) = registry.add(&id("b"));
        let (c, wake_c) = registry.add(&id("c"));
        registry.set_known(&id("a"), a, Some(10));
        registry.set_known(&id("b"), b, Some(10));
        registry.set_known(&id("c"), c, None);
        let polled = [id("a"), id("b"), id("c")];
        let seen = HashMap::from([(id("a"), Some(10)), (id("b"), None), (id("c"), Some(3))]);
        let moved = registry.observed_changes(&polled, &seen);
        assert_eq!(moved.len(), 2);
        wake(moved);
        assert!(!woken(&wake_a), "a is where its waiter read it");
        assert!(woken(&wake_b), "b was deleted");
        assert!(woken(&wake_c), "c was created");
        let (d, wake_d) = registry.add(&id("d"));
        registry.set_known(&id("d"), d, Some(1));
        assert!(registry.observed_changes(&[id("d")], &seen).is_empty());
        assert!(!woken(&wake_d), "an id the feed did not see has not moved");
    }

    #[test]
    fn a_local_change_wakes_every_waiter_of_its_id_even_before_it_waits() {
        let mut registry = Registry::default();
        let (_, wake_a) = registry.add(&id("a"));
        let (_, wake_b) = registry.add(&id("b"));
        wake(registry.waiters_of(&id("a")));
        assert!(woken(&wake_a), "kept as a permit until the waiter waits");
        assert!(!woken(&wake_b));
    }

    #[test]
    fn ids_of_usual_length_are_polled_in_one_statement() {
        let usual: Vec<StateId> = (0..1024)
            .map(|n| id(&format!("prod:tap-postgres-to-target-snowflake-{n:04}")))
            .collect();
        assert_eq!(statements(&usual), vec![&usual[..]]);
        assert!(statements(&[]).is_empty());
        let long: Vec<StateId> = (0..1024)
            .map(|n| id(&format!("{n:04}{}", "x".repeat(896))))
            .collect();
        let runs = statements(&long);
        assert_eq!(runs.len(), 4, "900 bytes each: 291 ids a statement");
        assert_eq!(runs.iter().map(|run| run.len()).sum::<usize>(), 1024);
        assert!(runs.iter().all(|run| run.len() * 900 <= POLL_BYTES));
    }

    #[test]
    fn a_waiter_that_left_is_not_polled_for() {
        let mut registry = Registry::default();
        let (a, _) = registry.add(&id("a"));
        registry.set_known(&id("a"), a, Some(1));
        registry.remove(&id("a"), a);
        registry.set_known(&id("a"), a, Some(2));
        assert!(registry.ids.is_empty());
    }

    #[tokio::test]
    async fn a_poller_that_dies_is_replaced_for_the_next_waiter() {
        let metrics = Arc::new(Metrics::default());
        let (_, store) = nowhere(&metrics);
        let feed = Feed::new(store.changes, metrics.clone());
        let watches = Watches::new(store.states, metrics.clone(), feed);
        watches.shared.registry.fail_next_task();
        let first = watches.watch(&id("a"));
        first.read(Some(1));
        stopped(&watches.shared.registry).await;
        assert_eq!(
            statements_sent(&metrics, "watch"),
            0,
            "it died before it read"
        );
        let second = watches.watch(&id("b"));
        second.read(Some(1));
        sent(&metrics, "watch").await;
        assert!(watches.shared.registry.running(), "it reads for both");
    }
}
