//! Group commit: changes that reach the gateway while an INSERT is on its
//! way go out together in the next one, as Postgres commits and etcd
//! proposals do. There is no timer: a lone change goes out at once, and
//! under load each INSERT carries what arrived during the one before.
//!
//! The INSERTs run in a task of their own, so a client that hangs up
//! cancels nothing: a change handed over here is written or failed with
//! its batch, whole, and what the gateway remembers (`Memory`) is updated
//! either way. Each change carries what keeps it in order until then: its
//! id's writer lock (so two changes of one id never share a batch) and its
//! lock permit (a lease's end waits for it, see `locks::write`).
//!
//! A batch is one INSERT of at most `MAX_ROWS` rows and `MAX_BYTES` of
//! documents, far below the rows ClickHouse puts in one block
//! (`max_insert_block_size`, about a million), so it is written as one
//! block: all of it, or none. An import is never split.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedMutexGuard, oneshot};
use uuid::Uuid;

use super::memory::Memory;
use crate::domain::{Lease, Provenance, StateId, Version};
use crate::locks::Sending;
use crate::metrics::Metrics;
use crate::store::{
    HistoryStore, NewVersion, Operation, StateStore, StoreError, StoredRow, StoredState,
};

/// The most rows one INSERT carries.
const MAX_ROWS: usize = 1000;
/// The most bytes of documents one INSERT carries (the request body limit
/// by default: one import of that size goes alone).
const MAX_BYTES: usize = 16 << 20;

/// A change decided and ready to go out.
pub(super) struct Outgoing {
    pub id: StateId,
    pub version: Version,
    pub operation: Operation,
    /// Empty with history off, which records none.
    pub changed_streams: Vec<String>,
    /// Streams whose bookmarks the change moves backwards.
    pub regressed_streams: Vec<String>,
    /// The lease the write carries, when the id is locked.
    pub lease: Option<Lease>,
    /// The claim under which this gateway is the id's authority, if it is.
    pub claim: Option<Uuid>,
    /// The row and the state it writes.
    pub row: StoredRow,
    pub state: StoredState,
}

/// Where batches go: history (whose view carries the states along) or,
/// with history off, the state table.
pub(super) enum Target {
    History(HistoryStore),
    States(StateStore),
}

/// One write's changes (one, or an import's) and what keeps them in order.
pub(super) struct Submission {
    pub changes: Vec<Outgoing>,
    pub provenance: Provenance,
    pub sending: Sending,
    /// The writer locks of the changes' ids, released once they have
    /// landed or failed.
    pub writing: Vec<OwnedMutexGuard<()>>,
}

type Answer = Result<Vec<StoredState>, Arc<StoreError>>;

struct Entry {
    submission: Submission,
    answer: oneshot::Sender<Answer>,
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
        self.submission.changes.iter().map(|c| c.row.size()).sum()
    }
}

pub(super) struct GroupCommit {
    target: Target,
    memory: Arc<Memory>,
    metrics: Arc<Metrics>,
    /// Submissions waiting for the next INSERT, and whether a task is
    /// sending; held only to push or take, never across an `.await`.
    queue: Mutex<Queue>,
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Entry>,
    sending: bool,
}

impl GroupCommit {
    pub fn new(target: Target, memory: Arc<Memory>, metrics: Arc<Metrics>) -> Self {
        Self {
            target,
            memory,
            metrics,
            queue: Mutex::default(),
        }
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands `submission` over and waits for the INSERT that carries it;
    /// answers the states written, in the order of its changes.
    pub async fn commit(
        self: &Arc<Self>,
        submission: Submission,
    ) -> Result<Vec<StoredState>, StoreError> {
        let (answer, answered) = oneshot::channel();
        let start = {
            let mut queue = self.queue();
            queue.waiting.push_back(Entry { submission, answer });
            !std::mem::replace(&mut queue.sending, true)
        };
        if start {
            tokio::spawn(self.clone().send_all());
        }
        match answered.await {
            Ok(answer) => answer.map_err(StoreError::InBatch),
            // The task was stopped with the runtime (a shutdown).
            Err(_) => Err(StoreError::Abandoned),
        }
    }

    /// Sends batches until none is waiting.
    async fn send_all(self: Arc<Self>) {
        let mut stopped = Stopped {
            commits: &self,
            armed: true,
        };
        loop {
            let batch = {
                let mut queue = self.queue();
                if queue.waiting.is_empty() {
                    // Under the same lock as the look: a submission after it
                    // finds no task and starts one.
                    queue.sending = false;
                    stopped.armed = false;
                    return;
                }
                take_batch(&mut queue.waiting)
            };
            self.send(batch).await;
        }
    }

    async fn send(&self, batch: Vec<Entry>) {
        let now = Instant::now();
        let mut permits = Vec::with_capacity(batch.len());
        let mut parts = Vec::with_capacity(batch.len());
        for entry in batch {
            let Submission {
                changes,
                provenance,
                sending,
                writing,
            } = entry.submission;
            // Its budget ran out while it waited: it fails alone, unsent.
            if sending.until() <= now {
                let _ = entry
                    .answer
                    .send(Err(Arc::new(StoreError::Timeout(Duration::ZERO))));
                continue;
            }
            permits.push(sending);
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
        let sent = Sending::join(permits).run(self.insert(&parts)).await;
        self.metrics.observe_write_batch(rows);
        match sent {
            Ok(()) => {
                for Part {
                    changes,
                    writing,
                    answer,
                    ..
                } in parts
                {
                    let states = changes
                        .into_iter()
                        .map(|change| {
                            self.memory.forget_failed(&change.id);
                            match change.claim {
                                Some(claim) => {
                                    self.memory.keep(&change.id, claim, Some(change.row))
                                }
                                None => self.memory.forget(|known| *known == change.id),
                            }
                            change.state
                        })
                        .collect();
                    let _ = answer.send(Ok(states));
                    drop(writing);
                }
            }
            Err(err) => {
                let err = Arc::new(err);
                for Part {
                    changes,
                    writing,
                    answer,
                    ..
                } in parts
                {
                    for change in &changes {
                        self.memory.remember_failed(&change.id, change.version);
                    }
                    let _ = answer.send(Err(err.clone()));
                    drop(writing);
                }
            }
        }
    }

    /// One INSERT of every change of the batch.
    async fn insert(&self, parts: &[Part]) -> Result<(), StoreError> {
        match &self.target {
            Target::History(history) => {
                let versions: Vec<NewVersion<'_>> = parts
                    .iter()
                    .flat_map(|part| {
                        part.changes.iter().map(|change| NewVersion {
                            id: &change.id,
                            version: change.version,
                            operation: change.operation,
                            doc: Some(&change.state.doc),
                            changed_streams: change.changed_streams.clone(),
                            regressed_streams: change.regressed_streams.clone(),
                            lease: change.lease.as_ref(),
                            provenance: &part.provenance,
                        })
                    })
                    .collect();
                history.record_many(&versions).await
            }
            Target::States(store) => {
                let rows: Vec<StoredRow> = parts
                    .iter()
                    .flat_map(|part| part.changes.iter().map(|c| c.row.clone()))
                    .collect();
                store.put(&rows).await
            }
        }
    }
}

/// Marks the sending task gone when it is stopped midway (a shutdown, a
/// panic), so that the next submission starts another rather than waiting
/// for one that will not come.
struct Stopped<'a> {
    commits: &'a GroupCommit,
    armed: bool,
}

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.commits.queue().sending = false;
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
