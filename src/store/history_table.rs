//! The history table, `<table>_history`: one row per change made through the
//! gateway, append-only (MergeTree, ORDER BY (state_id, version)), kept for
//! the retention as a ClickHouse TTL.
//!
//! A write is one INSERT into this table: a materialized view,
//! `<table>_history_writes`, carries each row that is not a tombstone on into
//! the state table, so history costs a write no round trip of its own.
//! ClickHouse writes the history row first and the view's row after it, so
//! every acknowledged change has its version, and a change whose state row
//! then fails leaves a version the state never takes, which is therefore
//! never the current one.

use serde::{Deserialize, Serialize};

use super::checked_insert::{CheckedInsert, Expected};
use super::client::ClickHouse;
use super::ddl::{Placement, retention_alter, retention_ttl};
use super::error::StoreError;
use crate::domain::{Lease, Provenance, StateDocument, StateId, Version};

/// Whether changes leave versions in `<table>_history`, and for how long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum History {
    Off,
    /// Versions are kept for this long (None: forever).
    Kept(Option<std::time::Duration>),
}

/// What a change did; stored as its name, which the API shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    Put,
    Patch,
    Delete,
    DeleteByPattern,
    Rollback,
    ResetStream,
    Import,
    Restore,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Put => "put",
            Self::Patch => "patch",
            Self::Delete => "delete",
            Self::DeleteByPattern => "delete-by-pattern",
            Self::Rollback => "rollback",
            Self::ResetStream => "reset-stream",
            Self::Import => "import",
            Self::Restore => "restore",
        }
    }
}

/// A version about to be made.
pub struct NewVersion<'a> {
    pub id: &'a StateId,
    pub version: Version,
    pub operation: Operation,
    /// None for a tombstone.
    pub doc: Option<&'a StateDocument>,
    pub changed_streams: Vec<String>,
    /// Streams whose bookmarks this version moved backwards.
    pub regressed_streams: Vec<String>,
    /// Streams whose bookmarks this version dropped.
    pub lost_streams: Vec<String>,
    /// The lease this change carried, when the id was locked.
    pub lease: Option<&'a Lease>,
    /// Who made the change, and through which request.
    pub provenance: &'a Provenance,
    /// The version a restore brought back.
    pub restored_from: Option<Version>,
}

impl NewVersion<'_> {
    fn row(&self) -> HistoryRowOut<'_> {
        let (lease, provenance) = (self.lease, self.provenance);
        HistoryRowOut {
            state_id: self.id.as_str(),
            version: self.version.millis(),
            operation: self.operation.as_str(),
            deleted: u8::from(self.doc.is_none()),
            completed_state: self.doc.map(StateDocument::completed_json),
            partial_state: self.doc.map(StateDocument::partial_json),
            changed_streams: self.changed_streams.clone(),
            regressed_streams: self.regressed_streams.clone(),
            lost_streams: self.lost_streams.clone(),
            actor: &provenance.actor,
            lease_owner: lease.map_or("", |l| l.owner.as_str()),
            fencing_token: lease.map_or(0, |l| l.fencing_token),
            request_id: &provenance.request_id,
            user_agent: &provenance.user_agent,
            restored_from: self.restored_from.map(Version::millis),
            reason: &provenance.reason,
        }
    }
}

/// One version as listed: everything but the document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionMeta {
    pub version: Version,
    pub operation: String,
    /// A tombstone: the change deleted the state.
    pub deleted: bool,
    /// Streams whose bookmark this version changed against the one before.
    pub changed_streams: Vec<String>,
    /// Streams whose bookmark it moved backwards (see `domain::bookmark_guard`).
    pub regressed_streams: Vec<String>,
    /// Streams whose bookmark it dropped (see `domain::bookmark_guard`).
    pub lost_streams: Vec<String>,
    pub actor: String,
    pub lease_owner: Option<String>,
    pub fencing_token: Option<u64>,
    pub request_id: String,
    pub user_agent: String,
    /// The version a restore brought back.
    pub restored_from: Option<Version>,
    /// Why, when the change said (a restore's reason); empty otherwise.
    pub reason: String,
}

/// One version with its document (None for a tombstone).
#[derive(Clone, Debug)]
pub struct StoredVersion {
    pub meta: VersionMeta,
    pub doc: Option<StateDocument>,
}

#[derive(clickhouse::Row, Serialize)]
struct HistoryRowOut<'a> {
    state_id: &'a str,
    version: i64,
    operation: &'static str,
    deleted: u8,
    completed_state: Option<String>,
    partial_state: Option<String>,
    changed_streams: Vec<String>,
    regressed_streams: Vec<String>,
    lost_streams: Vec<String>,
    actor: &'a str,
    lease_owner: &'a str,
    fencing_token: u64,
    request_id: &'a str,
    user_agent: &'a str,
    restored_from: Option<i64>,
    reason: &'a str,
}

/// The history table's columns, in the order of [`HistoryRowOut`].
const HISTORY_COLUMNS: &str = "state_id, version, operation, deleted, completed_state, \
    partial_state, changed_streams, regressed_streams, lost_streams, actor, lease_owner, \
    fencing_token, request_id, user_agent, restored_from, reason";

/// A history row as a checked INSERT binds it: a tuple, in column order.
type HistoryTuple<'a> = (
    &'a str,
    i64,
    &'static str,
    u8,
    Option<String>,
    Option<String>,
    Vec<String>,
    Vec<String>,
    Vec<String>,
    &'a str,
    &'a str,
    u64,
    &'a str,
    &'a str,
    Option<i64>,
    &'a str,
);

impl<'a> HistoryRowOut<'a> {
    fn into_tuple(self) -> HistoryTuple<'a> {
        (
            self.state_id,
            self.version,
            self.operation,
            self.deleted,
            self.completed_state,
            self.partial_state,
            self.changed_streams,
            self.regressed_streams,
            self.lost_streams,
            self.actor,
            self.lease_owner,
            self.fencing_token,
            self.request_id,
            self.user_agent,
            self.restored_from,
            self.reason,
        )
    }
}

/// A version as read; listings read no document (NULL halves).
#[derive(clickhouse::Row, Deserialize)]
struct VersionRowIn {
    version_ms: i64,
    operation: String,
    deleted: u8,
    changed_streams: Vec<String>,
    regressed_streams: Vec<String>,
    lost_streams: Vec<String>,
    actor: String,
    lease_owner: String,
    fencing_token: u64,
    request_id: String,
    user_agent: String,
    restored_from_ms: Option<i64>,
    reason: String,
    completed_state: Option<String>,
    partial_state: Option<String>,
}

const META_COLUMNS: &str = "toUnixTimestamp64Milli(version) AS version_ms, operation, deleted, \
    changed_streams, regressed_streams, lost_streams, actor, lease_owner, fencing_token, request_id, user_agent, \
    toUnixTimestamp64Milli(restored_from) AS restored_from_ms, reason";

impl VersionRowIn {
    /// The version of `id`, with its document unless it is a tombstone.
    fn into_version(self, id: &StateId) -> Result<StoredVersion, StoreError> {
        let doc = (self.deleted == 0)
            .then(|| {
                StateDocument::from_stored(
                    self.completed_state.as_deref(),
                    self.partial_state.as_deref(),
                )
            })
            .transpose()
            .map_err(|source| StoreError::Corrupt {
                id: id.as_str().to_owned(),
                source,
            })?;
        let meta = VersionMeta {
            version: Version::from_millis(self.version_ms),
            operation: self.operation,
            deleted: self.deleted != 0,
            changed_streams: self.changed_streams,
            regressed_streams: self.regressed_streams,
            lost_streams: self.lost_streams,
            actor: self.actor,
            lease_owner: Some(self.lease_owner).filter(|o| !o.is_empty()),
            // Tokens start at 1: 0 is a write without a lease.
            fencing_token: Some(self.fencing_token).filter(|t| *t != 0),
            request_id: self.request_id,
            user_agent: self.user_agent,
            restored_from: self.restored_from_ms.map(Version::from_millis),
            reason: self.reason,
        };
        Ok(StoredVersion { meta, doc })
    }
}

fn ttl_clause(retention: Option<std::time::Duration>) -> Option<String> {
    retention_ttl("toDateTime(version)", retention)
}

/// The history table's DDL (see [`Placement`]).
pub(super) fn create_table_sql(
    table: &str,
    retention: Option<std::time::Duration>,
    placement: &Placement,
) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table}{} (
            state_id String,
            version DateTime64(3),
            operation LowCardinality(String),
            deleted UInt8,
            completed_state Nullable(String),
            partial_state Nullable(String),
            changed_streams Array(String),
            regressed_streams Array(String) DEFAULT [],
            lost_streams Array(String) DEFAULT [],
            actor String,
            lease_owner String,
            fencing_token UInt64,
            request_id String,
            user_agent String,
            restored_from Nullable(DateTime64(3)),
            reason String DEFAULT ''
        ) ENGINE = {} ORDER BY (state_id, version) {}",
        placement.on_cluster(),
        placement.merge_tree("MergeTree", ""),
        ttl_clause(retention).unwrap_or_default()
    )
}

/// The view's DDL: it has no engine of its own, it writes the state table.
pub(super) fn create_view_sql(
    view: &str,
    state_table: &str,
    table: &str,
    placement: &Placement,
) -> String {
    format!(
        "CREATE MATERIALIZED VIEW IF NOT EXISTS {view}{} TO {state_table} AS
         SELECT state_id, partial_state, completed_state, version AS updated_at
         FROM {table} WHERE deleted = 0",
        placement.on_cluster()
    )
}

/// The ALTER that brings a table whose engine is `engine_full` to the
/// retention, if it needs one.
pub(super) fn retention_sql(
    table: &str,
    retention: Option<std::time::Duration>,
    engine_full: &str,
    placement: &Placement,
) -> Option<String> {
    retention_alter(table, ttl_clause(retention), engine_full, placement)
}

#[derive(Clone)]
pub struct HistoryStore {
    pub(super) ch: ClickHouse,
    /// `schema`.`table_history`.
    pub(super) table: String,
    /// `schema`.`table_history_writes`, the view that writes the state table.
    view: String,
    /// `schema`.`table`, which the view writes.
    pub(super) state_table: String,
    /// How long versions are kept (None: forever).
    pub(super) retention: Option<std::time::Duration>,
}

impl HistoryStore {
    pub fn new(
        ch: ClickHouse,
        table: String,
        view: String,
        state_table: String,
        retention: Option<std::time::Duration>,
    ) -> Self {
        Self {
            ch,
            table,
            view,
            state_table,
            retention,
        }
    }

    /// The view that writes each version that is not a tombstone into the
    /// state table, as the gateway's own INSERT did before history.
    pub async fn ensure_view(&self, placement: &Placement) -> Result<(), StoreError> {
        let create = create_view_sql(&self.view, &self.state_table, &self.table, placement);
        self.ch.ddl(&create).await
    }

    pub async fn ensure_table(&self, placement: &Placement) -> Result<(), StoreError> {
        let create = create_table_sql(&self.table, self.retention, placement);
        self.ch.ddl(&create).await
    }

    /// Brings an existing table's TTL to the configured retention; a table
    /// that has it already is left alone (its user may lack ALTER).
    pub async fn ensure_retention(
        &self,
        engine_full: &str,
        placement: &Placement,
    ) -> Result<(), StoreError> {
        let Some(sql) = retention_sql(&self.table, self.retention, engine_full, placement) else {
            return Ok(());
        };
        self.ch.ddl(&sql).await
    }

    /// Adds what a table made by an earlier version lacks: the regressed
    /// and the lost streams of each version (empty for the versions before),
    /// and what a restore records (none for the versions before).
    pub async fn upgrade_table(
        &self,
        columns: &[(String, String)],
        placement: &Placement,
    ) -> Result<(), StoreError> {
        let added = [
            (
                "regressed_streams",
                "Array(String) DEFAULT []",
                "changed_streams",
            ),
            (
                "lost_streams",
                "Array(String) DEFAULT []",
                "regressed_streams",
            ),
            ("restored_from", "Nullable(DateTime64(3))", "user_agent"),
            ("reason", "String DEFAULT ''", "restored_from"),
        ];
        for (column, kind, after) in added {
            if columns.iter().any(|(name, _)| name == column) {
                continue;
            }
            let alter = format!(
                "ALTER TABLE {}{} ADD COLUMN IF NOT EXISTS {column} {kind} AFTER {after}",
                self.table,
                placement.on_cluster()
            );
            self.ch.ddl(&alter).await?;
        }
        Ok(())
    }

    /// Writes a batch of changes' versions, and with them their state rows,
    /// in one INSERT; refused whole (`StoreError::Stale`) unless each id of
    /// `expected` is still at the version it names.
    pub async fn record_many(
        &self,
        versions: &[NewVersion<'_>],
        expected: &[Expected<'_>],
    ) -> Result<(), StoreError> {
        let rows = versions.iter().map(NewVersion::row);
        if expected.is_empty() {
            return self
                .ch
                .timed("history_record", async {
                    let mut insert = self
                        .ch
                        .client()
                        .insert_unescaped::<HistoryRowOut<'_>>(&self.table)
                        .await?;
                    for row in rows {
                        insert.write(&row).await?;
                    }
                    insert.end().await
                })
                .await;
        }
        let rows: Vec<_> = rows.map(HistoryRowOut::into_tuple).collect();
        CheckedInsert {
            table: &self.table,
            columns: HISTORY_COLUMNS,
            structure: "state_id String, version Int64, operation String, deleted UInt8, \
                completed_state Nullable(String), partial_state Nullable(String), \
                changed_streams Array(String), regressed_streams Array(String), \
                lost_streams Array(String), actor String, lease_owner String, \
                fencing_token UInt64, request_id String, user_agent String, \
                restored_from Nullable(Int64), reason String",
            select: "state_id, fromUnixTimestamp64Milli(version), operation, deleted, \
                completed_state, partial_state, changed_streams, regressed_streams, \
                lost_streams, actor, lease_owner, fencing_token, request_id, user_agent, \
                fromUnixTimestamp64Milli(restored_from), reason",
            state_table: &self.state_table,
        }
        .run(&self.ch, "history_record", &rows, expected)
        .await
    }

    /// Up to `limit` versions of `id` before `before` (all when None), newest
    /// first, with their documents when `documents` (else none is read);
    /// also answers whether more follow.
    pub async fn list(
        &self,
        id: &StateId,
        before: Option<Version>,
        limit: u32,
        documents: bool,
    ) -> Result<(Vec<StoredVersion>, bool), StoreError> {
        let halves = if documents {
            "completed_state, partial_state"
        } else {
            "CAST(NULL, 'Nullable(String)') AS completed_state,
             CAST(NULL, 'Nullable(String)') AS partial_state"
        };
        let sql = format!(
            "SELECT {META_COLUMNS}, {halves} FROM {}
             WHERE state_id = {{id:String}} AND version < fromUnixTimestamp64Milli({{before:Int64}})
             ORDER BY version DESC LIMIT {{limit:UInt32}}",
            self.table
        );
        let query = self
            .ch
            .client()
            .query(&sql)
            .param("id", id.as_str())
            .param("before", before.map_or(i64::MAX / 4, Version::millis))
            .param("limit", limit + 1);
        let rows = self
            .ch
            .timed("history_list", query.fetch_all::<VersionRowIn>())
            .await?;
        let has_more = rows.len() > limit as usize;
        let versions = rows
            .into_iter()
            .take(limit as usize)
            .map(|row| {
                let mut version = row.into_version(id)?;
                if !documents {
                    version.doc = None;
                }
                Ok(version)
            })
            .collect::<Result<_, StoreError>>()?;
        Ok((versions, has_more))
    }

    /// One version of `id` with its document. Two rows of one version (a
    /// failed change and the next one, stamped in the same millisecond) read
    /// as the one that is not a tombstone.
    pub async fn get(
        &self,
        id: &StateId,
        version: Version,
    ) -> Result<Option<StoredVersion>, StoreError> {
        let sql = format!(
            "SELECT {META_COLUMNS}, completed_state, partial_state FROM {}
             WHERE state_id = {{id:String}} AND version = fromUnixTimestamp64Milli({{version:Int64}})
             ORDER BY deleted LIMIT 1",
            self.table
        );
        let query = self
            .ch
            .client()
            .query(&sql)
            .param("id", id.as_str())
            .param("version", version.millis());
        let Some(row) = self
            .ch
            .timed("history_get", query.fetch_optional::<VersionRowIn>())
            .await?
        else {
            return Ok(None);
        };
        row.into_version(id).map(Some)
    }

    /// The newest tombstone of `id`: the current version of a state that
    /// does not exist.
    pub async fn newest_tombstone(&self, id: &StateId) -> Result<Option<Version>, StoreError> {
        let sql = format!(
            "SELECT toUnixTimestamp64Milli(max(version)) FROM {}
             WHERE state_id = {{id:String}} AND deleted = 1 HAVING count() > 0",
            self.table
        );
        let query = self.ch.client().query(&sql).param("id", id.as_str());
        let newest = self
            .ch
            .timed("history_list", query.fetch_optional::<i64>())
            .await?;
        Ok(newest.map(Version::from_millis))
    }
}
