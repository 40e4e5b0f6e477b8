//! The gateways table, `<table>_gateways`: each running gateway's id and
//! `--coordination` mode, with an expiry its heartbeat pushes on, so that a
//! gateway of the other mode can refuse to start on the same tables.
//! ReplacingMergeTree keeps each gateway's row with the highest version: the
//! server's clock in ms for a heartbeat, all ones for the row a stopping
//! gateway leaves, which no late heartbeat then outranks.

use std::time::Duration;

use uuid::Uuid;

use super::client::ClickHouse;
use super::ddl::Placement;
use super::error::StoreError;
use crate::domain::Coordination;

/// The gateways table's DDL (see [`Placement`]); rows of stopped gateways go after a day.
pub(super) fn create_table_sql(table: &str, placement: &Placement) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table}{} (
            gateway_id UUID,
            coordination LowCardinality(String),
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
pub struct GatewayStore {
    ch: ClickHouse,
    table: String,
}

impl GatewayStore {
    pub fn new(ch: ClickHouse, table: String) -> Self {
        Self { ch, table }
    }

    pub async fn ensure_table(&self, placement: &Placement) -> Result<(), StoreError> {
        let create = create_table_sql(&self.table, placement);
        self.ch.ddl(&create).await
    }

    /// Records `gateway_id` as serving in `mode` for `ttl` from now (server time).
    pub async fn heartbeat(
        &self,
        gateway_id: Uuid,
        mode: Coordination,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let sql = format!(
            "INSERT INTO {} (gateway_id, coordination, expires_at, version)
             SELECT {{gateway:UUID}}, {{mode:String}}, now64(3) + toIntervalMillisecond({{ttl:UInt64}}),
                    toUInt64(toUnixTimestamp64Milli(now64(3)))",
            self.table
        );
        let query = self
            .ch
            .client()
            .query(&sql)
            .param("gateway", gateway_id.to_string())
            .param("mode", mode.as_str())
            .param("ttl", u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX));
        self.ch.timed("gateway_heartbeat", query.execute()).await
    }

    /// Marks `gateway_id` stopped, for good.
    pub async fn withdraw(&self, gateway_id: Uuid, mode: Coordination) -> Result<(), StoreError> {
        let sql = format!(
            "INSERT INTO {} (gateway_id, coordination, expires_at, version)
             SELECT {{gateway:UUID}}, {{mode:String}}, now64(3), {{version:UInt64}}",
            self.table
        );
        let query = self
            .ch
            .client()
            .query(&sql)
            .param("gateway", gateway_id.to_string())
            .param("mode", mode.as_str())
            .param("version", u64::MAX);
        self.ch.timed("gateway_heartbeat", query.execute()).await
    }

    /// The gateways other than `gateway_id` serving in `mode` now.
    pub async fn live_in(
        &self,
        mode: Coordination,
        gateway_id: Uuid,
    ) -> Result<Vec<Uuid>, StoreError> {
        let sql = format!(
            "SELECT toString(gateway_id) FROM {} FINAL
             WHERE coordination = {{mode:String}} AND expires_at > now64(3)
               AND gateway_id != {{gateway:UUID}}",
            self.table
        );
        let query = self
            .ch
            .latest_read(&sql)
            .param("mode", mode.as_str())
            .param("gateway", gateway_id.to_string());
        let rows = self
            .ch
            .timed("gateway_list", query.fetch_all::<String>())
            .await?;
        Ok(rows
            .iter()
            .filter_map(|raw| Uuid::parse_str(raw).ok())
            .collect())
    }
}
