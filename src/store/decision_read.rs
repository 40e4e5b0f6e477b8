//! The read that decides a lone member's claim (see
//! `locks::claim::membership`): one id's lock rows, as `lock_rows_sql`
//! reads them, and whether any other gateway may claim, in one statement
//! instead of two. The members half is a scalar subquery, read once the
//! statement is on its way, so it began after the candidate landed, and the
//! lock rows were read before its answer came back: the window the rule
//! bounds runs from the statement's send to its answer, as it ran from the
//! members read's send to the rows read's answer.

use super::client::ClickHouse;
use super::error::StoreError;
use super::lease_rows::{
    IdLocks, LOCK_COLUMNS, LeaseRows, LockRowIn, in_lock_order, lock_rows_filter,
};
use crate::domain::StateId;

/// The row that carries the count of other gateways that may claim, in its
/// `fencing_token`: no lock row has this kind.
const KIND_OTHERS: i8 = -1;

/// The statement: the id's lock rows, and one row counting the other
/// gateways that `others_sql` (a `SELECT count()` with `{gateway:UUID}`)
/// finds. Unordered: the lock rows are put in `lock_rows_sql`'s order here.
fn decision_sql(lease_table: &str, rows: LeaseRows, others_sql: &str) -> String {
    format!(
        "SELECT {LOCK_COLUMNS} FROM {lease_table} FINAL WHERE {}
         UNION ALL
         SELECT toInt8({KIND_OTHERS}) AS kind_code, '' AS state_id, '' AS claim_id,
                '' AS lease_id, '' AS gateway_id, '' AS owner,
                toUInt64(ifNull(({others_sql}), 0)) AS fencing_token,
                toInt64(0) AS created_ms, toInt64(0) AS expires_ms, toUInt8(0) AS released,
                toUInt64(0) AS version, '' AS advertise_url, toUInt64(0) AS lock_delay_ms,
                toInt64(0) AS ended_ms, '' AS info,
                CAST('' AS LowCardinality(String)) AS ended_by, '' AS actor, '' AS reason,
                toUInt32(0) AS pool_limit, toUInt32(0) AS slots, toUInt8(0) AS unexpired",
        lock_rows_filter("state_id = {id:String}", rows)
    )
}

/// Reads `id`'s lock rows in `lease_table`, and whether a gateway other
/// than `gateway` may claim (see `MemberStore::others_sql`).
pub(super) async fn decision_read(
    ch: &ClickHouse,
    (lease_table, rows): (&str, LeaseRows),
    others_sql: &str,
    id: &StateId,
    gateway: uuid::Uuid,
) -> Result<(IdLocks, bool), StoreError> {
    let sql = decision_sql(lease_table, rows, others_sql);
    let query = ch
        .latest_read(&sql)
        .param("id", id.as_str())
        .param("gateway", gateway.to_string());
    let found = ch
        .timed("decision_read", query.fetch_all::<LockRowIn>())
        .await?;
    let (counted, mut locks): (Vec<_>, Vec<_>) = found
        .into_iter()
        .partition(|row| row.kind_code == KIND_OTHERS);
    in_lock_order(&mut locks);
    let others = counted.iter().any(|row| row.fencing_token > 0);
    Ok((IdLocks::assemble(locks)?, others))
}
