//! The lease table, `<table>_lease`: gateway claims (one candidate row per
//! attempt, ordered by server time) and, per state_id, one row holding its
//! latest lease. ReplacingMergeTree keeps each row's highest `version`, so
//! writes that land out of order still resolve to the newest.

use std::time::Duration;

use serde::Deserialize;
use uuid::Uuid;

use super::{ClickHouse, StoreError};
use crate::domain::StateId;

const NIL_UUID: &str = "00000000-0000-0000-0000-000000000000";

/// A live claim candidate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub claim_id: Uuid,
    pub gateway_id: Uuid,
    /// Server time of the insert, in ms: the claim's place in line.
    pub created_ms: i64,
}

/// The latest lease of a state_id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRow {
    pub state_id: StateId,
    pub lease_id: Uuid,
    pub gateway_id: Uuid,
    pub owner: String,
    pub fencing_token: u64,
    pub acquired_ms: i64,
    pub expires_ms: i64,
    pub released: bool,
    pub version: u64,
}

#[derive(clickhouse::Row, Deserialize)]
struct CandidateRow {
    claim_id: String,
    gateway_id: String,
    created_ms: i64,
}

#[derive(clickhouse::Row, Deserialize)]
struct LeaseRowIn {
    state_id: String,
    lease_id: String,
    gateway_id: String,
    owner: String,
    fencing_token: u64,
    acquired_ms: i64,
    expires_ms: i64,
    released: u8,
    version: u64,
    live: u8,
}

const LEASE_COLUMNS: &str =
    "state_id, toString(lease_id) AS lease_id, toString(gateway_id) AS gateway_id, owner,
    fencing_token, toUnixTimestamp64Milli(created_at) AS acquired_ms,
    toUnixTimestamp64Milli(expires_at) AS expires_ms, released, version,
    released = 0 AND expires_at > now64(3) AS live";

const INSERT_COLUMNS: &str = "(state_id, kind, claim_id, lease_id, gateway_id, owner, fencing_token, created_at, expires_at, released, version)";

fn parse_uuid(raw: &str) -> Result<Uuid, StoreError> {
    Uuid::parse_str(raw).map_err(|e| {
        StoreError::ClickHouse(clickhouse::error::Error::Custom(format!(
            "bad UUID {raw:?}: {e}"
        )))
    })
}

impl LeaseRowIn {
    /// The row and whether ClickHouse deems it live (not released, not expired by its clock).
    fn into_row(self) -> Result<Option<(LeaseRow, bool)>, StoreError> {
        let Ok(state_id) = StateId::parse(self.state_id) else {
            return Ok(None);
        };
        let row = LeaseRow {
            state_id,
            lease_id: parse_uuid(&self.lease_id)?,
            gateway_id: parse_uuid(&self.gateway_id)?,
            owner: self.owner,
            fencing_token: self.fencing_token,
            acquired_ms: self.acquired_ms,
            expires_ms: self.expires_ms,
            released: self.released != 0,
            version: self.version,
        };
        Ok(Some((row, self.live != 0)))
    }
}

#[derive(Clone)]
pub struct LeaseStore {
    ch: ClickHouse,
    table: String,
}

impl LeaseStore {
    pub fn new(ch: ClickHouse, table: String) -> Self {
        Self { ch, table }
    }

    /// Claims are only needed while they can matter; leases rows stay, since
    /// they carry the last fencing token of their state_id.
    pub async fn ensure_table(&self) -> Result<(), StoreError> {
        let sql = format!(
            "CREATE TABLE IF NOT EXISTS {} (
                state_id String,
                kind Enum8('claim' = 1, 'lease' = 2),
                claim_id UUID,
                lease_id UUID,
                gateway_id UUID,
                owner String,
                fencing_token UInt64,
                created_at DateTime64(3),
                expires_at DateTime64(3),
                released UInt8,
                version UInt64
            ) ENGINE = ReplacingMergeTree(version)
            ORDER BY (state_id, kind, claim_id)
            TTL toDateTime(expires_at) + INTERVAL 1 DAY DELETE WHERE kind = 'claim'",
            self.table
        );
        self.ch
            .timed("ensure_schema", self.ch.client.query(&sql).execute())
            .await
    }

    /// Inserts a claim candidate stamped with the server's clock.
    pub async fn propose_claim(
        &self,
        id: &StateId,
        claim_id: Uuid,
        gateway_id: Uuid,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.write_claim(id, claim_id, gateway_id, None, ttl, 1, false)
            .await
    }

    /// Extends a claim this gateway holds; `created_ms` keeps its place in line.
    pub async fn renew_claim(
        &self,
        id: &StateId,
        claim: &Candidate,
        ttl: Duration,
        version: u64,
    ) -> Result<(), StoreError> {
        self.write_claim(
            id,
            claim.claim_id,
            claim.gateway_id,
            Some(claim.created_ms),
            ttl,
            version,
            false,
        )
        .await
    }

    /// Withdraws a claim for good (the highest version, released).
    pub async fn withdraw_claim(&self, id: &StateId, claim: &Candidate) -> Result<(), StoreError> {
        self.write_claim(
            id,
            claim.claim_id,
            claim.gateway_id,
            Some(claim.created_ms),
            Duration::ZERO,
            u64::MAX,
            true,
        )
        .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn write_claim(
        &self,
        id: &StateId,
        claim_id: Uuid,
        gateway_id: Uuid,
        created_ms: Option<i64>,
        ttl: Duration,
        version: u64,
        released: bool,
    ) -> Result<(), StoreError> {
        let created = if created_ms.is_some() {
            "fromUnixTimestamp64Milli({created:Int64})"
        } else {
            "now64(3)"
        };
        let sql = format!(
            "INSERT INTO {} {INSERT_COLUMNS}
             SELECT {{id:String}}, 'claim', {{claim:UUID}}, toUUID('{NIL_UUID}'), {{gateway:UUID}}, '', 0,
                    {created}, now64(3) + toIntervalMillisecond({{ttl:UInt64}}), {{released:UInt8}}, {{version:UInt64}}",
            self.table
        );
        let mut query = self
            .ch
            .client
            .query(&sql)
            .param("id", id.as_str())
            .param("claim", claim_id.to_string())
            .param("gateway", gateway_id.to_string())
            .param("ttl", u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX))
            .param("released", u8::from(released))
            .param("version", version);
        if let Some(ms) = created_ms {
            query = query.param("created", ms);
        }
        self.ch.timed("claim", query.execute()).await
    }

    /// Live claim candidates of a state_id, earliest (server time, then id) first.
    pub async fn candidates(&self, id: &StateId) -> Result<Vec<Candidate>, StoreError> {
        let sql = format!(
            "SELECT toString(claim_id) AS claim_id, toString(gateway_id) AS gateway_id,
                    toUnixTimestamp64Milli(created_at) AS created_ms
             FROM {} FINAL
             WHERE state_id = {{id:String}} AND kind = 'claim' AND released = 0 AND expires_at > now64(3)
             ORDER BY created_at, claim_id",
            self.table
        );
        let query = self.ch.client.query(&sql).param("id", id.as_str());
        let rows = self
            .ch
            .timed("claim_candidates", query.fetch_all::<CandidateRow>())
            .await?;
        rows.into_iter()
            .map(|row| {
                Ok(Candidate {
                    claim_id: parse_uuid(&row.claim_id)?,
                    gateway_id: parse_uuid(&row.gateway_id)?,
                    created_ms: row.created_ms,
                })
            })
            .collect()
    }

    /// The latest lease row of a state_id and whether ClickHouse deems it live.
    pub async fn latest_lease(&self, id: &StateId) -> Result<Option<(LeaseRow, bool)>, StoreError> {
        let sql = format!(
            "SELECT {LEASE_COLUMNS} FROM {} FINAL WHERE state_id = {{id:String}} AND kind = 'lease' LIMIT 1",
            self.table
        );
        let query = self.ch.client.query(&sql).param("id", id.as_str());
        match self
            .ch
            .timed("lease_read", query.fetch_optional::<LeaseRowIn>())
            .await?
        {
            Some(row) => row.into_row(),
            None => Ok(None),
        }
    }

    /// Every live lease, through any gateway, in state_id order.
    pub async fn live_leases(&self) -> Result<Vec<LeaseRow>, StoreError> {
        let sql = format!(
            "SELECT {LEASE_COLUMNS} FROM {} FINAL
             WHERE kind = 'lease' AND released = 0 AND expires_at > now64(3)
             ORDER BY state_id",
            self.table
        );
        let rows = self
            .ch
            .timed(
                "lease_list",
                self.ch.client.query(&sql).fetch_all::<LeaseRowIn>(),
            )
            .await?;
        let mut leases = Vec::with_capacity(rows.len());
        for row in rows {
            if let Some((lease, _)) = row.into_row()? {
                leases.push(lease);
            }
        }
        Ok(leases)
    }

    /// Records a state_id's lease (a grant, renewal or release).
    pub async fn write_lease(&self, row: &LeaseRow) -> Result<(), StoreError> {
        let sql = format!(
            "INSERT INTO {} {INSERT_COLUMNS}
             SELECT {{id:String}}, 'lease', toUUID('{NIL_UUID}'), {{lease:UUID}}, {{gateway:UUID}}, {{owner:String}},
                    {{token:UInt64}}, fromUnixTimestamp64Milli({{acquired:Int64}}),
                    fromUnixTimestamp64Milli({{expires:Int64}}), {{released:UInt8}}, {{version:UInt64}}",
            self.table
        );
        let query = self
            .ch
            .client
            .query(&sql)
            .param("id", row.state_id.as_str())
            .param("lease", row.lease_id.to_string())
            .param("gateway", row.gateway_id.to_string())
            .param("owner", row.owner.as_str())
            .param("token", row.fencing_token)
            .param("acquired", row.acquired_ms)
            .param("expires", row.expires_ms)
            .param("released", u8::from(row.released))
            .param("version", row.version);
        self.ch.timed("lease_write", query.execute()).await
    }
}
