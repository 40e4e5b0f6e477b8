//! The members table, `<table>_members`: the gateways that take part in
//! table-mode claims, each with an expiry its heartbeat pushes on (by the
//! server's clock, as claim candidates are stamped). A gateway that reads
//! that it is the only live member may claim without settling; the rule is
//! `locks::claim::membership`'s. ReplacingMergeTree keeps each gateway's row
//! with the highest version, the server's clock in ms: a gateway that
//! restarts under the same id outranks its old row with its first beat.

use std::time::Duration;

use uuid::Uuid;

use super::client::ClickHouse;
use super::ddl::Placement;
use super::error::StoreError;

/// The members table's DDL (see [`Placement`]); rows of gone gateways go after a day.
pub(super) fn create_table_sql(table: &str, placement: &Placement) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table}{} (
            gateway_id UUID,
            expires_at DateTime64(3),
            version UInt64
        ) ENGINE = {}
        ORDER BY gateway_id
        TTL toDateTime(expires_at) + INTERVAL 1 DAY",
        placement.on_cluster(),
        placement.merge_tree("ReplacingMergeTree", "version"),
    )
}

#[derive(Clone)]
pub struct MemberStore {
    ch: ClickHouse,
    table: String,
    /// The gateways table (see `gateways_table`): a table-mode gateway
    /// there without a members row is of an earlier version.
    gateways: String,
}

impl MemberStore {
    pub fn new(ch: ClickHouse, table: String, gateways: String) -> Self {
        Self {
            ch,
            table,
            gateways,
        }
    }

    pub async fn ensure_table(&self, placement: &Placement) -> Result<(), StoreError> {
        let create = create_table_sql(&self.table, placement);
        self.ch.ddl(&create).await
    }

    /// Records `gateway_id` as a member for `ttl` from now (server time).
    pub async fn beat(&self, gateway_id: Uuid, ttl: Duration) -> Result<(), StoreError> {
        let sql = format!(
            "INSERT INTO {} (gateway_id, expires_at, version)
             SELECT {{gateway:UUID}}, now64(3) + toIntervalMillisecond({{ttl:UInt64}}),
                    toUInt64(toUnixTimestamp64Milli(now64(3)))",
            self.table
        );
        let query = self
            .ch
            .client()
            .query(&sql)
            .param("gateway", gateway_id.to_string())
            .param("ttl", u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
        self.ch.timed("member_beat", query.execute()).await
    }

    /// The count of the gateways other than `{gateway:UUID}` that may claim
    /// in table mode: a live member, or a gateway of an earlier version
    /// (which keeps no members row), known by a table-mode row in the
    /// gateways table without a members row, live or not: such a gateway
    /// registers before it serves, and its row stays a day after it stopped
    /// (the TTL).
    pub(super) fn others_sql(&self) -> String {
        format!(
            "SELECT count() FROM (
                 SELECT gateway_id FROM {members} FINAL
                 WHERE expires_at > now64(3) AND gateway_id != {{gateway:UUID}}
                 UNION ALL
                 SELECT gateway_id FROM {gateways} FINAL
                 WHERE coordination = 'table' AND gateway_id != {{gateway:UUID}}
                   AND gateway_id NOT IN (SELECT gateway_id FROM {members}))",
            members = self.table,
            gateways = self.gateways
        )
    }
}
