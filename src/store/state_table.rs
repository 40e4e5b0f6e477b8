//! The state table: read with FINAL, written with explicit versions.

use serde::{Deserialize, Serialize};

use std::sync::Arc;
use std::time::Instant;

use super::checked_insert::{CheckedInsert, Expected};
use super::client::ClickHouse;
use super::ddl::Placement;
use super::error::StoreError;
use super::read_ahead::ReadAhead;
use super::read_batch::ReadBatch;
use super::stored::StoredRow;
use crate::domain::{PageCursor, PageLimit, Scope, StateId, StatePattern, Version};

/// One entry of a listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateSummary {
    pub id: StateId,
    pub updated_at_ms: i64,
}

#[derive(clickhouse::Row, Serialize)]
struct StateRowOut {
    state_id: String,
    partial_state: Option<String>,
    completed_state: Option<String>,
    updated_at: i64,
}

#[derive(clickhouse::Row, Deserialize)]
struct ListedRow {
    state_id: String,
    partial_state: Option<String>,
    completed_state: Option<String>,
    updated_at_ms: i64,
}

impl ListedRow {
    /// None for a row whose state_id no request can name (another writer's).
    fn into_row(self) -> Option<StoredRow> {
        StateId::parse(self.state_id).ok().map(|id| {
            StoredRow::from_columns(
                id,
                self.completed_state,
                self.partial_state,
                self.updated_at_ms,
            )
        })
    }
}

/// The row as it goes into the state table.
fn row_out(row: &StoredRow) -> StateRowOut {
    StateRowOut {
        state_id: row.id.as_str().to_owned(),
        partial_state: row.partial.clone(),
        completed_state: row.completed.clone(),
        updated_at: row.updated_at_ms,
    }
}

/// The rows of `ids` in `table` (those that exist), in one round trip
/// timed as `operation`.
async fn rows_of(
    ch: &ClickHouse,
    table: &str,
    ids: &[StateId],
    operation: &'static str,
) -> Result<Vec<StoredRow>, StoreError> {
    let sql = format!(
        "SELECT state_id, partial_state, completed_state,
            toUnixTimestamp64Milli(updated_at) AS updated_at_ms
         FROM {table} FINAL WHERE state_id IN {{ids:Array(String)}}"
    );
    let names: Vec<&str> = ids.iter().map(StateId::as_str).collect();
    let query = ch.latest_read(&sql).param("ids", names);
    let rows = ch.timed(operation, query.fetch_all::<ListedRow>()).await?;
    Ok(rows.into_iter().filter_map(ListedRow::into_row).collect())
}

#[derive(clickhouse::Row, Deserialize)]
struct SummaryRow {
    state_id: String,
    updated_at_ms: i64,
}

/// The state table's DDL (see [`Placement`]).
pub(super) fn create_table_sql(table: &str, placement: &Placement) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table}{} (
            state_id String,
            partial_state Nullable(String),
            completed_state Nullable(String),
            updated_at DateTime64(3) DEFAULT now64(3)
        ) ENGINE = {} ORDER BY state_id",
        placement.on_cluster(),
        placement.merge_tree("ReplacingMergeTree", "updated_at"),
    )
}

#[derive(Clone)]
pub struct StateStore {
    ch: ClickHouse,
    /// `schema`.`table`, ready to splice into SQL (both parts are plain identifiers).
    table: String,
    /// Point reads of current rows, coalesced.
    gets: Arc<ReadBatch<StateId, StoredRow>>,
    /// Current rows that writes' routing reads found.
    read_ahead: Arc<ReadAhead>,
}

impl StateStore {
    pub(super) fn new(ch: ClickHouse, table: String, read_ahead: Arc<ReadAhead>) -> Self {
        let gets = {
            let (ch, table) = (ch.clone(), table.clone());
            ReadBatch::new("state", ch.metrics.clone(), move |ids: Vec<StateId>| {
                let (ch, table) = (ch.clone(), table.clone());
                Box::pin(async move {
                    let rows = rows_of(&ch, &table, &ids, "get").await?;
                    Ok(rows.into_iter().map(|row| (row.id.clone(), row)).collect())
                })
            })
        };
        Self {
            ch,
            table,
            gets: Arc::new(gets),
            read_ahead,
        }
    }

    /// Creates the state table if missing. Its layout is the seed plugin's,
    /// so either can serve a database the other wrote.
    pub async fn ensure_table(&self, placement: &Placement) -> Result<(), StoreError> {
        let create_table = create_table_sql(&self.table, placement);
        self.ch.ddl(&create_table).await
    }

    /// The stored row of `id`, read together with the others asked for
    /// while a read was on its way (see `read_batch`).
    pub async fn get(&self, id: &StateId) -> Result<Option<StoredRow>, StoreError> {
        self.gets.read(id.clone()).await
    }

    /// The row of `id` that a write's routing read found, if that read was
    /// asked for at `since` or later (see `read_ahead`): taken, so only one
    /// write uses it. With when the read was asked for; None when there is
    /// no such row, and the write reads it.
    pub fn take_read_ahead(
        &self,
        id: &StateId,
        since: Instant,
    ) -> Option<(Instant, Option<StoredRow>)> {
        self.read_ahead.take(id, since)
    }

    /// The stored rows of `ids` (those that exist), in one round trip.
    pub async fn get_many(&self, ids: &[StateId]) -> Result<Vec<StoredRow>, StoreError> {
        rows_of(&self.ch, &self.table, ids, "get_many").await
    }

    /// Writes rows straight into the state table (history off), all in one
    /// INSERT; refused whole (`StoreError::Stale`) unless each id of
    /// `expected` is still at the version it names.
    pub async fn put(
        &self,
        rows: &[StoredRow],
        expected: &[Expected<'_>],
    ) -> Result<(), StoreError> {
        if expected.is_empty() {
            return self
                .ch
                .timed("put", async {
                    let mut insert = self
                        .ch
                        .client()
                        .insert_unescaped::<StateRowOut>(&self.table)
                        .await?;
                    for row in rows {
                        insert.write(&row_out(row)).await?;
                    }
                    insert.end().await
                })
                .await;
        }
        let rows: Vec<_> = rows
            .iter()
            .map(|row| {
                (
                    row.id.as_str(),
                    &row.partial,
                    &row.completed,
                    row.updated_at_ms,
                )
            })
            .collect();
        CheckedInsert {
            table: &self.table,
            columns: "state_id, partial_state, completed_state, updated_at",
            structure: "state_id String, partial_state Nullable(String), \
                completed_state Nullable(String), updated_at Int64",
            select: "state_id, partial_state, completed_state, fromUnixTimestamp64Milli(updated_at)",
            state_table: &self.table,
        }
        .run(&self.ch, "put", &rows, expected)
        .await
    }

    /// The current version of `id`, without its document.
    pub async fn version(&self, id: &StateId) -> Result<Option<Version>, StoreError> {
        let sql = format!(
            "SELECT toUnixTimestamp64Milli(updated_at) FROM {} FINAL
             WHERE state_id = {{id:String}} LIMIT 1",
            self.table
        );
        let query = self.ch.latest_read(&sql).param("id", id.as_str());
        let version = self.ch.timed("get", query.fetch_optional::<i64>()).await?;
        Ok(version.map(Version::from_millis))
    }

    /// The current version of each of `ids` that exists (milliseconds, as
    /// `updated_at`), in one statement without documents: what the watch
    /// poller reads once a second for every id someone waits on.
    pub async fn versions(&self, ids: &[StateId]) -> Result<Vec<(StateId, i64)>, StoreError> {
        let sql = format!(
            "SELECT state_id, toUnixTimestamp64Milli(updated_at) FROM {} FINAL
             WHERE state_id IN {{ids:Array(String)}}",
            self.table
        );
        let names: Vec<&str> = ids.iter().map(StateId::as_str).collect();
        let query = self.ch.latest_read(&sql).param("ids", names);
        let rows = self
            .ch
            .timed("watch", query.fetch_all::<(String, i64)>())
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(|(id, version)| StateId::parse(id).ok().map(|id| (id, version)))
            .collect())
    }

    /// `schema`.`table`, for queries that read it into another table.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Deletes the rows of `ids`, in one statement.
    pub async fn delete_many(&self, ids: &[StateId]) -> Result<(), StoreError> {
        let selection = Selection::Ids(ids.to_vec());
        let sql = format!("DELETE FROM {} WHERE {}", self.table, selection.sql());
        let query = selection
            .bind(self.ch.client().query(&sql))
            .with_setting("lightweight_deletes_sync", "2");
        self.ch.timed("delete", query.execute()).await
    }

    /// Up to `limit` ids matching `pattern` within `scope`, in byte order,
    /// after `cursor`. Also answers whether more follow.
    pub async fn list(
        &self,
        pattern: &StatePattern,
        scope: &Scope,
        cursor: Option<&PageCursor>,
        limit: PageLimit,
    ) -> Result<(Vec<StateSummary>, bool), StoreError> {
        let (rows, has_more) = self
            .page::<SummaryRow>(
                "state_id, toUnixTimestamp64Milli(updated_at) AS updated_at_ms",
                pattern,
                scope,
                cursor,
                limit,
            )
            .await?;
        let summaries = rows
            .into_iter()
            .filter_map(|row| {
                // Another writer may have stored an empty id, which no request can name.
                StateId::parse(row.state_id).ok().map(|id| StateSummary {
                    id,
                    updated_at_ms: row.updated_at_ms,
                })
            })
            .collect();
        Ok((summaries, has_more))
    }

    /// As [`StateStore::list`], with each state's stored row.
    pub async fn list_rows(
        &self,
        pattern: &StatePattern,
        scope: &Scope,
        cursor: Option<&PageCursor>,
        limit: PageLimit,
    ) -> Result<(Vec<StoredRow>, bool), StoreError> {
        let (rows, has_more) = self
            .page::<ListedRow>(
                "state_id, partial_state, completed_state, \
                 toUnixTimestamp64Milli(updated_at) AS updated_at_ms",
                pattern,
                scope,
                cursor,
                limit,
            )
            .await?;
        let rows = rows.into_iter().filter_map(ListedRow::into_row).collect();
        Ok((rows, has_more))
    }

    /// One page of `columns` of the states matching `pattern` after `cursor`,
    /// in byte order of their ids, and whether another page follows.
    async fn page<T: clickhouse::RowOwned + clickhouse::RowRead>(
        &self,
        columns: &str,
        pattern: &StatePattern,
        scope: &Scope,
        cursor: Option<&PageCursor>,
        limit: PageLimit,
    ) -> Result<(Vec<T>, bool), StoreError> {
        let filter = Selection::Matching(pattern.clone(), scope.clone());
        let sql = format!(
            "SELECT {columns} FROM {} FINAL
             WHERE state_id > {{after:String}} AND {}
             ORDER BY state_id LIMIT {{limit:UInt32}}",
            self.table,
            filter.sql()
        );
        let after = cursor.map_or("", |c| c.last_seen().as_str());
        let query = filter
            .bind(self.ch.client().query(&sql))
            .param("after", after)
            // One more than asked tells whether another page exists.
            .param("limit", limit.get() + 1);
        let mut rows = self.ch.timed("list", query.fetch_all::<T>()).await?;
        let has_more = rows.len() > limit.get() as usize;
        rows.truncate(limit.get() as usize);
        Ok((rows, has_more))
    }
}

/// The states a statement is about: ids named one by one (a batch's
/// deletes), or every id a glob matches within a token's scope.
pub enum Selection {
    Ids(Vec<StateId>),
    Matching(StatePattern, Scope),
}

impl Selection {
    /// The WHERE condition. A glob gets a key-range prefix (so ClickHouse can
    /// use the primary key) plus the full match, skipped when it is all
    /// stars; a scope short of every id adds its own match.
    pub fn sql(&self) -> &'static str {
        match self {
            Self::Ids(_) => "state_id IN {ids:Array(String)}",
            Self::Matching(pattern, scope) => {
                match (pattern.matches_everything(), scope.is_everything()) {
                    (true, true) => "1",
                    (true, false) => "match(state_id, {scope:String})",
                    (false, true) => {
                        "startsWith(state_id, {prefix:String}) AND match(state_id, {regex:String})"
                    }
                    (false, false) => {
                        "startsWith(state_id, {prefix:String}) AND match(state_id, {regex:String}) \
                         AND match(state_id, {scope:String})"
                    }
                }
            }
        }
    }

    pub fn bind(&self, query: clickhouse::query::Query) -> clickhouse::query::Query {
        match self {
            Self::Ids(ids) => {
                query.param("ids", ids.iter().map(StateId::as_str).collect::<Vec<_>>())
            }
            Self::Matching(pattern, scope) => {
                let query = match scope.to_regex() {
                    Some(regex) => query.param("scope", regex),
                    None => query,
                };
                if pattern.matches_everything() {
                    query
                } else {
                    query
                        .param("prefix", pattern.literal_prefix())
                        .param("regex", pattern.to_regex())
                }
            }
        }
    }
}

/// The version a write of `id` stamps: after this gateway's clock, after the
/// version it replaces and after `at_least`, so it wins even over a row
/// another writer stamped with a clock ahead of ours, and two writes in one
/// millisecond still resolve to the later one.
pub fn next_version(
    replacing: Option<&StoredRow>,
    at_least: Option<Version>,
    now_ms: i64,
) -> Version {
    let floor = replacing.map_or(i64::MIN, |current| current.updated_at_ms + 1);
    let floor = floor.max(at_least.map_or(i64::MIN, Version::millis));
    Version::from_millis(now_ms.max(floor))
}
