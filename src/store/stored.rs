//! A state as the state table holds it: the row before its JSON is parsed
//! ([`StoredRow`]), and parsed ([`StoredState`]). Below both the table's
//! queries and the read-ahead that keeps a routing read's row.

use super::error::StoreError;
use crate::domain::{ETag, StateDocument, StateId, Version};

/// One state as ClickHouse holds it now, before its JSON is parsed: a
/// replacing write needs only its version, and should succeed even over a
/// row another writer left unreadable.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredRow {
    pub id: StateId,
    pub(super) completed: Option<String>,
    pub(super) partial: Option<String>,
    /// `updated_at` in milliseconds since the epoch: the row's version.
    pub updated_at_ms: i64,
}

impl StoredRow {
    /// A row as the state table holds it: the halves as stored text, which
    /// may be NULL, or not even JSON when another writer wrote them.
    pub fn from_columns(
        id: StateId,
        completed: Option<String>,
        partial: Option<String>,
        updated_at_ms: i64,
    ) -> Self {
        Self {
            id,
            completed,
            partial,
            updated_at_ms,
        }
    }

    /// Bytes of document text it holds.
    pub fn size(&self) -> usize {
        [&self.completed, &self.partial]
            .into_iter()
            .map(|text| text.as_ref().map_or(0, String::len))
            .sum()
    }

    pub fn etag(&self) -> ETag {
        ETag::of(
            self.updated_at_ms,
            self.completed.as_deref(),
            self.partial.as_deref(),
        )
    }

    /// The row and state that writing `doc` as `version` of `id` makes.
    pub fn written(id: &StateId, doc: StateDocument, version: Version) -> (Self, StoredState) {
        let row = Self {
            id: id.clone(),
            completed: Some(doc.completed_json()),
            partial: Some(doc.partial_json()),
            updated_at_ms: version.millis(),
        };
        let state = StoredState {
            etag: row.etag(),
            id: id.clone(),
            doc,
            updated_at_ms: row.updated_at_ms,
        };
        (row, state)
    }

    pub fn parse(self) -> Result<StoredState, StoreError> {
        let doc = StateDocument::from_stored(self.completed.as_deref(), self.partial.as_deref())
            .map_err(|source| StoreError::Corrupt {
                id: self.id.as_str().to_owned(),
                source,
            })?;
        Ok(StoredState {
            etag: self.etag(),
            id: self.id,
            doc,
            updated_at_ms: self.updated_at_ms,
        })
    }
}

/// One state, parsed.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredState {
    pub id: StateId,
    pub doc: StateDocument,
    pub updated_at_ms: i64,
    pub etag: ETag,
}
