//! State operations: the rules of the API on top of the store. Writes to one
//! state_id are serialized in this process, so a read-decide-write (If-Match,
//! PATCH's merge) sees no interleaved write from this gateway, and a write
//! checked against the lock cannot be overtaken by the next holder's.

use std::sync::Arc;

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
        }
    }

    pub async fn get(&self, id: &StateId) -> Result<Option<StoredState>, StoreError> {
        self.store.get(id).await?.map(StoredRow::parse).transpose()
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
        let current = self.store.get(id).await?;
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
        let state = self.store.put(id, doc, current.as_ref()).await?;
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
        if let Some(precondition) = &conditions.if_match {
            let current = self.store.get(id).await?;
            if !precondition.holds_for(current.as_ref()) {
                return Err(precondition_failed(current.is_some()));
            }
        }
        Ok(self.store.delete(id).await?)
    }

    pub async fn delete_matching(&self, pattern: &StatePattern) -> Result<u64, StoreError> {
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
