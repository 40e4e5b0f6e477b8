//! The lease table, `<table>_lease`: gateway claims (one candidate row per
//! attempt, ordered by server time) and, per state_id, one row holding its
//! latest lease. ReplacingMergeTree keeps each row's highest `version`, so
//! writes that land out of order still resolve to the newest.

use std::time::Duration;

use serde::Deserialize;
use uuid::Uuid;

use super::{ClickHouse, StoreError};
use crate::domain::{Lease, StateId};

const NIL_UUID: &str = "00000000-0000-0000-0000-000000000000";

/// A live claim candidate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub claim_id: Uuid,
    pub gateway_id: Uuid,
    /// Server time of the insert, in ms: the claim's place in line.
    pub created_ms: i64,
}

/// A lease row's version. ReplacingMergeTree keeps the row with the highest
/// version, so the order of a lease's rows is encoded here, in one place: the
/// fencing token in the high bits (a later lease beats an earlier one), a
/// renewal count below it, and all ones there once the lease is released (a
/// release beats every renewal of its lease, whatever order they land in).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LeaseVersion(u64);

impl LeaseVersion {
    const SEQ_BITS: u32 = 20;
    const RELEASED_SEQ: u64 = (1 << Self::SEQ_BITS) - 1;

    pub fn granted(fencing_token: u64) -> Self {
        Self(fencing_token << Self::SEQ_BITS)
    }

    /// The next renewal; past 2^20 - 2 renewals the count stays put, which
    /// only costs the tie-break between two renewals of one lease.
    pub fn renewed(self) -> Self {
        let seq = self.0 & Self::RELEASED_SEQ;
        if seq + 1 >= Self::RELEASED_SEQ {
            self
        } else {
            Self(self.0 + 1)
        }
    }

    pub fn released(self) -> Self {
        Self(self.0 | Self::RELEASED_SEQ)
    }
}

/// A lease row as ClickHouse holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredLease {
    pub lease: Lease,
    pub version: LeaseVersion,
    pub released: bool,
    /// Not released and not expired, by ClickHouse's clock.
    pub live: bool,
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
    /// None for a row whose state_id this version cannot serve.
    fn into_stored(self) -> Result<Option<StoredLease>, StoreError> {
        let Ok(state_id) = StateId::parse(self.state_id) else {
            return Ok(None);
        };
        Ok(Some(StoredLease {
            lease: Lease {
                state_id,
                lease_id: parse_uuid(&self.lease_id)?,
                gateway_id: parse_uuid(&self.gateway_id)?,
                owner: self.owner,
                fencing_token: self.fencing_token,
                acquired_ms: self.acquired_ms,
                expires_ms: self.expires_ms,
            },
            version: LeaseVersion(self.version),
            released: self.released != 0,
            live: self.live != 0,
        }))
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

    /// Extends every live claim of `gateway` among `claims` in one round trip,
    /// each keeping its place in line; the new expiry is by ClickHouse's clock.
    /// A claim that has already lapsed stays lapsed.
    pub async fn renew_claims(
        &self,
        gateway_id: Uuid,
        claims: &[Uuid],
        ttl: Duration,
    ) -> Result<(), StoreError> {
        for chunk in claims.chunks(CLAIMS_PER_QUERY) {
            let sql = format!(
                "INSERT INTO {table} {INSERT_COLUMNS}
                 SELECT state_id, kind, claim_id, lease_id, gateway_id, owner, fencing_token, created_at,
                        now64(3) + toIntervalMillisecond({{ttl:UInt64}}), released, version + 1
                 FROM {table} FINAL
                 WHERE kind = 'claim' AND gateway_id = {{gateway:UUID}} AND released = 0
                   AND expires_at > now64(3) AND has({{claims:Array(String)}}, toString(claim_id))",
                table = self.table
            );
            let query = self
                .ch
                .client
                .query(&sql)
                .param("ttl", u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX))
                .param("gateway", gateway_id.to_string())
                .param("claims", uuid_texts(chunk));
            self.ch.timed("claim_renew", query.execute()).await?;
        }
        Ok(())
    }

    /// Of the state_ids this gateway holds claims on, those where another
    /// gateway's candidate waits in line (it wants the claim handed over).
    pub async fn contested(
        &self,
        gateway_id: Uuid,
        ids: &[StateId],
    ) -> Result<Vec<StateId>, StoreError> {
        let mut contested = Vec::new();
        for chunk in ids.chunks(CLAIMS_PER_QUERY) {
            let sql = format!(
                "SELECT DISTINCT state_id FROM {} FINAL
                 WHERE kind = 'claim' AND released = 0 AND expires_at > now64(3)
                   AND gateway_id != {{gateway:UUID}} AND has({{ids:Array(String)}}, state_id)",
                self.table
            );
            let query = self
                .ch
                .client
                .query(&sql)
                .param("gateway", gateway_id.to_string())
                .param("ids", chunk.iter().map(StateId::as_str).collect::<Vec<_>>());
            let rows = self
                .ch
                .timed("claim_contested", query.fetch_all::<String>())
                .await?;
            contested.extend(rows.into_iter().filter_map(|id| StateId::parse(id).ok()));
        }
        Ok(contested)
    }

    /// Leases among `leases` that ClickHouse records as released: force-unlocked
    /// through a gateway that could not reach their holder's.
    pub async fn released_among(&self, leases: &[&Lease]) -> Result<Vec<Uuid>, StoreError> {
        let mut released = Vec::new();
        for chunk in leases.chunks(CLAIMS_PER_QUERY) {
            let sql = format!(
                "SELECT toString(lease_id) FROM {} FINAL
                 WHERE kind = 'lease' AND released = 1 AND has({{ids:Array(String)}}, state_id)
                   AND has({{leases:Array(String)}}, toString(lease_id))",
                self.table
            );
            let query = self
                .ch
                .client
                .query(&sql)
                .param(
                    "ids",
                    chunk
                        .iter()
                        .map(|l| l.state_id.as_str())
                        .collect::<Vec<_>>(),
                )
                .param(
                    "leases",
                    uuid_texts(&chunk.iter().map(|l| l.lease_id).collect::<Vec<_>>()),
                );
            let rows = self
                .ch
                .timed("lease_released", query.fetch_all::<String>())
                .await?;
            for row in rows {
                released.push(parse_uuid(&row)?);
            }
        }
        Ok(released)
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

    /// Withdraws every claim of `gateway` among `claims` in one round trip.
    pub async fn withdraw_claims(
        &self,
        gateway_id: Uuid,
        claims: &[Uuid],
    ) -> Result<(), StoreError> {
        for chunk in claims.chunks(CLAIMS_PER_QUERY) {
            let sql = format!(
                "INSERT INTO {table} {INSERT_COLUMNS}
                 SELECT state_id, kind, claim_id, lease_id, gateway_id, owner, fencing_token, created_at,
                        now64(3), 1, {{version:UInt64}}
                 FROM {table} FINAL
                 WHERE kind = 'claim' AND gateway_id = {{gateway:UUID}} AND released = 0
                   AND has({{claims:Array(String)}}, toString(claim_id))",
                table = self.table
            );
            let query = self
                .ch
                .client
                .query(&sql)
                .param("version", u64::MAX)
                .param("gateway", gateway_id.to_string())
                .param("claims", uuid_texts(chunk));
            self.ch.timed("claim_withdraw", query.execute()).await?;
        }
        Ok(())
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

    /// The latest lease row of a state_id.
    pub async fn latest_lease(&self, id: &StateId) -> Result<Option<StoredLease>, StoreError> {
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
            Some(row) => row.into_stored(),
            None => Ok(None),
        }
    }

    /// Every live lease, through any gateway, in state_id order.
    pub async fn live_leases(&self) -> Result<Vec<Lease>, StoreError> {
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
            if let Some(stored) = row.into_stored()? {
                leases.push(stored.lease);
            }
        }
        Ok(leases)
    }

    /// Records a state_id's lease (a grant, renewal or release).
    pub async fn write_lease(
        &self,
        lease: &Lease,
        version: LeaseVersion,
        released: bool,
    ) -> Result<(), StoreError> {
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
            .param("id", lease.state_id.as_str())
            .param("lease", lease.lease_id.to_string())
            .param("gateway", lease.gateway_id.to_string())
            .param("owner", lease.owner.as_str())
            .param("token", lease.fencing_token)
            .param("acquired", lease.acquired_ms)
            .param("expires", lease.expires_ms)
            .param("released", u8::from(released))
            .param("version", version.0);
        self.ch.timed("lease_write", query.execute()).await
    }
}

/// How many claims one batched statement names: keeps each statement small.
const CLAIMS_PER_QUERY: usize = 500;

fn uuid_texts(ids: &[Uuid]) -> Vec<String> {
    ids.iter().map(Uuid::to_string).collect()
}
