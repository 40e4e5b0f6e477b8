//! Each id's lease history, `<table>_lease_history`: one row per lease, fed
//! by a materialized view, `<table>_lease_history_writes`, from every lease
//! row the gateways write. The lease table keeps only an id's latest lease
//! (its rows replace each other); this one keeps each lease's latest row, so
//! it knows how every lease ended, for as long as state history is kept.

use std::collections::HashMap;

use serde::Deserialize;
use uuid::Uuid;

use super::client::ClickHouse;
use super::ddl::{Placement, retention_alter, retention_ttl};
use super::error::StoreError;
use super::lease_rows::{ENDED_FORCED, ENDED_RELEASED};
use crate::domain::{Forced, LeaseInfo, LeaseState, StateId};

/// One lease of an id, as its history shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PastLease {
    pub owner: String,
    pub fencing_token: u64,
    pub info: LeaseInfo,
    pub acquired_ms: i64,
    /// How and when it ended; none while it runs.
    pub ended: Option<(LeaseEnd, i64)>,
}

/// How a lease ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseEnd {
    Released,
    Expired,
    Forced(Forced),
}

impl LeaseEnd {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Released => ENDED_RELEASED,
            Self::Expired => "expired",
            Self::Forced(_) => ENDED_FORCED,
        }
    }
}

#[derive(clickhouse::Row, Deserialize)]
struct HistoryRowIn {
    owner: String,
    fencing_token: u64,
    info: String,
    acquired_ms: i64,
    expires_ms: i64,
    released: u8,
    ended_ms: i64,
    ended_by: String,
    actor: String,
    reason: String,
    unexpired: u8,
}

/// A lease's row with its id (the RowBinary format knows no flattening).
#[derive(clickhouse::Row, Deserialize)]
struct LeaseRowIn {
    #[serde(with = "clickhouse::serde::uuid")]
    lease_id: Uuid,
    owner: String,
    fencing_token: u64,
    info: String,
    acquired_ms: i64,
    expires_ms: i64,
    released: u8,
    ended_ms: i64,
    ended_by: String,
    actor: String,
    reason: String,
    unexpired: u8,
}

impl LeaseRowIn {
    fn into_end(self) -> (Uuid, Option<(LeaseEnd, i64)>) {
        let row = HistoryRowIn {
            owner: self.owner,
            fencing_token: self.fencing_token,
            info: self.info,
            acquired_ms: self.acquired_ms,
            expires_ms: self.expires_ms,
            released: self.released,
            ended_ms: self.ended_ms,
            ended_by: self.ended_by,
            actor: self.actor,
            reason: self.reason,
            unexpired: self.unexpired,
        };
        (self.lease_id, row.into_past().ended)
    }
}

impl HistoryRowIn {
    fn into_past(self) -> PastLease {
        let ended = match LeaseState::from_column(self.released) {
            // No row marks an expiry: a lease nobody ended is expired once
            // its time is up (a handed-over one, too, unless adopted and renewed).
            LeaseState::Held | LeaseState::HandedOver => {
                (self.unexpired == 0).then_some((LeaseEnd::Expired, self.expires_ms))
            }
            LeaseState::Released => {
                let end = if self.ended_by == ENDED_FORCED {
                    LeaseEnd::Forced(Forced {
                        actor: self.actor,
                        reason: self.reason,
                    })
                } else {
                    LeaseEnd::Released
                };
                Some((end, self.ended_ms))
            }
        };
        PastLease {
            owner: self.owner,
            fencing_token: self.fencing_token,
            info: LeaseInfo::from_stored(&self.info),
            acquired_ms: self.acquired_ms,
            ended,
        }
    }
}

#[derive(Clone)]
pub struct LeaseHistoryStore {
    ch: ClickHouse,
    /// `schema`.`table_lease_history`.
    table: String,
    /// `schema`.`table_lease_history_writes`, the view that fills it.
    view: String,
    /// `schema`.`table_lease`, the rows the view reads.
    lease_table: String,
    /// How long leases are kept (None: forever), as state history.
    retention: Option<std::time::Duration>,
}

impl LeaseHistoryStore {
    pub fn new(
        ch: ClickHouse,
        table: String,
        view: String,
        lease_table: String,
        retention: Option<std::time::Duration>,
    ) -> Self {
        Self {
            ch,
            table,
            view,
            lease_table,
            retention,
        }
    }

    /// Creates the table and its view; the lease table must have its
    /// columns by then (the view reads them).
    pub async fn ensure(
        &self,
        table_engine: Option<&str>,
        view_present: bool,
        placement: &Placement,
    ) -> Result<(), StoreError> {
        let mut statements = Vec::new();
        match table_engine {
            None => statements.push(create_table_sql(&self.table, self.retention, placement)),
            Some(engine) => statements.extend(retention_sql(
                &self.table,
                self.retention,
                engine,
                placement,
            )),
        }
        if !view_present {
            statements.push(create_view_sql(
                &self.view,
                &self.lease_table,
                &self.table,
                placement,
            ));
        }
        for sql in statements {
            self.ch.ddl(&sql).await?;
        }
        Ok(())
    }

    /// How each lease of `leases` (state_id, lease_id) ended, or None while
    /// it runs; a lease whose row has not landed is absent.
    pub async fn ends_of(
        &self,
        leases: &[(&str, Uuid)],
    ) -> Result<HashMap<Uuid, Option<(LeaseEnd, i64)>>, StoreError> {
        if leases.is_empty() {
            return Ok(HashMap::new());
        }
        let sql = format!(
            "SELECT lease_id, owner, fencing_token, info,
                    toUnixTimestamp64Milli(created_at) AS acquired_ms,
                    toUnixTimestamp64Milli(expires_at) AS expires_ms, released,
                    toUnixTimestamp64Milli(ended_at) AS ended_ms, ended_by, actor, reason,
                    expires_at > now64(3) AS unexpired
             FROM {} FINAL
             WHERE state_id IN {{ids:Array(String)}} AND lease_id IN {{leases:Array(UUID)}}",
            self.table
        );
        let ids: Vec<&str> = leases.iter().map(|(id, _)| *id).collect();
        let lease_ids: Vec<String> = leases.iter().map(|(_, lease)| lease.to_string()).collect();
        let query = self
            .ch
            .latest_read(&sql)
            .param("ids", ids)
            .param("leases", lease_ids);
        let rows = self
            .ch
            .timed("lease_history", query.fetch_all::<LeaseRowIn>())
            .await?;
        Ok(rows.into_iter().map(LeaseRowIn::into_end).collect())
    }

    /// The newest `limit` leases of `id`, newest first.
    pub async fn leases(&self, id: &StateId, limit: u32) -> Result<Vec<PastLease>, StoreError> {
        let sql = format!(
            "SELECT owner, fencing_token, info, toUnixTimestamp64Milli(created_at) AS acquired_ms,
                    toUnixTimestamp64Milli(expires_at) AS expires_ms, released,
                    toUnixTimestamp64Milli(ended_at) AS ended_ms, ended_by, actor, reason,
                    expires_at > now64(3) AS unexpired
             FROM {} FINAL
             WHERE state_id = {{id:String}}
             ORDER BY created_at DESC, fencing_token DESC
             LIMIT {{limit:UInt32}}",
            self.table
        );
        let query = self
            .ch
            .latest_read(&sql)
            .param("id", id.as_str())
            .param("limit", limit);
        let rows = self
            .ch
            .timed("lease_history", query.fetch_all::<HistoryRowIn>())
            .await?;
        Ok(rows.into_iter().map(HistoryRowIn::into_past).collect())
    }
}

/// Kept from the lease's expiry on, as long as state history keeps versions.
fn ttl_clause(retention: Option<std::time::Duration>) -> Option<String> {
    retention_ttl("toDateTime(expires_at)", retention)
}

/// The table's DDL: a lease's rows replace each other by `version`, as in
/// the lease table, but per lease.
pub(super) fn create_table_sql(
    table: &str,
    retention: Option<std::time::Duration>,
    placement: &Placement,
) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table}{} (
            state_id String,
            lease_id UUID,
            owner String,
            fencing_token UInt64,
            created_at DateTime64(3),
            expires_at DateTime64(3),
            released UInt8,
            version UInt64,
            info String,
            ended_at DateTime64(3),
            ended_by LowCardinality(String),
            actor String,
            reason String
        ) ENGINE = {} ORDER BY (state_id, lease_id) {}",
        placement.on_cluster(),
        placement.merge_tree("ReplacingMergeTree", "version"),
        ttl_clause(retention).unwrap_or_default()
    )
}

/// The view's DDL: every lease row written to the lease table lands here too.
pub(super) fn create_view_sql(
    view: &str,
    lease_table: &str,
    table: &str,
    placement: &Placement,
) -> String {
    format!(
        "CREATE MATERIALIZED VIEW IF NOT EXISTS {view}{} TO {table} AS
         SELECT state_id, lease_id, owner, fencing_token, created_at, expires_at, released,
                version, info, ended_at, ended_by, actor, reason
         FROM {lease_table} WHERE kind = 'lease'",
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

#[cfg(test)]
mod tests {
    use super::*;

    fn row(released: LeaseState, unexpired: bool) -> HistoryRowIn {
        HistoryRowIn {
            owner: "worker".into(),
            fencing_token: 3,
            info: r#"{"pid":7}"#.into(),
            acquired_ms: 1_000,
            expires_ms: 31_000,
            released: released as u8,
            ended_ms: 0,
            ended_by: String::new(),
            actor: String::new(),
            reason: String::new(),
            unexpired: u8::from(unexpired),
        }
    }

    #[test]
    fn a_running_lease_has_no_end_and_an_unended_one_past_its_time_expired() {
        assert_eq!(row(LeaseState::Held, true).into_past().ended, None);
        assert_eq!(
            row(LeaseState::Held, false).into_past().ended,
            Some((LeaseEnd::Expired, 31_000))
        );
        assert_eq!(
            row(LeaseState::HandedOver, false).into_past().ended,
            Some((LeaseEnd::Expired, 31_000))
        );
    }

    #[test]
    fn a_released_row_says_whether_it_was_forced_and_by_whom() {
        let mut released = row(LeaseState::Released, false);
        released.ended_ms = 5_000;
        released.ended_by = ENDED_RELEASED.into();
        assert_eq!(
            released.into_past().ended,
            Some((LeaseEnd::Released, 5_000))
        );
        let mut forced = row(LeaseState::Released, true);
        forced.ended_ms = 6_000;
        forced.ended_by = ENDED_FORCED.into();
        forced.actor = "ops".into();
        forced.reason = "stuck".into();
        let past = forced.into_past();
        assert_eq!(past.info.as_str(), r#"{"pid":7}"#);
        let (end, at) = past.ended.unwrap();
        assert_eq!(at, 6_000);
        assert_eq!(end.as_str(), "forced");
        assert_eq!(
            end,
            LeaseEnd::Forced(Forced {
                actor: "ops".into(),
                reason: "stuck".into()
            })
        );
    }

    #[test]
    fn the_table_is_kept_as_long_as_state_history() {
        let placement = Placement::new(None, "Atomic");
        let day = Some(std::time::Duration::from_secs(86_400));
        let create = create_table_sql("`m`.`t_lease_history`", day, &placement);
        assert!(create.contains("TTL toDateTime(expires_at) + toIntervalSecond(86400)"));
        assert!(!create_table_sql("t", None, &placement).contains("TTL"));
        let engine = format!(
            "ReplacingMergeTree(version) ORDER BY (state_id, lease_id) {}",
            ttl_clause(day).unwrap()
        );
        assert_eq!(retention_sql("t", day, &engine, &placement), None);
        assert_eq!(
            retention_sql("t", None, &engine, &placement).as_deref(),
            Some("ALTER TABLE t REMOVE TTL")
        );
    }
}
