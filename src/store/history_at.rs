//! States as they stood at an instant (`at=`), read from `<table>_history`
//! in one statement a page: for each id, the newest version at or before
//! the instant, left out when that version is a tombstone.
//!
//! The state table's row of an id joins its versions in that statement: a
//! row at or before the instant is the id's newest version, so it is the
//! answer even when the retention's TTL has removed the history row that
//! made it (a state unchanged for longer than the retention), or no history
//! row ever made it (a row another writer put straight into the table).

use serde::Deserialize;

use super::error::StoreError;
use super::history_table::HistoryStore;
use super::state_table::Selection;
use super::stored::StoredRow;
use crate::domain::{AsOf, PageCursor, PageLimit, StateId};

#[derive(clickhouse::Row, Deserialize)]
struct RowAt {
    state_id: String,
    completed_state: Option<String>,
    partial_state: Option<String>,
    version_ms: i64,
}

impl HistoryStore {
    /// The earliest instant whose states history can still tell, at `now_ms`
    /// (None when versions are kept forever).
    pub fn oldest_askable(&self, now_ms: i64) -> Option<i64> {
        let retention = self.retention?;
        let kept = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        Some(now_ms.saturating_sub(kept))
    }

    /// `id` as it stood at `at`: None when it did not exist then.
    pub async fn get_at(&self, id: &StateId, at: AsOf) -> Result<Option<StoredRow>, StoreError> {
        let selection = Selection::Ids(vec![id.clone()]);
        let (mut rows, _) = self.rows_at(&selection, at, None, 1).await?;
        Ok(rows.pop())
    }

    /// Up to `limit` states of `selection` as they stood at `at`, in byte
    /// order of their ids after `cursor`; also answers whether more follow.
    pub async fn page_at(
        &self,
        selection: &Selection,
        at: AsOf,
        cursor: Option<&PageCursor>,
        limit: PageLimit,
    ) -> Result<(Vec<StoredRow>, bool), StoreError> {
        self.rows_at(selection, at, cursor, limit.get()).await
    }

    /// Up to `limit` states (and whether more follow), in one statement.
    /// Two rows of one version (the state row and the history row that made
    /// it, or a failed change and the next one stamped in the same
    /// millisecond) read as the one that is not a tombstone.
    pub async fn rows_at(
        &self,
        selection: &Selection,
        at: AsOf,
        cursor: Option<&PageCursor>,
        limit: u32,
    ) -> Result<(Vec<StoredRow>, bool), StoreError> {
        let filter = selection.sql();
        let sql = format!(
            "SELECT state_id, completed_state, partial_state, version_ms FROM (
               SELECT state_id, completed_state, partial_state, version_ms, deleted FROM (
                 SELECT state_id, completed_state, partial_state,
                   toUnixTimestamp64Milli(version) AS version_ms, deleted
                 FROM {history}
                 WHERE version <= fromUnixTimestamp64Milli({{at:Int64}})
                   AND state_id > {{after:String}} AND {filter}
                 UNION ALL
                 SELECT state_id, completed_state, partial_state,
                   toUnixTimestamp64Milli(updated_at) AS version_ms, toUInt8(0) AS deleted
                 FROM {state} FINAL
                 WHERE updated_at <= fromUnixTimestamp64Milli({{at:Int64}})
                   AND state_id > {{after:String}} AND {filter}
               )
               ORDER BY state_id, version_ms DESC, deleted
               LIMIT 1 BY state_id
             )
             WHERE deleted = 0 AND state_id != ''
             ORDER BY state_id LIMIT {{limit:UInt32}}",
            history = self.table,
            state = self.state_table,
        );
        let after = cursor.map_or("", |c| c.last_seen().as_str());
        let query = selection
            .bind(self.ch.client().query(&sql))
            .param("at", at.millis())
            .param("after", after)
            // One more than asked tells whether another page exists.
            .param("limit", limit + 1);
        let mut rows = self
            .ch
            .timed("history_at", query.fetch_all::<RowAt>())
            .await?;
        let has_more = rows.len() > limit as usize;
        rows.truncate(limit as usize);
        let rows = rows
            .into_iter()
            .filter_map(|row| {
                StateId::parse(row.state_id).ok().map(|id| {
                    StoredRow::from_columns(
                        id,
                        row.completed_state,
                        row.partial_state,
                        row.version_ms,
                    )
                })
            })
            .collect();
        Ok((rows, has_more))
    }
}
