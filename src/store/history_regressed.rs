//! History read across states for the bookmark guard's views: the versions
//! that moved bookmarks backwards or dropped them, and whether each
//! stream's newest change did.

use serde::Deserialize;

use super::error::StoreError;
use super::history_table::HistoryStore;
use super::state_table::Selection;
use crate::domain::{StateId, Version};

/// Whether the newest change of a state's stream moved it backwards.
#[derive(clickhouse::Row, Deserialize, Debug)]
pub struct LastChange {
    pub state_id: String,
    pub stream: String,
    pub regressed: bool,
}

/// A version that moved bookmarks backwards or dropped them, as the
/// regressions view lists it.
#[derive(clickhouse::Row, Deserialize, Debug)]
pub struct RegressedVersion {
    pub state_id: String,
    pub version_ms: i64,
    pub regressed_streams: Vec<String>,
    /// Streams whose bookmark the version dropped.
    pub lost_streams: Vec<String>,
    pub actor: String,
    pub operation: String,
    /// Empty for a change made without a lease.
    pub lease_owner: String,
}

impl HistoryStore {
    /// Up to `limit` versions that moved a stream's bookmark backwards or
    /// dropped it, of
    /// the ids `selection` holds, newest first.
    pub async fn regressed(
        &self,
        selection: &Selection,
        limit: u32,
    ) -> Result<Vec<RegressedVersion>, StoreError> {
        let sql = format!(
            "SELECT state_id, toUnixTimestamp64Milli(version) AS version_ms, regressed_streams,
                lost_streams, actor, operation, lease_owner
             FROM {} WHERE (notEmpty(regressed_streams) OR notEmpty(lost_streams)) AND {}
             ORDER BY version DESC, state_id LIMIT {{limit:UInt32}}",
            self.table,
            selection.sql()
        );
        let query = selection
            .bind(self.ch.client().query(&sql))
            .param("limit", limit);
        self.ch
            .timed("history_list", query.fetch_all::<RegressedVersion>())
            .await
    }

    /// For each (state, stream) of `states` (ids with their current version),
    /// whether the newest version up to the current one that changed the
    /// stream also regressed it. Versions after the current one are changes
    /// whose state row failed, which the state never took.
    pub async fn last_changes_regressed(
        &self,
        states: &[(&StateId, Version)],
    ) -> Result<Vec<LastChange>, StoreError> {
        if states.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!(
            "SELECT state_id, stream, argMax(has(regressed_streams, stream), version) AS regressed
             FROM {} ARRAY JOIN changed_streams AS stream
             WHERE state_id IN {{ids:Array(String)}}
               AND version <= fromUnixTimestamp64Milli(
                 arrayElement({{bounds:Array(Int64)}}, indexOf({{ids:Array(String)}}, state_id)))
             GROUP BY state_id, stream",
            self.table
        );
        let ids: Vec<&str> = states.iter().map(|(id, _)| id.as_str()).collect();
        let bounds: Vec<i64> = states.iter().map(|(_, v)| v.millis()).collect();
        let query = self
            .ch
            .client()
            .query(&sql)
            .param("ids", ids)
            .param("bounds", bounds);
        self.ch
            .timed("history_list", query.fetch_all::<LastChange>())
            .await
    }
}
