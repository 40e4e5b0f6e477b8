//! Group commit: changes that reach the gateway while an INSERT is on its
//! way go out together in the next one, as Postgres commits and etcd
//! proposals do. A lone change goes out at once, and under load each INSERT
//! carries what arrived during the one before.
//!
//! After a batch of several requests, the next one waits a moment for as
//! many to come back (`gather`): their writers were answered together and
//! send their next changes together, and without the wait the first of them
//! would go out alone, the rest in the INSERT after, halving every batch.
//! The wait is bounded by a quarter of the INSERT before, and by
//! `GATHER_AT_MOST`: it waits for the writers' round trip, which a slow
//! ClickHouse does not lengthen, so behind a 4 s INSERT whose writers have
//! gone it costs 10 ms, not a second.
//!
//! This is the one door of every change (PUT, PATCH, DELETE, rollback,
//! stream reset, bulk import): each is a submission here, and a batch is
//! admitted by the lock rule as it goes out (`locks::write`). A submission
//! whose lease ended while it queued is refused (409) and never sent; the
//! others' budget starts then, not when they queued.
//!
//! The INSERTs run in a task of their own, so a client that hangs up
//! cancels nothing: a change handed over here is written or failed with
//! its batch, whole, and what the gateway remembers (`Memory`) is updated
//! either way. Each change carries what keeps it in order until then: its
//! id's writer lock (so two changes of one id never share a batch) and its
//! admission (once sent, a lease's end waits for it).
//!
//! A batch's deletes go out after its INSERT, as one `DELETE ... IN`, under
//! the same permit: their tombstones are in the INSERT.
//!
//! The INSERT checks, in the same statement, that each id a change was
//! decided against still has the stored version it was read at (see
//! `store::checked_insert`): when another writer wrote one meanwhile,
//! ClickHouse refuses the whole batch, and each of its submissions is
//! answered `Stale`, to be decided again against the stored row.
//!
//! A batch is one INSERT of at most `MAX_ROWS` rows and `MAX_BYTES` of
//! documents, far below the rows ClickHouse puts in one block
//! (`max_insert_block_size`, about a million), so it is written as one
//! block: all of it, or none. An import is never split.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, OwnedMutexGuard, oneshot};
use tokio::time::Instant;
use tracing::Instrument;
use uuid::Uuid;

use super::memory::Memory;
use super::prepare::Prepared;
use super::watch::Watches;
use crate::domain::{Lease, Provenance, StateId, Version};
use crate::locks::{Admitted, LockError, Sending};
use crate::metrics::Metrics;
use crate::store::{
    ChangesStore, Expected, HistoryStore, NewVersion, StateStore, StoreError, StoredRow,
    StoredState,
};
use crate::traces::{self, Caller};
use crate::worker::{Running, Worker};

/// The most rows one INSERT carries.
const MAX_ROWS: usize = 1000;
/// The longest a batch waits for the writers of the batch before: their
/// round trip (answer, next request), a few milliseconds on a busy
/// 2-core machine through a Python client.
const GATHER_AT_MOST: Duration = Duration::from_millis(10);
/// The most bytes of documents one INSERT carries (the request body limit
/// by default: one import of that size goes alone).
const MAX_BYTES: usize = 16 << 20;

/// A change decided and ready to go out.
pub(super) struct Outgoing {
    pub id: StateId,
    pub prepared: Prepared,
    /// The lease the write carries, when the id is locked.
    pub lease: Option<Lease>,
    /// The claim under which this gateway is the id's authority, if it is.
    pub claim: Option<Uuid>,
    /// The id's stored version the change was decided against (None: it
    /// had no row), which its INSERT checks; None when nothing is checked
    /// (an import's entries, deletes).
    pub checked: Option<Option<i64>>,
}

impl Outgoing {
    fn row(&self) -> Option<&StoredRow> {
        self.prepared.written.as_ref().map(|(row, _)| row)
    }
}

/// Where batches go: history (whose view carries the states along) or,
/// with history off (None), the state table. Deletes go to the state table.
pub(super) struct Target {
    pub history: Option<HistoryStore>,
    pub states: StateStore,
    /// Where deletes go with history off, for the change feed.
    pub changes: ChangesStore,
}

/// One request's changes (one, or an import's) and what keeps them in order.
pub(super) struct Submission {
    pub changes: Vec<Outgoing>,
    /// Each change's admission, in the same order, checked again as the
    /// batch goes out.
    pub admitted: Vec<Admitted>,
    pub provenance: Provenance,
    /// The writer locks of the changes' ids, released once they have
    /// landed or failed.
    pub writing: Vec<OwnedMutexGuard<()>>,
}

/// Why a submission was not written.
pub(super) enum CommitError {
    /// Its change at this index lost its lease (or the id its authority)
    /// while it queued: nothing of it was sent.
    Refused(usize, LockError),
    /// Its batch failed, or its outcome is unknown (a timeout).
    Store(Arc<StoreError>),
    /// ClickHouse refused its batch, which landed in no part: a state the
    /// batch checked was not the one its change was decided against.
    Stale,
}

/// Each change's state as written, None for a delete.
type Answer = Result<Vec<Option<StoredState>>, CommitError>;

struct Entry {
    submission: Submission,
    answer: oneshot::Sender<Answer>,
    /// The span of the request that submitted it: the batch's links to it.
    caller: Caller,
}

/// A submission in a batch being sent: its permit is the batch's now.
struct Part {
    changes: Vec<Outgoing>,
    provenance: Provenance,
    writing: Vec<OwnedMutexGuard<()>>,
    answer: oneshot::Sender<Answer>,
}

impl Entry {
    fn rows(&self) -> usize {
        self.submission.changes.len()
    }

    fn bytes(&self) -> usize {
        self.submission
            .changes
            .iter()
            .filter_map(Outgoing::row)
            .map(StoredRow::size)
            .sum()
    }
}

pub(super) struct GroupCommit {
    target: Target,
    memory: Arc<Memory>,
    metrics: Arc<Metrics>,
    /// Told of every id a batch wrote, or may have written.
    watches: Watches,
    /// Submissions waiting for the next INSERT, and the task sending them
    /// while any wait.
    queue: Worker<VecDeque<Entry>>,
    /// Told of every submission, for the sending task's `gather`.
    arrived: Notify,
}

impl GroupCommit {
    pub fn new(
        target: Target,
        memory: Arc<Memory>,
        metrics: Arc<Metrics>,
        watches: Watches,
    ) -> Self {
        Self {
            target,
            memory,
            metrics,
            watches,
            queue: Worker::new(VecDeque::new()),
            arrived: Notify::new(),
        }
    }

    /// Hands `submission` over and waits for the batch that carries it;
    /// answers the states written, in the order of its changes.
    pub async fn commit(self: &Arc<Self>, submission: Submission) -> Answer {
        let (answer, answered) = oneshot::channel();
        let entry = Entry {
            submission,
            answer,
            caller: Caller::current(),
        };
        let ((), started) = self.queue.add(
            |waiting| waiting.push_back(entry),
            |running| self.clone().send_all(running),
        );
        if !started {
            self.arrived.notify_waiters();
        }
        // An error here: the task was stopped with the runtime (a shutdown)
        // or died holding the batch.
        answered
            .await
            .unwrap_or_else(|_| Err(CommitError::Store(Arc::new(StoreError::Abandoned))))
    }

    /// Sends batches until none is waiting.
    async fn send_all(self: Arc<Self>, mut running: Running<VecDeque<Entry>>) {
        // The requests of the batch before, and how long its INSERT took.
        let mut before: Option<(usize, Duration)> = None;
        loop {
            if let Some((requests, took)) = before.filter(|(requests, _)| *requests > 1) {
                self.gather(requests, Instant::now() + (took / 4).min(GATHER_AT_MOST))
                    .await;
            }
            let Some(batch) =
                running.next(|waiting| (!waiting.is_empty()).then(|| take_batch(waiting)))
            else {
                return;
            };
            let (requests, started) = (batch.len(), Instant::now());
            self.send(batch).await;
            before = Some((requests, started.elapsed()));
        }
    }

    /// Waits until `requests` submissions are waiting, or until `deadline`.
    async fn gather(&self, requests: usize, deadline: Instant) {
        loop {
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            // Registered before the look: a submission after it wakes us.
            arrived.as_mut().enable();
            if self.queue.lock().len() >= requests {
                return;
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                return;
            }
        }
    }

    async fn send(&self, batch: Vec<Entry>) {
        // One INSERT for every request of the batch: its span is in no
        // request's trace, and links to each.
        let span = traces::batch_span(
            || tracing::info_span!(parent: None, "group_commit", requests = batch.len()),
            batch.iter().map(|entry| &entry.caller),
        );
        let mut permits = Vec::with_capacity(batch.len());
        let mut parts = Vec::with_capacity(batch.len());
        for entry in batch {
            let Submission {
                changes,
                admitted,
                provenance,
                writing,
            } = entry.submission;
            // Admitted again as it goes out; refused alone, unsent.
            match Sending::all(&admitted) {
                Ok(permit) => permits.push(permit),
                Err((index, err)) => {
                    let _ = entry.answer.send(Err(CommitError::Refused(index, err)));
                    continue;
                }
            }
            parts.push(Part {
                changes,
                provenance,
                writing,
                answer: entry.answer,
            });
        }
        if parts.is_empty() {
            return;
        }
        let rows: usize = parts.iter().map(|part| part.changes.len()).sum();
        let mut permit = Sending::join(permits);
        let sent = permit.run(self.write(&parts)).instrument(span).await;
        self.metrics.observe_write_batch(rows);
        // What this gateway remembers of the batch's ids is stale now (the
        // writes landed, or may have), and goes before the permit: dropped,
        // the permit lets the next lease on an id be granted, and its holder
        // may read here at once. Such a read finds nothing remembered and
        // waits for the id's writer lock, held until its change is settled
        // below; the state from before the write is never served to it.
        let ids: Vec<StateId> = parts
            .iter()
            .flat_map(|part| part.changes.iter().map(|change| change.id.clone()))
            .collect();
        self.memory.forget_each(&ids);
        drop(permit);
        match sent {
            Ok(()) => {
                for part in parts {
                    let states = part
                        .changes
                        .into_iter()
                        .map(|change| self.landed(change))
                        .collect();
                    let _ = part.answer.send(Ok(states));
                    drop(part.writing);
                }
            }
            Err(StoreError::Stale) => {
                self.metrics.stale_write();
                for part in parts {
                    let _ = part.answer.send(Err(CommitError::Stale));
                    drop(part.writing);
                }
            }
            Err(err) => {
                let err = Arc::new(err);
                for part in parts {
                    for change in &part.changes {
                        // It may land yet: the next write stamps a later
                        // version, and the id is read afresh from ClickHouse.
                        self.memory
                            .remember_failed(&change.id, change.prepared.version);
                    }
                    let _ = part.answer.send(Err(CommitError::Store(err.clone())));
                    drop(part.writing);
                }
            }
        }
        // Once settled: a woken waiter reads what the batch left. A failed
        // batch may have landed all the same, so its ids are told too.
        self.watches.changed(&ids);
    }

    /// What the gateway remembers of a change that landed; its state.
    fn landed(&self, change: Outgoing) -> Option<StoredState> {
        self.memory.forget_failed(&change.id);
        let (row, state) = change.prepared.written.unzip();
        match change.claim {
            Some(claim) => self.memory.keep(&change.id, claim, row),
            None => self.memory.forget_each([&change.id]),
        }
        state
    }

    /// One INSERT of every change of the batch, then one DELETE of the
    /// states it deletes.
    async fn write(&self, parts: &[Part]) -> Result<(), StoreError> {
        let changes = || parts.iter().flat_map(|part| part.changes.iter());
        let deleted: Vec<StateId> = changes()
            .filter(|change| change.row().is_none())
            .map(|change| change.id.clone())
            .collect();
        let expected: Vec<Expected<'_>> = changes()
            .filter(|change| change.row().is_some())
            .filter_map(|change| {
                change.checked.map(|version_ms| Expected {
                    id: &change.id,
                    version_ms,
                })
            })
            .collect();
        let Target {
            history,
            states,
            changes: feed,
        } = &self.target;
        match history {
            Some(history) => {
                let versions: Vec<NewVersion<'_>> = parts
                    .iter()
                    .flat_map(|part| {
                        part.changes.iter().map(|change| NewVersion {
                            id: &change.id,
                            version: change.prepared.version,
                            operation: change.prepared.operation,
                            doc: change.prepared.written.as_ref().map(|(_, s)| &s.doc),
                            changed_streams: change.prepared.changed_streams.clone(),
                            regressed_streams: change.prepared.regressed_streams.clone(),
                            lost_streams: change.prepared.lost_streams.clone(),
                            lease: change.lease.as_ref(),
                            provenance: &part.provenance,
                            restored_from: change.prepared.restored_from,
                        })
                    })
                    .collect();
                history.record_many(&versions, &expected).await?;
                if !deleted.is_empty() {
                    states.delete_many(&deleted).await?;
                }
                Ok(())
            }
            None => {
                let rows: Vec<StoredRow> = changes().filter_map(Outgoing::row).cloned().collect();
                if !rows.is_empty() {
                    states.put(&rows, &expected).await?;
                }
                if !deleted.is_empty() {
                    states.delete_many(&deleted).await?;
                    // No history tombstone tells the feed: the gateway does.
                    let tombstones: Vec<(StateId, Version)> = changes()
                        .filter(|change| change.row().is_none())
                        .map(|change| (change.id.clone(), change.prepared.version))
                        .collect();
                    feed.record_tombstones(&tombstones).await?;
                }
                Ok(())
            }
        }
    }
}

/// The next batch: submissions first come, first served, up to the limits,
/// and at least one whatever its size.
fn take_batch(waiting: &mut VecDeque<Entry>) -> Vec<Entry> {
    let (mut rows, mut bytes) = (0, 0);
    let mut batch = Vec::new();
    while let Some(next) = waiting.front() {
        let (more_rows, more_bytes) = (next.rows(), next.bytes());
        if !batch.is_empty() && (rows + more_rows > MAX_ROWS || bytes + more_bytes > MAX_BYTES) {
            break;
        }
        rows += more_rows;
        bytes += more_bytes;
        batch.extend(waiting.pop_front());
    }
    batch
}

#[cfg(test)]
mod tests {
    use super::super::feed::Feed;
    use super::super::feed::tests::{counted, nowhere, surely};
    use super::*;
    use crate::locks::LockManager;

    /// A submission of no change: its batch sends no statement, and with no
    /// admission it has no budget, so it is answered as timed out at once.
    fn nothing() -> Submission {
        Submission {
            changes: Vec::new(),
            admitted: Vec::new(),
            provenance: Provenance::default(),
            writing: Vec::new(),
        }
    }

    #[tokio::test]
    async fn a_sending_task_that_dies_is_replaced_for_the_next_submission() {
        let metrics = Arc::new(Metrics::default());
        let (config, store) = nowhere(&metrics);
        let locks = LockManager::new(
            config.locks,
            config.query_timeout,
            store.leases,
            store.claims,
            metrics.clone(),
        );
        let feed = Feed::new(store.changes.clone(), metrics.clone());
        let watches = Watches::new(store.states.clone(), metrics.clone(), feed);
        let target = Target {
            history: None,
            states: store.states,
            changes: store.changes,
        };
        let memory = Arc::new(Memory::new(false, Arc::new(locks)));
        let commits = Arc::new(GroupCommit::new(target, memory, metrics.clone(), watches));
        let batches = || counted(&metrics, "statehouse_write_batch_rows_count");
        commits.queue.fail_next_task();
        let died = commits.commit(nothing()).await;
        assert!(
            matches!(&died, Err(CommitError::Store(err)) if matches!(**err, StoreError::Abandoned)),
            "its task died holding it"
        );
        assert_eq!(batches(), 0);
        let served = surely("served", commits.commit(nothing())).await;
        assert!(
            matches!(&served, Err(CommitError::Store(err)) if matches!(**err, StoreError::Timeout(_))),
            "answered by its batch"
        );
        assert_eq!(batches(), 1, "sent by a fresh task");
    }
}
