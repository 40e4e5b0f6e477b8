//! State operations: the rules of the API on top of the store. Writes to one
//! state_id are serialized in this process, so a read-decide-write (If-Match,
//! PATCH's merge) sees no interleaved write from this gateway.

use crate::domain::{PageCursor, PageLimit, StateDocument, StateId, StatePattern};
use crate::keyed_mutex::KeyedMutex;
use crate::store::{StateStore, StateSummary, StoreError, StoredState};

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
    fn holds_for(&self, current: Option<&StoredState>) -> bool {
        match (self, current) {
            (_, None) => false,
            (Self::Any, Some(_)) => true,
            (Self::OneOf(tags), Some(state)) => {
                let etag = state.etag();
                tags.contains(&etag)
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    PreconditionFailed(&'static str),
}

pub struct Written {
    pub state: StoredState,
    pub created: bool,
}

pub struct States {
    store: StateStore,
    writers: KeyedMutex<StateId>,
}

impl States {
    pub fn new(store: StateStore) -> Self {
        Self {
            store,
            writers: KeyedMutex::default(),
        }
    }

    pub fn store(&self) -> &StateStore {
        &self.store
    }

    pub async fn get(&self, id: &StateId) -> Result<Option<StoredState>, StoreError> {
        self.store.get(id).await
    }

    pub async fn list(
        &self,
        pattern: &StatePattern,
        cursor: Option<&PageCursor>,
        limit: PageLimit,
    ) -> Result<(Vec<StateSummary>, bool), StoreError> {
        self.store.list(pattern, cursor, limit).await
    }

    /// Meltano `set`: replaces the whole state.
    pub async fn replace(
        &self,
        id: &StateId,
        doc: StateDocument,
        if_match: Option<&IfMatch>,
    ) -> Result<Written, StateError> {
        self.write(id, if_match, |_| doc).await
    }

    /// Meltano `update`: see [`StateDocument::updated_by`]. A missing state is created.
    pub async fn update(
        &self,
        id: &StateId,
        doc: StateDocument,
        if_match: Option<&IfMatch>,
    ) -> Result<Written, StateError> {
        self.write(id, if_match, |current| {
            StateDocument::updated_by(current.map(|c| c.doc.clone()), doc)
        })
        .await
    }

    /// Deleting what does not exist succeeds: the outcome is the same.
    pub async fn delete(&self, id: &StateId, if_match: Option<&IfMatch>) -> Result<(), StateError> {
        let _writing = self.writers.lock(id).await;
        if let Some(precondition) = if_match {
            let current = self.store.get(id).await?;
            if !precondition.holds_for(current.as_ref()) {
                return Err(precondition_failed(current.as_ref()));
            }
        }
        Ok(self.store.delete(id).await?)
    }

    pub async fn delete_matching(&self, pattern: &StatePattern) -> Result<u64, StoreError> {
        self.store.delete_matching(pattern).await
    }

    async fn write(
        &self,
        id: &StateId,
        if_match: Option<&IfMatch>,
        next: impl FnOnce(Option<&StoredState>) -> StateDocument,
    ) -> Result<Written, StateError> {
        let _writing = self.writers.lock(id).await;
        let current = self.store.get(id).await?;
        if let Some(precondition) = if_match
            && !precondition.holds_for(current.as_ref())
        {
            return Err(precondition_failed(current.as_ref()));
        }
        let doc = next(current.as_ref());
        let state = self.store.put(id, doc, current.as_ref()).await?;
        Ok(Written {
            state,
            created: current.is_none(),
        })
    }
}

fn precondition_failed(current: Option<&StoredState>) -> StateError {
    StateError::PreconditionFailed(match current {
        None => "If-Match was given but the state does not exist",
        Some(_) => "If-Match does not match the current ETag of the state",
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
