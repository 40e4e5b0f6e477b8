//! State operations: the rules of the API on top of the store. Writes to one
//! state_id are serialized in this process, so a read-decide-write (If-Match,
//! PATCH's merge) sees no interleaved write from this gateway, and a write
//! checked against the lock cannot be overtaken by the next holder's.
//!
//! On the ids it is the authority for, a gateway keeps the state it last
//! read or wrote: every write to such an id comes through it (its peers
//! forward them), so its copy is current, and a Meltano STATE message (lock,
//! read, write, unlock) costs one ClickHouse round trip, the write's INSERT.

mod group_commit;
mod memory;

use std::collections::HashMap;
use std::sync::Arc;

use uuid::Uuid;

use self::group_commit::{GroupCommit, Outgoing, Submission, Target};
use self::memory::Memory;

use crate::domain::{
    AllowedRegressions, IfMatch, Lease, PageCursor, PageLimit, Provenance, Regression,
    RegressionMode, StateDocument, StateId, StatePattern, Version, VersionCursor, regressions,
};
use crate::keyed_mutex::KeyedMutex;
use crate::locks::{LockError, LockManager, SeenLease, Sending};
use crate::metrics::Metrics;
use crate::store::{
    ChangeContext, HistoryStore, Operation, Selection, StateStore, StateSummary, StoreError,
    StoredRow, StoredState, StoredVersion, VersionMeta, next_version, now_ms,
};

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    PreconditionFailed(&'static str),
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("no state with id {0:?}")]
    NotFound(String),
    #[error("the state has no bookmark for stream {0:?} in completed or partial")]
    NoBookmark(String),
    #[error("entry {index} (state_id {state_id:?}): {source}")]
    InBatch {
        index: usize,
        state_id: String,
        source: Box<StateError>,
    },
    #[error("entry {index}: state_id {state_id:?} is in the batch twice (first at entry {first})")]
    Duplicate {
        index: usize,
        first: usize,
        state_id: String,
    },
    #[error("{} went backwards (--bookmark-regression reject); send Statehouse-Allow-Regression naming the streams to write it anyway", .0.iter().map(|r| r.stream.as_str()).collect::<Vec<_>>().join(", "))]
    BookmarkRegression(Vec<Regression>),
    #[error("history is off on this gateway (--history=false), so no versions are kept")]
    HistoryOff,
    #[error("this state has no version {}", .0.to_rfc3339())]
    VersionNotFound(Version),
}

/// What a write does with the incoming document.
pub enum Change {
    /// Meltano `set`: the document replaces the state.
    Replace(StateDocument),
    /// Meltano `update`: see [`StateDocument::updated_by`]; a missing state is created.
    Update(StateDocument),
    /// Remove one stream's bookmark from both halves of an existing state.
    ResetStream(String),
}

/// What a batch write did.
pub struct Imported {
    pub written: usize,
    pub created: usize,
}

fn in_batch(index: usize, state_id: &str, source: StateError) -> StateError {
    StateError::InBatch {
        index,
        state_id: state_id.to_owned(),
        source: Box::new(source),
    }
}

pub struct Written {
    pub state: StoredState,
    pub created: bool,
    /// Streams whose bookmarks went backwards in it (`--bookmark-regression warn`).
    pub regressed: Vec<String>,
}

pub struct States {
    store: StateStore,
    /// None when history is off.
    history: Option<HistoryStore>,
    locks: Arc<LockManager>,
    /// One write of an id at a time on this gateway: its read-decide-write
    /// sees no other, and the lock stays with the change until it landed.
    writers: KeyedMutex<StateId>,
    memory: Arc<Memory>,
    commits: Arc<GroupCommit>,
    regression: RegressionMode,
    metrics: Arc<Metrics>,
}

/// What a write carries besides its document.
#[derive(Default)]
pub struct WriteConditions {
    pub if_match: Option<IfMatch>,
    /// The `Lease-Id` header: required while the state_id is locked.
    pub lease_id: Option<Uuid>,
    /// The lease ClickHouse records, as routing the request read it.
    pub seen_lease: Option<SeenLease>,
    /// `Statehouse-Allow-Regression`: streams whose bookmarks may go back.
    pub allow_regression: AllowedRegressions,
}

/// A state's history, as the API shows it.
pub struct HistoryPage {
    pub versions: Vec<ListedVersion>,
    pub has_more: bool,
}

pub struct ListedVersion {
    pub meta: VersionMeta,
    /// The version the state is at now: never one a failed change left.
    pub current: bool,
}

impl States {
    pub fn new(
        store: StateStore,
        history: Option<HistoryStore>,
        locks: Arc<LockManager>,
        metrics: Arc<Metrics>,
        regression: RegressionMode,
    ) -> Self {
        let memory = Arc::new(Memory::new(history.is_some(), locks.clone()));
        let target = match &history {
            Some(history) => Target::History(history.clone()),
            None => Target::States(store.clone()),
        };
        Self {
            commits: Arc::new(GroupCommit::new(target, memory.clone(), metrics.clone())),
            regression,
            metrics,
            store,
            history,
            locks,
            writers: KeyedMutex::default(),
            memory,
        }
    }

    pub async fn get(&self, id: &StateId) -> Result<Option<StoredState>, StoreError> {
        let Some(claim) = self.locks.authority_claim(id) else {
            return self.store.get(id).await?.map(StoredRow::parse).transpose();
        };
        if let Some(row) = self.memory.known(id, claim) {
            return row.map(StoredRow::parse).transpose();
        }
        // Read under the writer lock, so no write of this gateway lands
        // between the read and keeping what it read.
        let _reading = self.writers.lock(id).await;
        let row = self.current(id, Some(claim)).await?;
        row.map(StoredRow::parse).transpose()
    }

    /// The stored row of `id`: the known one under `claim`, else ClickHouse's,
    /// then known. The caller holds the id's writer lock.
    async fn current(
        &self,
        id: &StateId,
        claim: Option<Uuid>,
    ) -> Result<Option<StoredRow>, StoreError> {
        if let Some(row) = claim.and_then(|claim| self.memory.known(id, claim)) {
            return Ok(row);
        }
        let row = self.store.get(id).await?;
        if let Some(claim) = claim {
            self.memory.keep(id, claim, row.clone());
        }
        Ok(row)
    }

    pub async fn list(
        &self,
        pattern: &StatePattern,
        cursor: Option<&PageCursor>,
        limit: PageLimit,
    ) -> Result<(Vec<StateSummary>, bool), StoreError> {
        self.store.list(pattern, cursor, limit).await
    }

    /// As [`States::list`], with each state's document.
    pub async fn list_documents(
        &self,
        pattern: &StatePattern,
        cursor: Option<&PageCursor>,
        limit: PageLimit,
    ) -> Result<(Vec<StoredState>, bool), StoreError> {
        let (rows, has_more) = self.store.list_rows(pattern, cursor, limit).await?;
        let states = rows
            .into_iter()
            .map(StoredRow::parse)
            .collect::<Result<_, _>>()?;
        Ok((states, has_more))
    }

    /// Meltano `set` (`Change::Replace`) or `update` (`Change::Update`).
    pub async fn write(
        &self,
        id: &StateId,
        change: Change,
        conditions: &WriteConditions,
        provenance: &Provenance,
    ) -> Result<Written, StateError> {
        let operation = match change {
            Change::Replace(_) => Operation::Put,
            Change::Update(_) => Operation::Patch,
            Change::ResetStream(_) => Operation::ResetStream,
        };
        self.write_as(id, change, conditions, provenance, operation)
            .await
    }

    async fn write_as(
        &self,
        id: &StateId,
        change: Change,
        conditions: &WriteConditions,
        provenance: &Provenance,
        operation: Operation,
    ) -> Result<Written, StateError> {
        let writing = self.writers.lock(id).await;
        let admitted = self
            .locks
            .check_write(id, conditions.lease_id, conditions.seen_lease.as_ref())
            .await?;
        let claim = admitted.claim();
        let current = self.current(id, claim).await?;
        if let Some(precondition) = &conditions.if_match
            && !precondition.holds_for(current.as_ref().map(StoredRow::etag).as_ref())
        {
            return Err(precondition_failed(current.is_some()));
        }
        // The current state, parsed once: PATCH and a stream reset build on it
        // (and refuse one that is unreadable); history's changed streams
        // compare against it (an unreadable one, written by something else,
        // changed every stream), and so does the bookmark guard. A PUT
        // with neither needs none of it.
        let before = match &change {
            Change::Replace(_)
                if self.history.is_none() && self.regression == RegressionMode::Off =>
            {
                None
            }
            Change::Replace(_) => current.clone().and_then(|row| row.parse().ok()),
            Change::Update(_) | Change::ResetStream(_) => {
                current.clone().map(StoredRow::parse).transpose()?
            }
        };
        let doc = match change {
            Change::Replace(doc) => doc,
            Change::Update(doc) => {
                StateDocument::updated_by(before.as_ref().map(|s| s.doc.clone()), doc)
            }
            Change::ResetStream(stream) => {
                let Some(stored) = &before else {
                    return Err(StateError::NotFound(id.as_str().to_owned()));
                };
                stored
                    .doc
                    .without_stream(&stream)
                    .ok_or(StateError::NoBookmark(stream))?
            }
        };
        // Rollbacks and stream resets are deliberate: never refused, but
        // recorded as regressions when they are ones.
        let refusable = matches!(operation, Operation::Put | Operation::Patch);
        let regressed = self.guard(
            id,
            before.as_ref().map(|s| &s.doc),
            &doc,
            refusable.then_some(&conditions.allow_regression),
        )?;
        let version = next_version(current.as_ref(), self.memory.failed_version(id));
        let changed_streams = match &self.history {
            Some(_) => StateDocument::changed_streams(before.as_ref().map(|s| &s.doc), Some(&doc)),
            None => Vec::new(),
        };
        let (row, state) = StoredRow::written(id, doc, version);
        let outgoing = Outgoing {
            id: id.clone(),
            version,
            operation,
            changed_streams,
            regressed_streams: regressed.clone(),
            lease: admitted.lease().cloned(),
            claim,
            row,
            state,
        };
        let submission = Submission {
            changes: vec![outgoing],
            provenance: provenance.clone(),
            sending: admitted.sending()?,
            writing: vec![writing],
        };
        let state = self
            .commits
            .commit(submission)
            .await?
            .pop()
            .expect("one state per change");
        Ok(Written {
            state,
            created: current.is_none(),
            regressed,
        })
    }

    /// Writes every state of a batch as a PUT would, checking each against its
    /// lock, or none of them: one read of every current lease, one of the
    /// batch's current rows and one INSERT (of their versions, which carry the
    /// states along; of the states alone with history off).
    pub async fn import(
        &self,
        entries: Vec<(StateId, StateDocument, Option<Uuid>)>,
        allowed: &AllowedRegressions,
        provenance: &Provenance,
    ) -> Result<Imported, StateError> {
        if entries.is_empty() {
            return Ok(Imported {
                written: 0,
                created: 0,
            });
        }
        let mut first_seen: HashMap<&StateId, usize> = HashMap::new();
        for (index, (id, _, _)) in entries.iter().enumerate() {
            if let Some(first) = first_seen.insert(id, index) {
                return Err(StateError::Duplicate {
                    index,
                    first,
                    state_id: id.as_str().to_owned(),
                });
            }
        }
        let mut ids: Vec<StateId> = entries.iter().map(|(id, _, _)| id.clone()).collect();
        ids.sort();
        // In one order for every batch, so two batches never wait on each other.
        let mut writing = Vec::with_capacity(ids.len());
        for id in &ids {
            writing.push(self.writers.lock(id).await);
        }
        let checks: Vec<(&StateId, Option<Uuid>)> =
            entries.iter().map(|(id, _, lease)| (id, *lease)).collect();
        let admitted = self
            .locks
            .check_writes(&checks)
            .await
            .map_err(|(index, err)| in_batch(index, entries[index].0.as_str(), err.into()))?;
        let current: HashMap<StateId, StoredRow> = self
            .store
            .get_many(&ids)
            .await?
            .into_iter()
            .map(|row| (row.id.clone(), row))
            .collect();
        // The current states, parsed once: history's changed streams and the
        // bookmark guard compare against them.
        let befores: Vec<Option<StateDocument>> = entries
            .iter()
            .map(|(id, _, _)| {
                current
                    .get(id)
                    .and_then(|row| row.clone().parse().ok())
                    .map(|s| s.doc)
            })
            .collect();
        let mut regressed = Vec::with_capacity(entries.len());
        for (index, ((id, doc, _), before)) in entries.iter().zip(&befores).enumerate() {
            regressed.push(
                self.guard(id, before.as_ref(), doc, Some(allowed))
                    .map_err(|err| in_batch(index, id.as_str(), err))?,
            );
        }
        let sending = Sending::all(&admitted)
            .map_err(|(index, err)| in_batch(index, entries[index].0.as_str(), err.into()))?;
        let created = entries
            .iter()
            .filter(|(id, _, _)| !current.contains_key(id))
            .count();
        let batch: Vec<Outgoing> = entries
            .into_iter()
            .zip(&admitted)
            .zip(&befores)
            .zip(regressed)
            .map(|((((id, doc, _), admitted), before), regressed_streams)| {
                let changed_streams = match &self.history {
                    Some(_) => StateDocument::changed_streams(before.as_ref(), Some(&doc)),
                    None => Vec::new(),
                };
                let version = next_version(current.get(&id), self.memory.failed_version(&id));
                let (row, state) = StoredRow::written(&id, doc, version);
                Outgoing {
                    version,
                    id,
                    operation: Operation::Import,
                    changed_streams,
                    regressed_streams,
                    lease: admitted.lease().cloned(),
                    claim: admitted.claim(),
                    row,
                    state,
                }
            })
            .collect();
        let submission = Submission {
            changes: batch,
            provenance: provenance.clone(),
            sending,
            writing,
        };
        let written = self.commits.commit(submission).await?.len();
        Ok(Imported { written, created })
    }

    /// The bookmark guard: the streams of `after` whose bookmarks go
    /// backwards against `before`; with `--bookmark-regression reject`, a
    /// refusable write (`allowed` given) is refused unless `allowed` lets
    /// every one of them through.
    fn guard(
        &self,
        id: &StateId,
        before: Option<&StateDocument>,
        after: &StateDocument,
        allowed: Option<&AllowedRegressions>,
    ) -> Result<Vec<String>, StateError> {
        let (RegressionMode::Warn | RegressionMode::Reject, Some(before)) =
            (self.regression, before)
        else {
            return Ok(Vec::new());
        };
        let found = regressions(before, after);
        if found.is_empty() {
            return Ok(Vec::new());
        }
        self.metrics.bookmark_regressions(found.len());
        if self.regression == RegressionMode::Reject
            && let Some(allowed) = allowed
            && found.iter().any(|r| !allowed.allows(&r.stream))
        {
            return Err(StateError::BookmarkRegression(found));
        }
        let mut streams: Vec<String> = found.into_iter().map(|r| r.stream).collect();
        streams.dedup();
        tracing::warn!(state_id = %id, streams = %streams.join(", "), "bookmark went backwards");
        Ok(streams)
    }

    /// Forgets what this gateway knew of `ids`: another gateway wrote them.
    pub fn forget(&self, ids: &[StateId]) {
        self.memory.forget(|id| ids.contains(id));
    }

    /// Deleting what does not exist succeeds: the outcome is the same (and
    /// leaves no version, since nothing changed).
    pub async fn delete(
        &self,
        id: &StateId,
        conditions: &WriteConditions,
        provenance: &Provenance,
    ) -> Result<(), StateError> {
        self.delete_as(id, conditions, provenance, Operation::Delete)
            .await
    }

    async fn delete_as(
        &self,
        id: &StateId,
        conditions: &WriteConditions,
        provenance: &Provenance,
        operation: Operation,
    ) -> Result<(), StateError> {
        let _writing = self.writers.lock(id).await;
        let admitted = self
            .locks
            .check_write(id, conditions.lease_id, conditions.seen_lease.as_ref())
            .await?;
        let claim = admitted.claim();
        if let Some(precondition) = &conditions.if_match {
            let current = self.current(id, claim).await?;
            if !precondition.holds_for(current.as_ref().map(StoredRow::etag).as_ref()) {
                return Err(precondition_failed(current.is_some()));
            }
        }
        // Forgotten first: a delete that fails midway leaves nothing known.
        self.memory.forget(|known| known == id);
        let selection = Selection::One(id.clone());
        // Each step goes out only while the lease still stands: one refused
        // after the tombstone leaves a version that is never current.
        admitted
            .sending()?
            .run(self.record_deletions(
                &selection,
                operation,
                admitted.lease().cloned(),
                provenance,
            ))
            .await?;
        admitted.sending()?.run(self.store.delete(id)).await?;
        if let Some(claim) = claim {
            self.memory.keep(id, claim, None);
        }
        Ok(())
    }

    /// Deletes every match; what this gateway knew of them goes too (peers
    /// that are authorities for some of them are told by the caller).
    pub async fn delete_matching(
        &self,
        pattern: &StatePattern,
        provenance: &Provenance,
    ) -> Result<u64, StoreError> {
        self.memory.forget(|id| pattern.matches(id));
        let selection = Selection::Matching(pattern.clone());
        self.record_deletions(&selection, Operation::DeleteByPattern, None, provenance)
            .await?;
        self.store.delete_matching(pattern).await
    }

    /// Tombstones for what `selection` is about to delete, written first.
    async fn record_deletions(
        &self,
        selection: &Selection,
        operation: Operation,
        lease: Option<Lease>,
        provenance: &Provenance,
    ) -> Result<(), StoreError> {
        let Some(history) = &self.history else {
            return Ok(());
        };
        let context = ChangeContext {
            provenance: provenance.clone(),
            lease,
        };
        history
            .record_deletions(self.store.table(), selection, operation, now_ms(), &context)
            .await
    }

    fn history(&self) -> Result<&HistoryStore, StateError> {
        self.history.as_ref().ok_or(StateError::HistoryOff)
    }

    /// Versions of `id`, newest first, each marked whether it is current.
    pub async fn history_page(
        &self,
        id: &StateId,
        cursor: Option<VersionCursor>,
        limit: PageLimit,
    ) -> Result<HistoryPage, StateError> {
        let history = self.history()?;
        let (metas, has_more) = history.list(id, cursor.map(|c| c.0), limit.get()).await?;
        let current = self.current_version(history, id).await?;
        let versions = metas
            .into_iter()
            .map(|meta| ListedVersion {
                current: current == Some((meta.version, meta.deleted)),
                meta,
            })
            .collect();
        Ok(HistoryPage { versions, has_more })
    }

    /// One version of `id` with its document, and whether it is current.
    pub async fn version(
        &self,
        id: &StateId,
        version: Version,
    ) -> Result<Option<(StoredVersion, bool)>, StateError> {
        let history = self.history()?;
        let Some(stored) = history.get(id, version).await? else {
            return Ok(None);
        };
        let current = self.current_version(history, id).await?
            == Some((stored.meta.version, stored.meta.deleted));
        Ok(Some((stored, current)))
    }

    /// The version `id` is at, with whether it is a tombstone: the state's
    /// own version, or, when it does not exist, its newest tombstone.
    async fn current_version(
        &self,
        history: &HistoryStore,
        id: &StateId,
    ) -> Result<Option<(Version, bool)>, StoreError> {
        if let Some(version) = self.store.version(id).await? {
            return Ok(Some((version, false)));
        }
        Ok(history.newest_tombstone(id).await?.map(|v| (v, true)))
    }

    /// Writes `version`'s document as a new version, or deletes the state
    /// when `version` is a tombstone. Answers the state written, if any.
    pub async fn rollback(
        &self,
        id: &StateId,
        version: Version,
        conditions: &WriteConditions,
        provenance: &Provenance,
    ) -> Result<Option<Written>, StateError> {
        let Some(stored) = self.history()?.get(id, version).await? else {
            return Err(StateError::VersionNotFound(version));
        };
        match stored.doc {
            Some(doc) => self
                .write_as(
                    id,
                    Change::Replace(doc),
                    conditions,
                    provenance,
                    Operation::Rollback,
                )
                .await
                .map(Some),
            None => self
                .delete_as(id, conditions, provenance, Operation::Rollback)
                .await
                .map(|()| None),
        }
    }
}

fn precondition_failed(exists: bool) -> StateError {
    StateError::PreconditionFailed(if exists {
        "If-Match does not match the current ETag of the state"
    } else {
        "If-Match was given but the state does not exist"
    })
}
