//! State operations: the rules of the API on top of the store. Every change
//! is decided by one pure function (`prepare`) and goes out through one door
//! (`group_commit`), admitted by the lock rule as it is submitted and again as
//! its batch is sent. Writes to one state_id are serialized in this process,
//! so a read-decide-write (If-Match, PATCH's merge) sees no interleaved write
//! from this gateway, and a write checked against the lock cannot be
//! overtaken by the next holder's.
//!
//! On the ids it is the authority for, a gateway keeps the state it last
//! read or wrote: every write to such an id comes through it (its peers
//! forward them), so its copy is current, and a Meltano STATE message (lock,
//! read, write, unlock) costs one ClickHouse round trip, the write's INSERT.

mod as_of;
mod batch;
mod clear;
mod error;
mod feed;
mod group_commit;
mod memory;
mod prepare;
mod restore;
mod restore_plan;
mod versions;
mod watch;

use std::collections::HashMap;
use std::sync::Arc;

use axum::http::HeaderValue;
use uuid::Uuid;

pub use self::clear::Cleared;
pub use self::error::StateError;
pub use self::feed::{CursorError, Delivered, Delivery, Feed, FeedCursor, Follow, Follower};
use self::group_commit::{CommitError, GroupCommit, Outgoing, Submission, Target};
use self::memory::Memory;
pub use self::prepare::Change;
use self::prepare::{Policy, Prepared, prepare};
pub use self::restore::{MAX_RESTORE_IDS, RestoreAsk};
pub use self::restore_plan::{Action, Planned, StreamMove};
pub use self::versions::{HistoryPage, ListedVersion};
pub use self::watch::{Known, WaitEnd, Watches, Watching};

use crate::domain::{
    Allowed, GuardModes, IfMatch, PageCursor, PageLimit, Provenance, Scope, StateDocument, StateId,
    StatePattern, Version,
};
use crate::keyed_mutex::KeyedMutex;
use crate::locks::{Admitted, LockManager, SeenLease, TicketGrant};
use crate::metrics::Metrics;
use crate::retry::{ATTEMPTS, retried};
use crate::store::{
    ChangesStore, Journal, StateStore, StateSummary, StoreError, StoredRow, StoredState, now_ms,
};
use crate::telemetry::ClientText;

/// What a batch write did.
pub struct Imported {
    pub written: usize,
    pub created: usize,
}

pub struct Written {
    pub state: StoredState,
    pub created: bool,
    /// Streams whose bookmarks went backwards in it (`--bookmark-regression warn`).
    pub regressed: Vec<String>,
    /// Streams whose bookmarks it dropped (`--bookmark-loss warn`, or allowed).
    pub lost: Vec<String>,
}

pub struct States {
    store: StateStore,
    /// Each state's versions, unless history is off.
    journal: Journal,
    locks: Arc<LockManager>,
    /// One write of an id at a time on this gateway: its read-decide-write
    /// sees no other, and the lock stays with the change until it landed.
    writers: KeyedMutex<StateId>,
    memory: Arc<Memory>,
    commits: Arc<GroupCommit>,
    guard: GuardModes,
    metrics: Arc<Metrics>,
    /// Requests waiting on a change of one state (long-polls).
    watches: Watches,
    /// Requests following the changes under a glob.
    feed: Feed,
}

/// What a write carries besides its document.
#[derive(Default)]
pub struct WriteConditions {
    pub if_match: Option<IfMatch>,
    /// The `Lease-Id` header: required while the state_id is locked.
    pub lease_id: Option<Uuid>,
    /// The lease ClickHouse records, as routing the request read it.
    pub seen_lease: Option<SeenLease>,
    /// The streams the bookmark guard lets go back or away.
    pub allowed: Allowed,
}

impl States {
    pub fn new(
        store: StateStore,
        journal: Journal,
        changes: ChangesStore,
        locks: Arc<LockManager>,
        metrics: Arc<Metrics>,
        guard: GuardModes,
    ) -> Self {
        let memory = Arc::new(Memory::new(journal.is_kept(), locks.clone()));
        let feed = Feed::new(changes.clone(), metrics.clone());
        let target = Target {
            history: journal.versions().cloned(),
            states: store.clone(),
            changes,
        };
        let watches = Watches::new(store.clone(), metrics.clone(), feed.clone());
        Self {
            commits: Arc::new(GroupCommit::new(
                target,
                memory.clone(),
                metrics.clone(),
                watches.clone(),
            )),
            watches,
            guard,
            feed,
            metrics,
            store,
            journal,
            locks,
            writers: KeyedMutex::default(),
            memory,
        }
    }

    /// The state of `id`: from memory while a lease runs on it here (its
    /// holder's lock, read, write cycle costs no read), else as ClickHouse
    /// has it, which also shows rows written straight into the table.
    pub async fn get(&self, id: &StateId) -> Result<Option<StoredState>, StoreError> {
        let Some(claim) = self.locks.leased_claim(id) else {
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

    /// The requests waiting on a change of one state.
    pub fn watches(&self) -> &Watches {
        &self.watches
    }

    /// The change feed.
    pub fn feed(&self) -> &Feed {
        &self.feed
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

    /// The ids `pattern` matches within `scope` (a token's), a page at a time.
    pub async fn list(
        &self,
        pattern: &StatePattern,
        scope: &Scope,
        cursor: Option<&PageCursor>,
        limit: PageLimit,
    ) -> Result<(Vec<StateSummary>, bool), StoreError> {
        self.store.list(pattern, scope, cursor, limit).await
    }

    /// As [`States::list`], with each state's document.
    pub async fn list_documents(
        &self,
        pattern: &StatePattern,
        scope: &Scope,
        cursor: Option<&PageCursor>,
        limit: PageLimit,
    ) -> Result<(Vec<StoredState>, bool), StoreError> {
        let (rows, has_more) = self.store.list_rows(pattern, scope, cursor, limit).await?;
        let states = rows
            .into_iter()
            .map(StoredRow::parse)
            .collect::<Result<_, _>>()?;
        Ok((states, has_more))
    }

    /// PUT, PATCH or a stream reset: the state as written.
    pub async fn write(
        &self,
        id: &StateId,
        change: Change,
        conditions: &WriteConditions,
        provenance: &Provenance,
    ) -> Result<Written, StateError> {
        let written = self.commit(id, change, conditions, provenance).await?;
        Ok(written.expect("a write that is not a delete answers its state"))
    }

    /// Deleting what does not exist succeeds: the outcome is the same (and
    /// leaves no version, since nothing changed).
    pub async fn delete(
        &self,
        id: &StateId,
        conditions: &WriteConditions,
        provenance: &Provenance,
    ) -> Result<(), StateError> {
        self.commit(id, Change::Delete, conditions, provenance)
            .await
            .map(|_| ())
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
        self.commit(id, Change::Restore(stored.doc), conditions, provenance)
            .await
    }

    /// One change of one id through the door: admitted, decided against the
    /// current row, then submitted. Its INSERT checks that the row is still
    /// the stored one: when another writer (the ClickHouse plugin) wrote the
    /// id meanwhile, nothing landed, and the change is decided again against
    /// the stored row, read afresh, a few times at most. None when it
    /// deleted the state, or there was nothing to delete.
    async fn commit(
        &self,
        id: &StateId,
        change: Change,
        conditions: &WriteConditions,
        provenance: &Provenance,
    ) -> Result<Option<Written>, StateError> {
        // What this gateway knew of the id, or its routing read found, is
        // stale after a refusal: the next attempt reads the stored row.
        decided_again(
            || self.commit_once(id, change.clone(), conditions, provenance),
            || self.memory.forget_each([id]),
        )
        .await
    }

    /// One attempt of [`States::commit`].
    async fn commit_once(
        &self,
        id: &StateId,
        change: Change,
        conditions: &WriteConditions,
        provenance: &Provenance,
    ) -> Result<Option<Written>, StateError> {
        let writing = self.writers.lock(id).await;
        let admitted = self
            .locks
            .check_write(id, conditions.lease_id, conditions.seen_lease.as_ref())
            .await?;
        // The row this request's routing read found (or one asked for
        // later), taken: a retry reads afresh, and a later write takes
        // only a row read after it began.
        let read_ahead = self
            .locks
            .seen_at(conditions.seen_lease.as_ref())
            .and_then(|since| self.store.take_read_ahead(id, since));
        let current = match read_ahead {
            // Read after every write of this gateway to the id had settled,
            // and none since: as a read now would be.
            Some((at, row))
                if admitted.claim().is_none() && self.memory.untouched_since(id, at) =>
            {
                row
            }
            _ => self.current(id, admitted.claim()).await?,
        };
        let policy = self.policy(conditions.if_match.as_ref(), &conditions.allowed);
        let decided = prepare(
            id,
            current.as_ref(),
            change,
            &policy,
            self.memory.failed_version(id),
            now_ms(),
        );
        let Some(prepared) = self.guarded(id, decided)? else {
            return Ok(None);
        };
        let created = prepared.created;
        let (regressed, lost) = (
            prepared.regressed_streams.clone(),
            prepared.lost_streams.clone(),
        );
        let decided_against = current.as_ref().map(|row| row.updated_at_ms);
        let submission = Submission {
            changes: vec![outgoing(
                id.clone(),
                prepared,
                &admitted,
                Some(decided_against),
            )],
            admitted: vec![admitted],
            provenance: provenance.clone(),
            writing: vec![writing],
        };
        let state = self
            .commits
            .commit(submission)
            .await
            .map_err(|err| batch_error(err, std::slice::from_ref(id)))?
            .pop()
            .expect("one state per change");
        Ok(state.map(|state| Written {
            state,
            created,
            regressed,
            lost,
        }))
    }

    /// The rules a change is decided under: the request's precondition and
    /// the streams it allows, this gateway's guard, whether history is kept.
    fn policy<'a>(&self, if_match: Option<&'a IfMatch>, allowed: &'a Allowed) -> Policy<'a> {
        Policy {
            if_match,
            guard: self.guard,
            allowed,
            history: self.journal.is_kept(),
        }
    }

    /// Counts and logs what the bookmark guard found in a decision.
    fn guarded(
        &self,
        id: &StateId,
        decided: Result<Option<Prepared>, StateError>,
    ) -> Result<Option<Prepared>, StateError> {
        match &decided {
            Ok(Some(prepared)) => {
                if prepared.regressions_found > 0 {
                    self.metrics
                        .bookmark_regressions(prepared.regressions_found);
                    tracing::warn!(
                        state_id = %id,
                        streams = %ClientText(&prepared.regressed_streams.join(", ")),
                        "bookmark went backwards"
                    );
                }
                if prepared.losses_found > 0 {
                    self.metrics.bookmark_losses(prepared.losses_found);
                    tracing::warn!(
                        state_id = %id,
                        streams = %ClientText(&prepared.lost_streams.join(", ")),
                        "bookmark lost"
                    );
                }
            }
            Err(StateError::BookmarkRegression(found)) => {
                self.metrics.bookmark_regressions(found.len());
            }
            Err(StateError::BookmarkLoss(found)) => {
                self.metrics.bookmark_losses(found.len());
            }
            _ => {}
        }
        decided
    }

    /// Writes every state of a batch as a PUT would, checking each against its
    /// lock, or none of them: one read of every current lease, one of the
    /// batch's current rows and one INSERT (of their versions, which carry the
    /// states along; of the states alone with history off).
    ///
    /// An import is not checked in its INSERT, but may share a batch with
    /// changes that are: a batch refused for one of theirs landed nothing,
    /// and the import is sent again (reading its rows again), as
    /// [`States::commit`] decides a change again.
    pub async fn import(
        &self,
        entries: Vec<(StateId, StateDocument, Option<Uuid>)>,
        allowed: &Allowed,
        provenance: &Provenance,
        authorization: Option<&HeaderValue>,
    ) -> Result<Imported, StateError> {
        decided_again(
            || self.import_once(entries.clone(), allowed, provenance, authorization),
            || {},
        )
        .await
    }

    /// One attempt of [`States::import`].
    async fn import_once(
        &self,
        entries: Vec<(StateId, StateDocument, Option<Uuid>)>,
        allowed: &Allowed,
        provenance: &Provenance,
        authorization: Option<&HeaderValue>,
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
        let ids: Vec<StateId> = entries.iter().map(|(id, _, _)| id.clone()).collect();
        let writing = self.batch_writers(&ids).await;
        let checks: Vec<(&StateId, Option<Uuid>)> =
            entries.iter().map(|(id, _, lease)| (id, *lease)).collect();
        let admitted = self
            .locks
            .check_writes(&checks, authorization)
            .await
            .map_err(|(index, err)| {
                StateError::in_batch(index, entries[index].0.as_str(), err.into())
            })?;
        let changes = entries
            .into_iter()
            .zip(admitted)
            .map(|((id, doc, _), admitted)| (id, Change::Import(doc), admitted))
            .collect();
        let batched = self
            .write_batch(changes, writing, allowed, provenance)
            .await?;
        Ok(Imported {
            written: batched.sent,
            created: batched.created,
        })
    }

    /// As the authority of every id of `writes`, admits them for another
    /// gateway to send (see `locks::ticket`); what this gateway knew of
    /// them is stale from now on.
    pub fn issue_ticket(
        &self,
        writes: &[(StateId, Option<Uuid>)],
    ) -> Result<TicketGrant, StateError> {
        let grant = self.locks.issue_ticket(writes).map_err(|(index, err)| {
            StateError::in_batch(index, writes[index].0.as_str(), err.into())
        })?;
        self.memory.forget_each(writes.iter().map(|(id, _)| id));
        Ok(grant)
    }

    /// Settles a ticket: its writes landed or failed (`known`), or their
    /// outcome is unknown. False for an unknown ticket.
    pub fn settle_ticket(&self, ticket: Uuid, known: bool) -> bool {
        self.locks.settle_ticket(ticket, known, |ids| {
            self.memory.forget_each(ids);
        })
    }
}

/// Runs `attempt` again while ClickHouse refused its INSERT for the check
/// (a state it was decided against changed meanwhile, and nothing of it
/// landed), `retry::ATTEMPTS` times in all, with `before_again` in between.
async fn decided_again<T, F: Future<Output = Result<T, StateError>>>(
    attempt: impl FnMut() -> F,
    mut before_again: impl FnMut(),
) -> Result<T, StateError> {
    retried(attempt, |outcome| {
        let again = matches!(outcome, Err(StateError::Stale { .. }));
        if again {
            before_again();
        }
        again
    })
    .await
    .map_err(|err| match err {
        StateError::Stale { .. } => StateError::Stale {
            attempts: ATTEMPTS as u32,
        },
        other => other,
    })
}

fn outgoing(
    id: StateId,
    prepared: Prepared,
    admitted: &Admitted,
    checked: Option<Option<i64>>,
) -> Outgoing {
    Outgoing {
        id,
        prepared,
        lease: admitted.lease().cloned(),
        claim: admitted.claim(),
        checked,
    }
}

/// A submission's failure as the API tells it: a refusal names its entry
/// when the submission is an import's (of `ids`).
fn batch_error(err: CommitError, ids: &[StateId]) -> StateError {
    match err {
        CommitError::Refused(_, err) if ids.len() == 1 => err.into(),
        CommitError::Refused(index, err) => {
            StateError::in_batch(index, ids[index].as_str(), err.into())
        }
        CommitError::Store(err) => StoreError::InBatch(err).into(),
        CommitError::Stale => StateError::Stale { attempts: 1 },
    }
}
