//! The runs table, `<table>_runs`: append-only, one `start` row when a run
//! is recorded and one `end` row per attempt to end it (its `PATCH`, or a
//! gateway that found its lease ended first). Of several end rows the one
//! ClickHouse received first counts, so a run ends once whichever gateways
//! race to end it. Kept from the run's start as long as state history.
//!
//! It also answers what a run needs of the history table: the versions in a
//! window and the state as it stood at an instant.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::client::ClickHouse;
use super::ddl::{Placement, retention_alter, retention_ttl};
use super::error::StoreError;
use super::state_table::Selection;
use crate::domain::{StateDocument, StateId};

/// No exit code, or no signal, in a run's columns.
const NONE: i32 = -1;

/// A run's start, as recorded.
pub struct RunStart<'a> {
    pub run_id: Uuid,
    pub state_id: &'a StateId,
    pub lease_id: Uuid,
    pub owner: &'a str,
    pub fencing_token: u64,
    pub actor: &'a str,
    pub info: &'a str,
    pub started_ms: i64,
}

/// A run's end, as recorded: `status` is `succeeded`, `failed` or `lost`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunEnd {
    pub status: String,
    pub ended_ms: i64,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    /// The run's info with the end's merged in.
    pub info: String,
    pub versions: u64,
    /// `[{"stream","from","to"}]` as JSON text.
    pub advanced: String,
}

/// A run as read: its start and, once ended, its end.
#[derive(Clone, Debug)]
pub struct StoredRun {
    pub run_id: Uuid,
    pub state_id: String,
    pub lease_id: Uuid,
    pub owner: String,
    pub fencing_token: u64,
    pub actor: String,
    pub info: String,
    pub started_ms: i64,
    pub end: Option<RunEnd>,
}

/// What a listing asks for.
pub struct RunQuery<'a> {
    pub selection: &'a Selection,
    /// Statuses to keep (empty: all), `running` among them.
    pub statuses: &'a [String],
    pub since_ms: Option<i64>,
    /// Runs strictly older than this (started_ms, run_id), for a next page.
    pub before: Option<(i64, Uuid)>,
    pub limit: u32,
}

#[derive(clickhouse::Row, Serialize)]
struct RunRowOut<'a> {
    #[serde(with = "clickhouse::serde::uuid")]
    run_id: Uuid,
    state_id: &'a str,
    kind: &'static str,
    #[serde(with = "clickhouse::serde::uuid")]
    end_id: Uuid,
    #[serde(with = "clickhouse::serde::uuid")]
    lease_id: Uuid,
    owner: &'a str,
    fencing_token: u64,
    actor: &'a str,
    info: &'a str,
    started_at: i64,
    ended_at: i64,
    status: &'a str,
    exit_code: i32,
    signal: i32,
    versions: u64,
    advanced: &'a str,
}

#[derive(clickhouse::Row, Deserialize)]
struct RunRowIn {
    #[serde(with = "clickhouse::serde::uuid")]
    run_id: Uuid,
    #[serde(rename = "r_state_id")]
    state_id: String,
    #[serde(rename = "r_lease_id", with = "clickhouse::serde::uuid")]
    lease_id: Uuid,
    #[serde(rename = "r_owner")]
    owner: String,
    #[serde(rename = "r_fencing_token")]
    fencing_token: u64,
    #[serde(rename = "r_actor")]
    actor: String,
    #[serde(rename = "r_info")]
    info: String,
    started_ms: i64,
    ended: u8,
    end_status: String,
    ended_ms: i64,
    #[serde(rename = "r_exit_code")]
    exit_code: i32,
    #[serde(rename = "r_signal")]
    signal: i32,
    end_info: String,
    #[serde(rename = "r_versions")]
    versions: u64,
    #[serde(rename = "r_advanced")]
    advanced: String,
}

impl RunRowIn {
    fn into_run(self) -> StoredRun {
        let some = |n: i32| (n != NONE).then_some(n);
        StoredRun {
            run_id: self.run_id,
            state_id: self.state_id,
            lease_id: self.lease_id,
            owner: self.owner,
            fencing_token: self.fencing_token,
            actor: self.actor,
            info: self.info,
            started_ms: self.started_ms,
            end: (self.ended != 0).then(|| RunEnd {
                status: self.end_status,
                ended_ms: self.ended_ms,
                exit_code: some(self.exit_code),
                signal: some(self.signal),
                info: self.end_info,
                versions: self.versions,
                advanced: self.advanced,
            }),
        }
    }
}

/// Each run's start and its first end, one row per run: the end rows are
/// ordered by arrival, then by their own id, so every column comes from one.
/// No alias is a column's name, which ClickHouse would read as the alias
/// everywhere else in the statement.
const RUN_COLUMNS: &str = "run_id, any(state_id) AS r_state_id,
    anyIf(lease_id, kind = 'start') AS r_lease_id, anyIf(owner, kind = 'start') AS r_owner,
    anyIf(fencing_token, kind = 'start') AS r_fencing_token, anyIf(actor, kind = 'start') AS r_actor,
    anyIf(info, kind = 'start') AS r_info,
    toUnixTimestamp64Milli(anyIf(started_at, kind = 'start')) AS started_ms,
    countIf(kind = 'end') > 0 AS ended,
    argMinIf(status, (recorded_at, end_id), kind = 'end') AS end_status,
    toUnixTimestamp64Milli(argMinIf(ended_at, (recorded_at, end_id), kind = 'end')) AS ended_ms,
    argMinIf(exit_code, (recorded_at, end_id), kind = 'end') AS r_exit_code,
    argMinIf(signal, (recorded_at, end_id), kind = 'end') AS r_signal,
    argMinIf(info, (recorded_at, end_id), kind = 'end') AS end_info,
    argMinIf(versions, (recorded_at, end_id), kind = 'end') AS r_versions,
    argMinIf(advanced, (recorded_at, end_id), kind = 'end') AS r_advanced";

#[derive(Clone)]
pub struct RunStore {
    ch: ClickHouse,
    /// `schema`.`table_runs`.
    table: String,
    /// `schema`.`table_history`, whose versions a run counts.
    history_table: String,
    retention: Option<std::time::Duration>,
}

impl RunStore {
    pub fn new(
        ch: ClickHouse,
        table: String,
        history_table: String,
        retention: Option<std::time::Duration>,
    ) -> Self {
        Self {
            ch,
            table,
            history_table,
            retention,
        }
    }

    /// Creates the table, or brings its TTL to the retention.
    pub async fn ensure(
        &self,
        engine: Option<&str>,
        placement: &Placement,
    ) -> Result<(), StoreError> {
        let sql = match engine {
            None => Some(create_table_sql(&self.table, self.retention, placement)),
            Some(engine) => {
                retention_alter(&self.table, ttl_clause(self.retention), engine, placement)
            }
        };
        match sql {
            Some(sql) => self.ch.ddl(&sql).await,
            None => Ok(()),
        }
    }

    pub async fn start(&self, run: &RunStart<'_>) -> Result<(), StoreError> {
        let row = RunRowOut {
            run_id: run.run_id,
            state_id: run.state_id.as_str(),
            kind: "start",
            end_id: Uuid::nil(),
            lease_id: run.lease_id,
            owner: run.owner,
            fencing_token: run.fencing_token,
            actor: run.actor,
            info: run.info,
            started_at: run.started_ms,
            ended_at: 0,
            status: "running",
            exit_code: NONE,
            signal: NONE,
            versions: 0,
            advanced: "[]",
        };
        self.insert(&row).await
    }

    /// Writes an end of `run`; the first end ClickHouse received stands.
    pub async fn end(&self, run: &StoredRun, end: &RunEnd) -> Result<(), StoreError> {
        let row = RunRowOut {
            run_id: run.run_id,
            state_id: &run.state_id,
            kind: "end",
            end_id: Uuid::new_v4(),
            lease_id: run.lease_id,
            owner: &run.owner,
            fencing_token: run.fencing_token,
            actor: &run.actor,
            info: &end.info,
            // The start's, so that the TTL takes a run's rows together.
            started_at: run.started_ms,
            ended_at: end.ended_ms,
            status: &end.status,
            exit_code: end.exit_code.unwrap_or(NONE),
            signal: end.signal.unwrap_or(NONE),
            versions: end.versions,
            advanced: &end.advanced,
        };
        self.insert(&row).await
    }

    async fn insert(&self, row: &RunRowOut<'_>) -> Result<(), StoreError> {
        self.ch
            .timed("runs_record", async {
                let mut insert = self
                    .ch
                    .client()
                    .insert_unescaped::<RunRowOut<'_>>(&self.table)
                    .await?;
                insert.write(row).await?;
                insert.end().await
            })
            .await
    }

    /// One run.
    pub async fn get(&self, run_id: Uuid) -> Result<Option<StoredRun>, StoreError> {
        let sql = format!(
            "SELECT {RUN_COLUMNS} FROM {} WHERE run_id = {{run:UUID}}
             GROUP BY run_id HAVING countIf(kind = 'start') > 0",
            self.table
        );
        let query = self.ch.latest_read(&sql).param("run", run_id.to_string());
        let row = self
            .ch
            .timed("runs_read", query.fetch_optional::<RunRowIn>())
            .await?;
        Ok(row.map(RunRowIn::into_run))
    }

    /// The run a lease holds, if any.
    pub async fn of_lease(
        &self,
        id: &StateId,
        lease_id: Uuid,
    ) -> Result<Option<StoredRun>, StoreError> {
        let sql = format!(
            "SELECT {RUN_COLUMNS} FROM {} WHERE state_id = {{id:String}} AND lease_id = {{lease:UUID}}
             GROUP BY run_id HAVING countIf(kind = 'start') > 0 LIMIT 1",
            self.table
        );
        let query = self
            .ch
            .latest_read(&sql)
            .param("id", id.as_str())
            .param("lease", lease_id.to_string());
        let row = self
            .ch
            .timed("runs_read", query.fetch_optional::<RunRowIn>())
            .await?;
        Ok(row.map(RunRowIn::into_run))
    }

    /// Runs newest `started_at` first, one more than `limit` when more follow.
    pub async fn list(&self, query: &RunQuery<'_>) -> Result<Vec<StoredRun>, StoreError> {
        let status_filter = if query.statuses.is_empty() {
            ""
        } else {
            "AND has({statuses:Array(String)}, if(ended, end_status, 'running'))"
        };
        let sql = format!(
            "SELECT {RUN_COLUMNS} FROM {} WHERE {}
               AND started_at >= fromUnixTimestamp64Milli({{since:Int64}})
               AND (started_at, run_id) < (fromUnixTimestamp64Milli({{before_ms:Int64}}), toUUID({{before_id:String}}))
             GROUP BY run_id HAVING countIf(kind = 'start') > 0 {status_filter}
             ORDER BY started_ms DESC, run_id DESC LIMIT {{limit:UInt32}}",
            self.table,
            query.selection.sql()
        );
        let (before_ms, before_id) = query.before.unwrap_or((i64::MAX / 4, Uuid::max()));
        let mut read = query
            .selection
            .bind(self.ch.latest_read(&sql))
            .param("since", query.since_ms.unwrap_or(0))
            .param("before_ms", before_ms)
            .param("before_id", before_id.to_string())
            .param("limit", query.limit + 1);
        if !query.statuses.is_empty() {
            read = read.param("statuses", query.statuses);
        }
        let rows = self
            .ch
            .timed("runs_read", read.fetch_all::<RunRowIn>())
            .await?;
        Ok(rows.into_iter().map(RunRowIn::into_run).collect())
    }

    /// The runs of `selection` with no end yet.
    pub async fn open(&self, selection: &Selection) -> Result<Vec<StoredRun>, StoreError> {
        let sql = format!(
            "SELECT {RUN_COLUMNS} FROM {} WHERE {}
             GROUP BY run_id HAVING countIf(kind = 'start') > 0 AND NOT ended",
            self.table,
            selection.sql()
        );
        let read = selection.bind(self.ch.latest_read(&sql));
        let rows = self
            .ch
            .timed("runs_read", read.fetch_all::<RunRowIn>())
            .await?;
        Ok(rows.into_iter().map(RunRowIn::into_run).collect())
    }

    /// Each id's newest run, and when a run of it last succeeded (ms).
    pub async fn latest(
        &self,
        selection: &Selection,
    ) -> Result<Vec<(StoredRun, Option<i64>)>, StoreError> {
        let sql = format!(
            "SELECT {RUN_COLUMNS} FROM {} WHERE {}
             GROUP BY run_id HAVING countIf(kind = 'start') > 0
             ORDER BY r_state_id, started_ms DESC, run_id DESC",
            self.table,
            selection.sql()
        );
        let read = selection.bind(self.ch.latest_read(&sql));
        let rows = self
            .ch
            .timed("runs_read", read.fetch_all::<RunRowIn>())
            .await?;
        let mut latest: Vec<(StoredRun, Option<i64>)> = Vec::new();
        for run in rows.into_iter().map(RunRowIn::into_run) {
            let succeeded = run
                .end
                .as_ref()
                .filter(|end| end.status == "succeeded")
                .map(|end| end.ended_ms);
            match latest.last_mut() {
                Some((newest, last)) if newest.state_id == run.state_id => {
                    *last = (*last).max(succeeded);
                }
                _ => latest.push((run, succeeded)),
            }
        }
        Ok(latest)
    }

    /// How many versions of `id` were written from `from_ms` to `to_ms`.
    pub async fn versions_between(
        &self,
        id: &str,
        from_ms: i64,
        to_ms: i64,
    ) -> Result<u64, StoreError> {
        let sql = format!(
            "SELECT count() FROM {} WHERE state_id = {{id:String}}
               AND version >= fromUnixTimestamp64Milli({{from:Int64}})
               AND version <= fromUnixTimestamp64Milli({{to:Int64}})",
            self.history_table
        );
        let query = self
            .ch
            .client()
            .query(&sql)
            .param("id", id)
            .param("from", from_ms)
            .param("to", to_ms);
        self.ch
            .timed("history_list", query.fetch_one::<u64>())
            .await
    }

    /// The state `id` had at `at_ms`: its newest version then (None: none,
    /// or deleted).
    pub async fn state_at(
        &self,
        id: &str,
        at_ms: i64,
    ) -> Result<Option<StateDocument>, StoreError> {
        let sql = format!(
            "SELECT deleted, completed_state, partial_state FROM {}
             WHERE state_id = {{id:String}} AND version <= fromUnixTimestamp64Milli({{at:Int64}})
             ORDER BY version DESC, deleted LIMIT 1",
            self.history_table
        );
        let query = self
            .ch
            .client()
            .query(&sql)
            .param("id", id)
            .param("at", at_ms);
        let row = self
            .ch
            .timed(
                "history_get",
                query.fetch_optional::<(u8, Option<String>, Option<String>)>(),
            )
            .await?;
        let Some((0, completed, partial)) = row else {
            return Ok(None);
        };
        StateDocument::from_stored(completed.as_deref(), partial.as_deref())
            .map(Some)
            .map_err(|source| StoreError::Corrupt {
                id: id.to_owned(),
                source,
            })
    }
}

fn ttl_clause(retention: Option<std::time::Duration>) -> Option<String> {
    retention_ttl("toDateTime(started_at)", retention)
}

fn create_table_sql(
    table: &str,
    retention: Option<std::time::Duration>,
    placement: &Placement,
) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table}{} (
            run_id UUID,
            state_id String,
            kind LowCardinality(String),
            end_id UUID,
            lease_id UUID,
            owner String,
            fencing_token UInt64,
            actor String,
            info String,
            started_at DateTime64(3),
            ended_at DateTime64(3),
            status LowCardinality(String),
            exit_code Int32,
            signal Int32,
            versions UInt64,
            advanced String,
            recorded_at DateTime64(6) DEFAULT now64(6)
        ) ENGINE = {} ORDER BY (state_id, started_at, run_id) {}",
        placement.on_cluster(),
        placement.merge_tree("MergeTree", ""),
        ttl_clause(retention).unwrap_or_default()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_kept_from_each_start_as_long_as_history() {
        let placement = Placement::new(None, "Atomic");
        let day = Some(std::time::Duration::from_secs(86_400));
        let create = create_table_sql("`m`.`t_runs`", day, &placement);
        assert!(create.contains("TTL toDateTime(started_at) + toIntervalSecond(86400)"));
        assert!(!create_table_sql("t", None, &placement).contains("TTL"));
    }
}
