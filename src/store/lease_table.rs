//! The lease table's statements: claims proposed, renewed and withdrawn,
//! leases written, fencing tokens reserved, and one id's rows read back
//! (coalesced). What the rows hold is in `lease_rows`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::client::ClickHouse;
use super::ddl::Placement;
use super::decision_read::decision_read;
use super::error::StoreError;
use super::lease_rows::{
    Candidate, INSERT_COLUMNS, IdLocks, KIND_LEASE, KIND_TYPE, LeaseRecord, LeaseRowOut, LeaseRows,
    LockRowIn, NIL_UUID, create_table_sql, lock_rows_sql, parse_uuid,
};
use super::members_table::MemberStore;
use super::read_ahead::ReadAhead;
use super::read_batch::ReadBatch;
use super::route_read::{RouteRows, route_reads};
use crate::domain::{Lease, StateId};

#[derive(Clone)]
pub struct LeaseStore {
    ch: ClickHouse,
    table: String,
    /// One row per state_id, or one per lease (a pool's).
    rows: LeaseRows,
    /// This gateway's advertised URL, written on its lease rows (see
    /// `StoredLease::authority_url`).
    advertise_url: String,
    /// Point reads of one id's lock rows, coalesced: every routing read and
    /// lock check is one.
    lock_reads: Arc<ReadBatch<String, Vec<LockRowIn>>>,
    /// Routing reads of writes to the states of this table's ids; None on
    /// a table whose ids name no state (a pool's).
    route_reads: Option<RouteReads>,
    /// The gateways taking part in this table's claims in table mode; None
    /// where no membership is kept (every claim then settles).
    members: Option<MemberStore>,
}

/// A write's routing reads: the lock rows with the current row (see
/// `route_read`), and where that row is filed for the write.
#[derive(Clone)]
struct RouteReads {
    reads: Arc<ReadBatch<String, RouteRows>>,
    read_ahead: Arc<ReadAhead>,
}

impl LeaseStore {
    pub fn new(ch: ClickHouse, table: String, rows: LeaseRows) -> Self {
        let lock_reads = {
            let (ch, table) = (ch.clone(), table.clone());
            ReadBatch::new("locks", ch.metrics.clone(), move |ids: Vec<String>| {
                let (ch, table) = (ch.clone(), table.clone());
                Box::pin(async move {
                    let sql = lock_rows_sql(&table, "state_id IN {ids:Array(String)}", rows);
                    let query = ch.latest_read(&sql).param("ids", ids);
                    let rows = ch
                        .timed("lock_read", query.fetch_all::<LockRowIn>())
                        .await?;
                    let mut by_id: HashMap<String, Vec<LockRowIn>> = HashMap::new();
                    for row in rows {
                        by_id.entry(row.state_id.clone()).or_default().push(row);
                    }
                    Ok(by_id)
                })
            })
        };
        Self {
            ch,
            table,
            rows,
            advertise_url: String::new(),
            lock_reads: Arc::new(lock_reads),
            route_reads: None,
            members: None,
        }
    }

    /// The store whose table-mode claims keep membership in `members`.
    pub fn with_members(self, members: MemberStore) -> Self {
        Self {
            members: Some(members),
            ..self
        }
    }

    /// The members table of this table's claims, if membership is kept.
    pub fn members(&self) -> Option<&MemberStore> {
        self.members.as_ref()
    }

    /// The store whose routing reads of a write also read the id's current
    /// row in `state_table`, in the same statement, and file it in
    /// `read_ahead` for the write.
    pub(super) fn routing_writes_to(self, state_table: String, read_ahead: Arc<ReadAhead>) -> Self {
        let reads = route_reads(self.ch.clone(), self.table.clone(), state_table, self.rows);
        Self {
            route_reads: Some(RouteReads { reads, read_ahead }),
            ..self
        }
    }

    /// The store as the gateway advertised at `url` writes it.
    pub fn advertised_at(self, url: Option<&str>) -> Self {
        Self {
            advertise_url: url.unwrap_or("").to_owned(),
            ..self
        }
    }

    /// How this table keeps its leases' rows.
    pub fn rows(&self) -> LeaseRows {
        self.rows
    }

    pub async fn ensure_table(&self, placement: &Placement) -> Result<(), StoreError> {
        let create = create_table_sql(&self.table, placement, self.rows);
        self.ch.ddl(&create).await
    }

    /// A table an earlier version made gains the token kind, the URL
    /// column, the lock-delay columns and who held and ended each lease; one that has them is left alone
    /// (its user may lack ALTER).
    pub async fn upgrade_table(
        &self,
        columns: &[(String, String)],
        placement: &Placement,
    ) -> Result<(), StoreError> {
        let has_tokens = columns
            .iter()
            .any(|(name, kind)| name == "kind" && kind.contains("'tokens'"));
        let has = |column: &str| columns.iter().any(|(name, _)| name == column);
        let mut changes = Vec::new();
        if !has("advertise_url") {
            changes.push("ADD COLUMN IF NOT EXISTS advertise_url String DEFAULT ''".to_owned());
        }
        if !has("lock_delay_ms") {
            changes.push("ADD COLUMN IF NOT EXISTS lock_delay_ms UInt64 DEFAULT 0".to_owned());
        }
        if !has("pool_limit") {
            changes.push("ADD COLUMN IF NOT EXISTS pool_limit UInt32 DEFAULT 0".to_owned());
        }
        if !has("slots") {
            changes.push("ADD COLUMN IF NOT EXISTS slots UInt32 DEFAULT 0".to_owned());
        }
        if !has("ended_at") {
            changes.push("ADD COLUMN IF NOT EXISTS ended_at DateTime64(3) DEFAULT 0".to_owned());
        }
        for (column, kind) in HOLDER_COLUMNS {
            if !has(column) {
                changes.push(format!(
                    "ADD COLUMN IF NOT EXISTS {column} {kind} DEFAULT ''"
                ));
            }
        }
        if !has_tokens {
            changes.push(format!("MODIFY COLUMN kind {KIND_TYPE}"));
        }
        if changes.is_empty() {
            return Ok(());
        }
        let alter = format!(
            "ALTER TABLE {}{} {}",
            self.table,
            placement.on_cluster(),
            changes.join(", ")
        );
        self.ch.ddl(&alter).await
    }

    /// Inserts a claim candidate stamped with the server's clock, with the
    /// URL peers reach this gateway at.
    pub async fn propose_claim(
        &self,
        id: &StateId,
        claim_id: Uuid,
        gateway_id: Uuid,
        advertise_url: &str,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let sql = format!(
            "INSERT INTO {} {INSERT_COLUMNS}
             SELECT {{id:String}}, 'claim', {{claim:UUID}}, toUUID('{NIL_UUID}'), {{gateway:UUID}}, '', 0,
                    now64(3), now64(3) + toIntervalMillisecond({{ttl:UInt64}}), 0, 1, {{url:String}}",
            self.table
        );
        let query = self
            .ch
            .client()
            .query(&sql)
            .param("id", id.as_str())
            .param("claim", claim_id.to_string())
            .param("gateway", gateway_id.to_string())
            .param("ttl", u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX))
            .param("url", advertise_url);
        self.ch.timed("claim", query.execute()).await
    }

    /// Extends every live claim of `gateway` among `claims` in one round trip,
    /// each keeping its place in line; the new expiry is by ClickHouse's clock.
    /// A claim that has already lapsed stays lapsed.
    pub async fn renew_claims(
        &self,
        gateway_id: Uuid,
        claims: &[Uuid],
        ttl: Duration,
    ) -> Result<Vec<Uuid>, StoreError> {
        // This gateway's live claims among `claims`.
        let live_and_mine = "kind = 'claim' AND gateway_id = {gateway:UUID} AND released = 0
            AND expires_at > now64(3) AND has({claims:Array(String)}, toString(claim_id))";
        let mut renewed = Vec::with_capacity(claims.len());
        for chunk in claims.chunks(CLAIMS_PER_QUERY) {
            let sql = format!(
                "INSERT INTO {table} {INSERT_COLUMNS}
                 SELECT state_id, kind, claim_id, lease_id, gateway_id, owner, fencing_token, created_at,
                        now64(3) + toIntervalMillisecond({{ttl:UInt64}}), released, version + 1, advertise_url
                 FROM {table} FINAL WHERE {live_and_mine}",
                table = self.table
            );
            let query = self
                .ch
                .client()
                .query(&sql)
                .param("ttl", u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX))
                .param("gateway", gateway_id.to_string())
                .param("claims", uuid_texts(chunk));
            self.ch.timed("claim_renew", query.execute()).await?;
            // A claim that lapsed before the INSERT ran was silently left
            // out: read back which ones are live, so the caller drops the rest.
            let sql = format!(
                "SELECT toString(claim_id) FROM {table} FINAL WHERE {live_and_mine}",
                table = self.table
            );
            let query = self
                .ch
                .client()
                .query(&sql)
                .param("gateway", gateway_id.to_string())
                .param("claims", uuid_texts(chunk));
            for claim in self
                .ch
                .timed("claim_renew", query.fetch_all::<String>())
                .await?
            {
                renewed.push(parse_uuid(&claim)?);
            }
        }
        Ok(renewed)
    }

    /// Whether a gateway other than `me` proposed a claim on `id` after
    /// `lapsed` was made that was still in line when `lapsed` ran out (its
    /// expiry, or its withdrawal, later than `lapsed`'s expiry, by the
    /// server's clock): only such a one can have won the claim meanwhile.
    /// Earlier candidates were behind `lapsed` while it lived, and one gone
    /// before it never became the earliest. Withdrawn and lapsed candidates
    /// stay a day (the table's TTL); with `lapsed`'s own row gone, every
    /// later candidate counts.
    pub async fn claimed_since(
        &self,
        id: &StateId,
        me: Uuid,
        lapsed: &Candidate,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "SELECT count() FROM {table} FINAL
             WHERE state_id = {{id:String}} AND kind = 'claim' AND gateway_id != {{me:UUID}}
               AND created_at >= fromUnixTimestamp64Milli({{since:Int64}})
               AND expires_at > (SELECT max(expires_at) FROM {table} FINAL
                                 WHERE state_id = {{id:String}} AND kind = 'claim'
                                   AND claim_id = {{lapsed:UUID}})",
            table = self.table
        );
        let query = self
            .ch
            .client()
            .query(&sql)
            .param("id", id.as_str())
            .param("me", me.to_string())
            .param("since", lapsed.created_ms)
            .param("lapsed", lapsed.claim_id.to_string());
        let count = self
            .ch
            .timed("claims_since", query.fetch_one::<u64>())
            .await?;
        Ok(count > 0)
    }

    /// Of the state_ids this gateway holds claims on, those where another
    /// gateway's candidate waits in line (it wants the claim handed over);
    /// only gateways that cannot be forwarded to wait in line.
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
                   AND gateway_id != {{gateway:UUID}} AND advertise_url = ''
                   AND has({{ids:Array(String)}}, state_id)",
                self.table
            );
            let query = self
                .ch
                .client()
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
                .latest_read(&sql)
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

    /// Withdraws a claim for good: the highest version, released. Written
    /// blind, so it also covers a proposal whose landing is unknown.
    pub async fn withdraw_claim(&self, id: &StateId, claim: &Candidate) -> Result<(), StoreError> {
        let sql = format!(
            "INSERT INTO {} {INSERT_COLUMNS}
             SELECT {{id:String}}, 'claim', {{claim:UUID}}, toUUID('{NIL_UUID}'), {{gateway:UUID}}, '', 0,
                    fromUnixTimestamp64Milli({{created:Int64}}), now64(3), 1, {{version:UInt64}}, ''",
            self.table
        );
        let query = self
            .ch
            .client()
            .query(&sql)
            .param("id", id.as_str())
            .param("claim", claim.claim_id.to_string())
            .param("gateway", claim.gateway_id.to_string())
            .param("created", claim.created_ms)
            .param("version", u64::MAX);
        self.ch.timed("claim", query.execute()).await
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
                        now64(3), 1, {{version:UInt64}}, advertise_url
                 FROM {table} FINAL
                 WHERE kind = 'claim' AND gateway_id = {{gateway:UUID}} AND released = 0
                   AND has({{claims:Array(String)}}, toString(claim_id))",
                table = self.table
            );
            let query = self
                .ch
                .client()
                .query(&sql)
                .param("version", u64::MAX)
                .param("gateway", gateway_id.to_string())
                .param("claims", uuid_texts(chunk));
            self.ch.timed("claim_withdraw", query.execute()).await?;
        }
        Ok(())
    }

    /// The other gateways holding live claims that peers can reach: (gateway, URL).
    pub async fn peers(&self, gateway_id: Uuid) -> Result<Vec<(Uuid, String)>, StoreError> {
        let sql = format!(
            "SELECT DISTINCT toString(gateway_id), advertise_url FROM {} FINAL
             WHERE kind = 'claim' AND released = 0 AND expires_at > now64(3)
               AND gateway_id != {{gateway:UUID}} AND advertise_url != ''",
            self.table
        );
        let query = self
            .ch
            .client()
            .query(&sql)
            .param("gateway", gateway_id.to_string());
        let rows = self
            .ch
            .timed("claim_peers", query.fetch_all::<(String, String)>())
            .await?;
        rows.into_iter()
            .map(|(gateway, url)| Ok((parse_uuid(&gateway)?, url)))
            .collect()
    }

    /// The live claim rows and the lease rows of the state_ids `filter`
    /// selects, in state_id order, each id's candidates earliest first.
    /// One state_id's live claim candidates and latest lease, in one round
    /// trip shared with the other ids asked for meanwhile (see `read_batch`).
    pub async fn id_locks(&self, id: &StateId) -> Result<IdLocks, StoreError> {
        let rows = self.lock_reads.read(id.as_str().to_owned()).await?;
        IdLocks::assemble(rows.unwrap_or_default())
    }

    /// [`LeaseStore::id_locks`] and, in the same statement, whether a
    /// gateway other than `gateway_id` may claim, by `members` (see
    /// `decision_read`).
    pub async fn id_locks_and_others(
        &self,
        id: &StateId,
        members: &MemberStore,
        gateway_id: Uuid,
    ) -> Result<(IdLocks, bool), StoreError> {
        let table = (self.table.as_str(), self.rows);
        decision_read(&self.ch, table, &members.others_sql(), id, gateway_id).await
    }

    /// [`LeaseStore::id_locks`], for a write when `with_row`: the id's
    /// current row is read in the same statement and filed for the write
    /// (see `read_ahead`), where this table's ids name states.
    pub async fn id_locks_or_with_row(
        &self,
        id: &StateId,
        with_row: bool,
    ) -> Result<IdLocks, StoreError> {
        let Some(RouteReads { reads, read_ahead }) = self.route_reads.as_ref().filter(|_| with_row)
        else {
            return self.id_locks(id).await;
        };
        // Before the statement is sent: it holds every write acknowledged
        // before this instant.
        let asked_at = Instant::now();
        let found = reads.read(id.as_str().to_owned()).await?;
        let RouteRows { locks, row } = found.unwrap_or_default();
        read_ahead.file(id, asked_at, row);
        IdLocks::assemble(locks)
    }

    /// Every id with an unexpired lease row, in state_id order, with its
    /// candidates.
    pub async fn unexpired_leases(&self) -> Result<Vec<IdLocks>, StoreError> {
        // Every id ever locked keeps a lease row: leave in ClickHouse those
        // that cannot be in force (released or expired), so that the listing
        // carries what is locked now, not the table. The lock protocol
        // decides for the rest, with the candidates read beside them.
        let sql = lock_rows_sql(
            &self.table,
            "(kind = 'claim' OR (released IN (0, 2) AND expires_at > now64(3)))",
            self.rows,
        );
        let rows = self
            .ch
            .timed(
                "lease_list",
                self.ch.client().query(&sql).fetch_all::<LockRowIn>(),
            )
            .await?;
        let mut ids = Vec::new();
        let mut rows = rows.into_iter().peekable();
        while let Some(first) = rows.next() {
            let mut of_id = vec![first];
            while let Some(row) = rows.next_if(|row| row.state_id == of_id[0].state_id) {
                of_id.push(row);
            }
            let mut locks = IdLocks::assemble(of_id)?;
            locks.leases.retain(|l| l.unexpired);
            if !locks.leases.is_empty() {
                ids.push(locks);
            }
        }
        Ok(ids)
    }

    /// Records lease rows (grants, renewals, releases, hand-overs), all in one INSERT.
    pub async fn write_leases(&self, records: &[LeaseRecord]) -> Result<(), StoreError> {
        self.ch
            .timed("lease_write", async {
                let mut insert = self
                    .ch
                    .client()
                    .insert_unescaped::<LeaseRowOut>(&self.table)
                    .await?;
                for record in records {
                    let lease = &record.lease;
                    insert
                        .write(&LeaseRowOut {
                            state_id: lease.state_id.as_str().to_owned(),
                            kind: KIND_LEASE,
                            claim_id: match self.rows {
                                LeaseRows::PerId => Uuid::nil(),
                                LeaseRows::PerLease => lease.lease_id,
                            },
                            lease_id: lease.lease_id,
                            gateway_id: lease.gateway_id,
                            owner: lease.owner.clone(),
                            fencing_token: lease.fencing_token,
                            created_at: lease.acquired_ms,
                            expires_at: lease.expires_ms,
                            released: record.state as u8,
                            version: record.version.bits(),
                            advertise_url: self.advertise_url.clone(),
                            lock_delay_ms: u64::try_from(lease.lock_delay.as_millis())
                                .unwrap_or(u64::MAX),
                            ended_at: record.ended_ms.unwrap_or(0),
                            info: lease.info.as_str().to_owned(),
                            ended_by: record.ended_by(),
                            actor: record
                                .forced
                                .as_ref()
                                .map_or_else(String::new, |f| f.actor.clone()),
                            reason: record
                                .forced
                                .as_ref()
                                .map_or_else(String::new, |f| f.reason.clone()),
                            pool_limit: u32::try_from(lease.limit).unwrap_or(u32::MAX),
                            slots: u32::try_from(lease.slots).unwrap_or(u32::MAX),
                        })
                        .await?;
                }
                insert.end().await
            })
            .await
    }

    /// Reserves fencing tokens of `id` up to `last`: no later claim holder
    /// hands out any of them.
    pub async fn reserve_tokens(&self, id: &StateId, last: u64) -> Result<(), StoreError> {
        let sql = format!(
            "INSERT INTO {} {INSERT_COLUMNS}
             SELECT {{id:String}}, 'tokens', toUUID('{NIL_UUID}'), toUUID('{NIL_UUID}'), toUUID('{NIL_UUID}'), '',
                    {{last:UInt64}}, now64(3), now64(3), 0, {{last:UInt64}}, ''",
            self.table
        );
        let query = self
            .ch
            .client()
            .query(&sql)
            .param("id", id.as_str())
            .param("last", last);
        self.ch.timed("token_reserve", query.execute()).await
    }
}

/// The columns saying who held a lease and who ended it, added to tables
/// made before leases had them.
const HOLDER_COLUMNS: [(&str, &str); 4] = [
    ("info", "String"),
    ("ended_by", "LowCardinality(String)"),
    ("actor", "String"),
    ("reason", "String"),
];

/// How many claims one batched statement names: keeps each statement small.
const CLAIMS_PER_QUERY: usize = 500;

fn uuid_texts(ids: &[Uuid]) -> Vec<String> {
    ids.iter().map(Uuid::to_string).collect()
}
