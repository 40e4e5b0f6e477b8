//! Reads as of an instant (`at=`): a state, a page of a listing, from the
//! versions history keeps. An instant ahead of this gateway's clock, or
//! older than the retention keeps, is refused before anything is read.

use super::{StateError, States};
use crate::domain::{AsOf, PageCursor, PageLimit, Scope, StateId, StatePattern};
use crate::store::{HistoryStore, Selection, StateSummary, StoredRow, StoredState, now_ms};

impl States {
    /// The versions, when `at` is an instant they can tell.
    pub(super) fn history_at(&self, at: AsOf) -> Result<&HistoryStore, StateError> {
        let history = self.history()?;
        let now = now_ms();
        if at.millis() > now {
            return Err(StateError::FutureInstant(at));
        }
        match history.oldest_askable(now) {
            Some(oldest_ms) if at.millis() < oldest_ms => {
                Err(StateError::HistoryExpired { at, oldest_ms })
            }
            _ => Ok(history),
        }
    }

    /// `id` as it stood at `at` (None: deleted or not yet created then),
    /// with the ETag its version had.
    pub async fn get_at(&self, id: &StateId, at: AsOf) -> Result<Option<StoredState>, StateError> {
        let row = self.history_at(at)?.get_at(id, at).await?;
        Ok(row.map(StoredRow::parse).transpose()?)
    }

    /// A page of the ids `pattern` matches within `scope` as they stand now,
    /// or stood at `at`, each with its version; and whether more follow.
    pub async fn list_as_of(
        &self,
        pattern: &StatePattern,
        scope: &Scope,
        cursor: Option<&PageCursor>,
        limit: PageLimit,
        at: Option<AsOf>,
    ) -> Result<(Vec<StateSummary>, bool), StateError> {
        let Some(at) = at else {
            return Ok(self.list(pattern, scope, cursor, limit).await?);
        };
        let (rows, has_more) = self.rows_at(pattern, scope, cursor, limit, at).await?;
        let summaries = rows
            .into_iter()
            .map(|row| StateSummary {
                id: row.id,
                updated_at_ms: row.updated_at_ms,
            })
            .collect();
        Ok((summaries, has_more))
    }

    /// As [`States::list_as_of`], with each state's document.
    pub async fn list_documents_as_of(
        &self,
        pattern: &StatePattern,
        scope: &Scope,
        cursor: Option<&PageCursor>,
        limit: PageLimit,
        at: Option<AsOf>,
    ) -> Result<(Vec<StoredState>, bool), StateError> {
        let Some(at) = at else {
            return Ok(self.list_documents(pattern, scope, cursor, limit).await?);
        };
        let (rows, has_more) = self.rows_at(pattern, scope, cursor, limit, at).await?;
        let states = rows
            .into_iter()
            .map(StoredRow::parse)
            .collect::<Result<_, _>>()?;
        Ok((states, has_more))
    }

    async fn rows_at(
        &self,
        pattern: &StatePattern,
        scope: &Scope,
        cursor: Option<&PageCursor>,
        limit: PageLimit,
        at: AsOf,
    ) -> Result<(Vec<StoredRow>, bool), StateError> {
        let selection = Selection::Matching(pattern.clone(), scope.clone());
        Ok(self
            .history_at(at)?
            .page_at(&selection, at, cursor, limit)
            .await?)
    }
}
