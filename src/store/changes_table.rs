//! The changes table, `<table>_changes`: one row per change of a state,
//! stamped with ClickHouse's own insert time (`seen_at`) and ordered by it,
//! kept for `--watch-retention` (a TTL, with a margin). The change feed
//! reads it.
//!
//! Two materialized views write it, so no writer has to: one on the state
//! table (every row that lands there, whether the gateway's history view
//! wrote it or the ClickHouse plugin INSERTed it), and one on the history
//! table for tombstones, which never reach the state table. Materialized
//! views cascade, so a gateway write (an INSERT into history) reaches the
//! changes table through both. With history off, the gateway records its
//! deletes here itself ([`ChangesStore::record_tombstones`]).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::client::ClickHouse;
use super::ddl::{Placement, retention_alter, retention_ttl};
use super::error::StoreError;
use super::state_table::Selection;
use super::stored::StoredRow;
use crate::domain::{StateId, Version};

/// Kept past the retention, so a cursor just inside it still finds every
/// row it needs.
const TTL_MARGIN: Duration = Duration::from_secs(60);

/// One change as read, with the state's current row (None: no row now).
#[derive(Clone, Debug, PartialEq)]
pub struct ChangeRecord {
    /// The changed state.
    pub id: StateId,
    /// The changed version, milliseconds since the epoch.
    pub version_ms: i64,
    /// A tombstone: the change deleted the state.
    pub deleted: bool,
    /// When ClickHouse inserted the change, microseconds since the epoch.
    pub seen_us: i64,
    /// The state's row when the change was read.
    pub current: Option<StoredRow>,
}

/// What one read of the changes table answered.
#[derive(Clone, Debug, PartialEq)]
pub struct ChangeRead {
    /// ClickHouse's clock as it read, microseconds since the epoch.
    pub read_at_us: i64,
    /// Every change after the read's start, in no order.
    pub rows: Vec<ChangeRecord>,
}

/// A row as the read statement answers it; the one with `deleted = 2`
/// carries only the read time.
#[derive(clickhouse::Row, Deserialize)]
struct ChangeRowIn {
    state_id: String,
    /// The change's version, milliseconds.
    version_ms: i64,
    /// 1 for a tombstone; 2 marks the row that carries the read time.
    deleted: u8,
    /// Its insert time (or the read time), microseconds.
    seen_us: i64,
    /// 1 when the state has a row now (the join found one).
    present: u8,
    /// That row's `updated_at`, milliseconds.
    updated_ms: i64,
    completed_state: Option<String>,
    partial_state: Option<String>,
}

#[derive(clickhouse::Row, Serialize)]
struct TombstoneOut<'a> {
    state_id: &'a str,
    /// The delete's version, milliseconds.
    version: i64,
    /// Always 1; `seen_at` takes its default, ClickHouse's clock.
    deleted: u8,
}

/// The changes table's DDL (see [`Placement`]).
pub(super) fn create_table_sql(table: &str, retention: Duration, placement: &Placement) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table}{} (
            state_id String,
            version DateTime64(3),
            deleted UInt8,
            seen_at DateTime64(6) DEFAULT now64(6)
        ) ENGINE = {} ORDER BY seen_at {}",
        placement.on_cluster(),
        placement.merge_tree("MergeTree", ""),
        ttl_clause(retention)
    )
}

fn ttl_clause(retention: Duration) -> String {
    retention_ttl("toDateTime(seen_at)", Some(retention + TTL_MARGIN))
        .expect("a retention gives a TTL")
}

/// The view that records every row landing in the state table.
pub(super) fn create_writes_view_sql(
    view: &str,
    state_table: &str,
    table: &str,
    placement: &Placement,
) -> String {
    format!(
        "CREATE MATERIALIZED VIEW IF NOT EXISTS {view}{} TO {table} AS
         SELECT state_id, updated_at AS version, 0 AS deleted FROM {state_table}",
        placement.on_cluster()
    )
}

/// The view that records the history's tombstones. It selects the column
/// itself: `1 AS deleted` would be what the WHERE saw, and match every row.
pub(super) fn create_deletes_view_sql(
    view: &str,
    history_table: &str,
    table: &str,
    placement: &Placement,
) -> String {
    format!(
        "CREATE MATERIALIZED VIEW IF NOT EXISTS {view}{} TO {table} AS
         SELECT state_id, version, deleted FROM {history_table} WHERE deleted = 1",
        placement.on_cluster()
    )
}

#[derive(Clone)]
pub struct ChangesStore {
    /// The one client.
    ch: ClickHouse,
    /// `schema`.`table_changes`.
    table: String,
    /// `schema`.`table_changes_writes`, the view on the state table.
    writes_view: String,
    /// `schema`.`table_changes_deletes`, the view on the history table.
    deletes_view: String,
    /// `schema`.`table`.
    state_table: String,
    /// `schema`.`table_history`; None when history is off.
    history_table: Option<String>,
    /// How long a change is kept: `--watch-retention`.
    retention: Duration,
}

/// The names the changes store works with.
pub struct ChangesTables {
    /// `schema`.`table_changes`.
    pub table: String,
    /// `schema`.`table_changes_writes`.
    pub writes_view: String,
    /// `schema`.`table_changes_deletes`.
    pub deletes_view: String,
    /// `schema`.`table`.
    pub state_table: String,
    /// `schema`.`table_history`; None when history is off.
    pub history_table: Option<String>,
}

impl ChangesStore {
    pub fn new(ch: ClickHouse, tables: ChangesTables, retention: Duration) -> Self {
        Self {
            ch,
            table: tables.table,
            writes_view: tables.writes_view,
            deletes_view: tables.deletes_view,
            state_table: tables.state_table,
            history_table: tables.history_table,
            retention,
        }
    }

    /// How long a change is kept.
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// Creates the table (or brings its TTL to the retention) and the views
    /// missing; the state and history tables exist by then.
    pub async fn ensure(
        &self,
        table_engine: Option<&str>,
        writes_view_present: bool,
        deletes_view_present: bool,
        placement: &Placement,
    ) -> Result<(), StoreError> {
        let mut statements = Vec::new();
        match table_engine {
            None => statements.push(create_table_sql(&self.table, self.retention, placement)),
            Some(engine) => statements.extend(retention_alter(
                &self.table,
                Some(ttl_clause(self.retention)),
                engine,
                placement,
            )),
        }
        if !writes_view_present {
            statements.push(create_writes_view_sql(
                &self.writes_view,
                &self.state_table,
                &self.table,
                placement,
            ));
        }
        if let Some(history_table) = self
            .history_table
            .as_deref()
            .filter(|_| !deletes_view_present)
        {
            statements.push(create_deletes_view_sql(
                &self.deletes_view,
                history_table,
                &self.table,
                placement,
            ));
        }
        for sql in statements {
            self.ch.ddl(&sql).await?;
        }
        Ok(())
    }

    /// Records deletes made with history off, which no view sees (a DELETE
    /// inserts nothing).
    pub async fn record_tombstones(
        &self,
        deleted: &[(StateId, Version)],
    ) -> Result<(), StoreError> {
        self.ch
            .timed("changes_record", async {
                let mut insert = self
                    .ch
                    .client()
                    .insert_unescaped::<TombstoneOut<'_>>(&self.table)
                    .await?;
                for (id, version) in deleted {
                    insert
                        .write(&TombstoneOut {
                            state_id: id.as_str(),
                            version: version.millis(),
                            deleted: 1,
                        })
                        .await?;
                }
                insert.end().await
            })
            .await
    }

    /// Every change of the ids `selection` holds inserted after `from_us`
    /// (microseconds), each with its state's current row, and ClickHouse's
    /// clock: one statement, timed as `operation`.
    pub async fn read(
        &self,
        from_us: i64,
        selection: &Selection,
        operation: &'static str,
    ) -> Result<ChangeRead, StoreError> {
        let filter = selection.sql();
        let after = "seen_at > fromUnixTimestamp64Micro({from:Int64})";
        let sql = format!(
            "SELECT c.state_id AS state_id, toUnixTimestamp64Milli(c.version) AS version_ms,
                c.deleted AS deleted, toUnixTimestamp64Micro(c.seen_at) AS seen_us,
                s.present AS present, s.updated_ms AS updated_ms,
                s.completed_state AS completed_state, s.partial_state AS partial_state
             FROM (SELECT state_id, version, deleted, seen_at FROM {changes}
                   WHERE {after} AND {filter}) AS c
             LEFT JOIN (
                SELECT state_id, toUInt8(1) AS present,
                    toUnixTimestamp64Milli(updated_at) AS updated_ms, completed_state, partial_state
                FROM {state} FINAL
                WHERE state_id IN (SELECT state_id FROM {changes} WHERE {after} AND {filter})
             ) AS s ON s.state_id = c.state_id
             UNION ALL
             SELECT '', toInt64(0), toUInt8(2), toUnixTimestamp64Micro(now64(6)), toUInt8(0),
                toInt64(0), CAST(NULL, 'Nullable(String)'), CAST(NULL, 'Nullable(String)')
             SETTINGS join_use_nulls = 0",
            changes = self.table,
            state = self.state_table,
        );
        let query = selection
            .bind(self.ch.latest_read(&sql))
            .param("from", from_us);
        let rows = self
            .ch
            .timed(operation, query.fetch_all::<ChangeRowIn>())
            .await?;
        let mut read_at_us = from_us;
        let mut records = Vec::with_capacity(rows.len());
        for row in rows {
            if row.deleted == 2 {
                read_at_us = read_at_us.max(row.seen_us);
                continue;
            }
            // Another writer may have stored an id no request can name.
            let Ok(id) = StateId::parse(row.state_id) else {
                continue;
            };
            let current = (row.present == 1).then(|| {
                StoredRow::from_columns(
                    id.clone(),
                    row.completed_state,
                    row.partial_state,
                    row.updated_ms,
                )
            });
            records.push(ChangeRecord {
                id,
                version_ms: row.version_ms,
                deleted: row.deleted == 1,
                seen_us: row.seen_us,
                current,
            });
        }
        Ok(ChangeRead {
            read_at_us,
            rows: records,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_kept_a_margin_past_the_retention_and_ordered_by_insert_time() {
        let sql = create_table_sql(
            "`m`.`state_changes`",
            Duration::from_secs(3600),
            &Placement::new(None, "Atomic"),
        );
        assert!(sql.contains("ENGINE = MergeTree() ORDER BY seen_at TTL toDateTime(seen_at) + toIntervalSecond(3660)"), "{sql}");
        assert!(sql.contains("seen_at DateTime64(6) DEFAULT now64(6)"));
    }

    #[test]
    fn the_tombstone_view_filters_on_the_column_not_an_alias() {
        let sql = create_deletes_view_sql(
            "`m`.`v`",
            "`m`.`state_history`",
            "`m`.`state_changes`",
            &Placement::new(
                Some(super::super::ddl::ClusterName::parse("c").unwrap()),
                "Atomic",
            ),
        );
        assert!(sql.contains(
            "SELECT state_id, version, deleted FROM `m`.`state_history` WHERE deleted = 1"
        ));
        assert!(!sql.contains("AS deleted"));
        assert!(sql.contains("`m`.`v` ON CLUSTER 'c' TO `m`.`state_changes`"));
    }
}
