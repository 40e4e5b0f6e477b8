//! The routing read of a write to one state: the id's lock rows (its claim
//! candidates and lease row, which route the write and check it against the
//! lock) and its current row (which the write is decided against), in one
//! statement instead of two. Coalesced as every point read is (see
//! `read_batch`): ids asked for while one is on its way go out together.

use std::collections::HashMap;
use std::sync::Arc;

use serde::Deserialize;

use super::client::ClickHouse;
use super::lease_rows::{LOCK_COLUMNS, LeaseRows, LockRowIn, in_lock_order, lock_rows_filter};
use super::read_batch::ReadBatch;
use super::stored::StoredRow;
use crate::domain::StateId;

/// What one routing read finds of an id.
#[derive(Clone, Default)]
pub(super) struct RouteRows {
    /// Its claim and lease rows, in `lock_rows_sql`'s order.
    pub locks: Vec<LockRowIn>,
    /// Its state row; None when it has none.
    pub row: Option<StoredRow>,
}

/// A lock row or a state row ([`KIND_STATE`]), in the columns of both.
#[derive(clickhouse::Row, Deserialize)]
struct RouteRowIn {
    kind_code: i8,
    state_id: String,
    claim_id: String,
    lease_id: String,
    gateway_id: String,
    owner: String,
    fencing_token: u64,
    created_ms: i64,
    expires_ms: i64,
    released: u8,
    version: u64,
    advertise_url: String,
    lock_delay_ms: u64,
    ended_ms: i64,
    info: String,
    ended_by: String,
    actor: String,
    reason: String,
    pool_limit: u32,
    slots: u32,
    unexpired: u8,
    partial_state: Option<String>,
    completed_state: Option<String>,
    updated_at_ms: i64,
}

const KIND_STATE: i8 = 0;

impl RouteRowIn {
    /// Files the row under its id: as the id's state, or one of its lock rows.
    fn file(self, by_id: &mut HashMap<String, RouteRows>) {
        let found = by_id.entry(self.state_id.clone()).or_default();
        if self.kind_code == KIND_STATE {
            // Another writer's row under an id no request can name is none of ours.
            found.row = StateId::parse(self.state_id).ok().map(|id| {
                StoredRow::from_columns(
                    id,
                    self.completed_state,
                    self.partial_state,
                    self.updated_at_ms,
                )
            });
            return;
        }
        found.locks.push(LockRowIn {
            kind_code: self.kind_code,
            state_id: self.state_id,
            claim_id: self.claim_id,
            lease_id: self.lease_id,
            gateway_id: self.gateway_id,
            owner: self.owner,
            fencing_token: self.fencing_token,
            created_ms: self.created_ms,
            expires_ms: self.expires_ms,
            released: self.released,
            version: self.version,
            advertise_url: self.advertise_url,
            lock_delay_ms: self.lock_delay_ms,
            ended_ms: self.ended_ms,
            info: self.info,
            ended_by: self.ended_by,
            actor: self.actor,
            reason: self.reason,
            pool_limit: self.pool_limit,
            slots: self.slots,
            unexpired: self.unexpired,
        });
    }
}

/// The statement: the lock rows as `lock_rows_sql` reads them, beside the
/// state rows in the same columns. Unordered: sorting the union in
/// ClickHouse costs about as much as its two halves (measured with chDB), so
/// each id's lock rows are put in `lock_rows_sql`'s order here (see
/// [`in_lock_order`]).
fn route_rows_sql(lease_table: &str, state_table: &str, rows: LeaseRows) -> String {
    let ids = "state_id IN {ids:Array(String)}";
    format!(
        "SELECT {LOCK_COLUMNS}, CAST(NULL AS Nullable(String)) AS partial_state,
                CAST(NULL AS Nullable(String)) AS completed_state, toInt64(0) AS updated_at_ms
         FROM {lease_table} FINAL WHERE {}
         UNION ALL
         SELECT toInt8({KIND_STATE}) AS kind_code, state_id, '' AS claim_id, '' AS lease_id,
                '' AS gateway_id, '' AS owner, toUInt64(0) AS fencing_token,
                toInt64(0) AS created_ms, toInt64(0) AS expires_ms, toUInt8(0) AS released,
                toUInt64(0) AS version, '' AS advertise_url, toUInt64(0) AS lock_delay_ms,
                toInt64(0) AS ended_ms, '' AS info,
                CAST('' AS LowCardinality(String)) AS ended_by, '' AS actor, '' AS reason,
                toUInt32(0) AS pool_limit, toUInt32(0) AS slots, toUInt8(0) AS unexpired,
                partial_state, completed_state,
                toUnixTimestamp64Milli(updated_at) AS updated_at_ms
         FROM {state_table} FINAL WHERE {ids}",
        lock_rows_filter(ids, rows)
    )
}

/// The coalesced routing reads of the ids of `lease_table` and `state_table`.
pub(super) fn route_reads(
    ch: ClickHouse,
    lease_table: String,
    state_table: String,
    rows: LeaseRows,
) -> Arc<ReadBatch<String, RouteRows>> {
    let sql: Arc<str> = route_rows_sql(&lease_table, &state_table, rows).into();
    Arc::new(ReadBatch::new(
        "route",
        ch.metrics.clone(),
        move |ids: Vec<String>| {
            let (ch, sql) = (ch.clone(), sql.clone());
            Box::pin(async move {
                let query = ch.latest_read(&sql).param("ids", ids);
                let rows = ch
                    .timed("route_read", query.fetch_all::<RouteRowIn>())
                    .await?;
                let mut by_id = HashMap::new();
                for row in rows {
                    row.file(&mut by_id);
                }
                for found in by_id.values_mut() {
                    in_lock_order(&mut found.locks);
                }
                Ok(by_id)
            })
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row as the statement answers it: a claim (`kind_code` 1) made at
    /// `created_ms`, or the state row.
    fn row(kind_code: i8, state_id: &str, claim_id: &str, created_ms: i64) -> RouteRowIn {
        RouteRowIn {
            kind_code,
            state_id: state_id.into(),
            claim_id: claim_id.into(),
            lease_id: String::new(),
            gateway_id: String::new(),
            owner: String::new(),
            fencing_token: 0,
            created_ms,
            expires_ms: 0,
            released: 0,
            version: 0,
            advertise_url: String::new(),
            lock_delay_ms: 0,
            ended_ms: 0,
            info: String::new(),
            ended_by: String::new(),
            actor: String::new(),
            reason: String::new(),
            pool_limit: 0,
            slots: 0,
            unexpired: 1,
            partial_state: (kind_code == KIND_STATE).then(|| "{}".into()),
            completed_state: (kind_code == KIND_STATE).then(|| r#"{"a": 1}"#.into()),
            updated_at_ms: 7,
        }
    }

    #[test]
    fn rows_are_filed_by_id_and_lock_rows_put_in_the_lock_reads_order() {
        let mut by_id = HashMap::new();
        for found in [
            row(1, "a", "b0000000-0000-0000-0000-000000000000", 5),
            row(KIND_STATE, "a", "", 0),
            row(1, "a", "a0000000-0000-0000-0000-000000000000", 5),
            row(1, "a", "c0000000-0000-0000-0000-000000000000", 3),
            row(1, "b", "d0000000-0000-0000-0000-000000000000", 1),
        ] {
            found.file(&mut by_id);
        }
        for found in by_id.values_mut() {
            in_lock_order(&mut found.locks);
        }
        let a = &by_id["a"];
        let order: Vec<&str> = a.locks.iter().map(|l| &l.claim_id[..1]).collect();
        assert_eq!(order, ["c", "a", "b"], "earliest first, then by claim id");
        let state = a.row.as_ref().expect("a's state row");
        assert_eq!(
            state.etag(),
            StoredRow::from_columns(
                StateId::parse("a".to_owned()).unwrap(),
                Some(r#"{"a": 1}"#.into()),
                Some("{}".into()),
                7,
            )
            .etag()
        );
        assert!(by_id["b"].row.is_none(), "b has no state row");
        assert_eq!(by_id["b"].locks.len(), 1);
    }
}
