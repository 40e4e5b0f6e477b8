//! State operations: the rules of the API on top of the store. Writes to one
//! state_id are serialized in this process, so a read-decide-write (If-Match,
//! PATCH's merge) sees no interleaved write from this gateway, and a write
//! checked against the lock cannot be overtaken by the next holder's.
//!
//! On the ids it is the authority for, a gateway keeps the state it last
//! read or wrote: every write to such an id comes through it (its peers
//! forward them), so its copy is current, and a Meltano STATE message (lock,
//! read, write, unlock) costs one ClickHouse round trip, the write's INSERT.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use uuid::Uuid;

use crate::domain::{PageCursor, PageLimit, StateDocument, StateId, StatePattern};
use crate::keyed_mutex::KeyedMutex;
use crate::locks::{LockError, LockManager};
use crate::store::{StateStore, StateSummary, StoreError, StoredRow, StoredState};

/// An `If-Match` precondition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IfMatch {
    Any,
    OneOf(Vec<String>),
}

impl IfMatch {
    /// Parses the header value: `*` or a comma-separated list of entity tags.
    pub fn parse(raw: &str) -> Option<Self> {
        let raw = raw.trim();
        if raw == "*" {
            return Some(Self::Any);
        }
        let tags: Vec<String> = raw
            .split(',')
            .map(|tag| tag.trim().to_owned())
            .filter(|tag| !tag.is_empty())
            .collect();
        let well_formed = !tags.is_empty()
            && tags
                .iter()
                .all(|t| t.len() >= 2 && t.starts_with(['"', 'W']) && t.ends_with('"'));
        well_formed.then_some(Self::OneOf(tags))
    }

    /// RFC 9110: If-Match uses the strong comparison, so a weak tag never matches.
    fn holds_for(&self, current: Option<&StoredRow>) -> bool {
        match (self, current) {
            (_, None) => false,
            (Self::Any, Some(_)) => true,
            (Self::OneOf(tags), Some(row)) => tags.contains(&row.etag()),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    PreconditionFailed(&'static str),
    #[error(transparent)]
    Lock(#[from] LockError),
}

/// What a write does with the incoming document.
pub enum Change {
    /// Meltano `set`: the document replaces the state.
    Replace(StateDocument),
    /// Meltano `update`: see [`StateDocument::updated_by`]; a missing state is created.
    Update(StateDocument),
}

pub struct Written {
    pub state: StoredState,
    pub created: bool,
}

pub struct States {
    store: StateStore,
    locks: Arc<LockManager>,
    writers: KeyedMutex<StateId>,
    known: Known,
}

/// The last state read or written of ids this gateway is the authority for,
/// each under the claim it was taken under (`LockManager::authority_claim`):
/// once that claim is gone, another gateway may have written, and the entry
/// counts for nothing. `None` is a state known not to exist.
#[derive(Default)]
struct Known {
    rows: Mutex<KnownRows>,
}

#[derive(Default)]
struct KnownRows {
    by_id: HashMap<StateId, (Uuid, Option<StoredRow>)>,
    /// Size after the last sweep of entries whose claim is gone; the next
    /// sweep runs when the map doubles.
    swept_at: usize,
}

/// Larger states are read from ClickHouse each time: a gateway holding many
/// claims must not hold many large documents.
const MAX_KNOWN_BYTES: usize = 1 << 20;

impl Known {
    fn get(&self, id: &StateId, claim: Uuid) -> Option<Option<StoredRow>> {
        let rows = self.rows.lock().unwrap_or_else(|p| p.into_inner());
        rows.by_id
            .get(id)
            .filter(|(under, _)| *under == claim)
            .map(|(_, row)| row.clone())
    }

    fn put(&self, id: &StateId, claim: Uuid, row: Option<StoredRow>, locks: &LockManager) {
        let mut rows = self.rows.lock().unwrap_or_else(|p| p.into_inner());
        if row.as_ref().is_some_and(|r| r.size() > MAX_KNOWN_BYTES) {
            rows.by_id.remove(id);
            return;
        }
        rows.by_id.insert(id.clone(), (claim, row));
        if rows.by_id.len() >= 2 * rows.swept_at.max(64) {
            rows.by_id
                .retain(|id, (under, _)| locks.authority_claim(id) == Some(*under));
            rows.swept_at = rows.by_id.len();
        }
    }

    fn forget(&self, matching: impl Fn(&StateId) -> bool) {
        let mut rows = self.rows.lock().unwrap_or_else(|p| p.into_inner());
        rows.by_id.retain(|id, _| !matching(id));
    }
}

/// What a write carries besides its document.
#[derive(Default)]
pub struct WriteConditions {
    pub if_match: Option<IfMatch>,
    /// The `Lease-Id` header: required while the state_id is locked.
    pub lease_id: Option<Uuid>,
}

impl States {
    pub fn new(store: StateStore, locks: Arc<LockManager>) -> Self {
        Self {
            store,
            locks,
            writers: KeyedMutex::default(),
            known: Known::default(),
        }
    }

    pub async fn get(&self, id: &StateId) -> Result<Option<StoredState>, StoreError> {
        let Some(claim) = self.locks.authority_claim(id) else {
            return self.store.get(id).await?.map(StoredRow::parse).transpose();
        };
        if let Some(row) = self.known.get(id, claim) {
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
        if let Some(row) = claim.and_then(|claim| self.known.get(id, claim)) {
            return Ok(row);
        }
        let row = self.store.get(id).await?;
        if let Some(claim) = claim {
            self.known.put(id, claim, row.clone(), &self.locks);
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

    /// Meltano `set` (`Change::Replace`) or `update` (`Change::Update`).
    pub async fn write(
        &self,
        id: &StateId,
        change: Change,
        conditions: &WriteConditions,
    ) -> Result<Written, StateError> {
        let _writing = self.writers.lock(id).await;
        self.locks.check_write(id, conditions.lease_id).await?;
        let claim = self.locks.authority_claim(id);
        let current = self.current(id, claim).await?;
        if let Some(precondition) = &conditions.if_match
            && !precondition.holds_for(current.as_ref())
        {
            return Err(precondition_failed(current.is_some()));
        }
        let doc = match change {
            Change::Replace(doc) => doc,
            Change::Update(doc) => {
                let stored = current.clone().map(StoredRow::parse).transpose()?;
                StateDocument::updated_by(stored.map(|s| s.doc), doc)
            }
        };
        let (row, state) = self.store.put(id, doc, current.as_ref()).await?;
        if let Some(claim) = claim {
            self.known.put(id, claim, Some(row), &self.locks);
        }
        Ok(Written {
            state,
            created: current.is_none(),
        })
    }

    /// Deleting what does not exist succeeds: the outcome is the same.
    pub async fn delete(
        &self,
        id: &StateId,
        conditions: &WriteConditions,
    ) -> Result<(), StateError> {
        let _writing = self.writers.lock(id).await;
        self.locks.check_write(id, conditions.lease_id).await?;
        let claim = self.locks.authority_claim(id);
        if let Some(precondition) = &conditions.if_match {
            let current = self.current(id, claim).await?;
            if !precondition.holds_for(current.as_ref()) {
                return Err(precondition_failed(current.is_some()));
            }
        }
        // Forgotten first: a delete that fails midway leaves nothing known.
        self.known.forget(|known| known == id);
        self.store.delete(id).await?;
        if let Some(claim) = claim {
            self.known.put(id, claim, None, &self.locks);
        }
        Ok(())
    }

    /// Deletes every match; what this gateway knew of them goes too (peers
    /// that are authorities for some of them are told by the caller).
    pub async fn delete_matching(&self, pattern: &StatePattern) -> Result<u64, StoreError> {
        self.known.forget(|id| pattern.matches(id));
        self.store.delete_matching(pattern).await
    }
}

fn precondition_failed(exists: bool) -> StateError {
    StateError::PreconditionFailed(if exists {
        "If-Match does not match the current ETag of the state"
    } else {
        "If-Match was given but the state does not exist"
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_if_match() {
        assert_eq!(IfMatch::parse(" * "), Some(IfMatch::Any));
        assert_eq!(
            IfMatch::parse("\"a\", W/\"b\""),
            Some(IfMatch::OneOf(vec!["\"a\"".into(), "W/\"b\"".into()]))
        );
        for bad in ["", "abc", "\"", ",", "\"a\", b"] {
            assert_eq!(IfMatch::parse(bad), None, "{bad}");
        }
    }
}
