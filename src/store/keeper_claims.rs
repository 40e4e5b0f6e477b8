//! Lock claims in KeeperMap, `<table>_claims`: one key per state_id, kept in
//! the server's Keeper (or ZooKeeper), so every ClickHouse node and replica
//! sees every write at once, whatever node a query reaches.
//!
//! Every write runs with `keeper_map_strict_mode=1`: an INSERT of a key that
//! exists fails ("Node exists"), and an `ALTER TABLE … UPDATE` writes each row
//! it read only if that row's version is unchanged ("Bad version" otherwise).
//! KeeperMap mutations are synchronous: when the ALTER returns, the write is
//! in Keeper. An UPDATE that matches no row does nothing and says nothing, so
//! no write here selects rows by anything but the key: its conditions are
//! `throwIf` guards in the new values, which fail the statement when the row
//! is not the one the caller expects.
//!
//! A key, once made, is never deleted: a release clears the holder and keeps
//! the row, so the highest fencing token reserved (`last_token`) outlives
//! every claim and tokens only grow across releases, crashes and restarts;
//! and a guarded UPDATE always finds its key. Expiries are Int64 milliseconds
//! since the epoch by the ClickHouse server's clock.

use std::time::Duration;

use serde::Deserialize;
use uuid::Uuid;

use super::client::ClickHouse;
use super::ddl::Placement;
use super::error::StoreError;
use crate::domain::StateId;

const NIL_UUID: &str = "00000000-0000-0000-0000-000000000000";
/// What a guard's `throwIf` says: the row is not the one the caller expects.
const GUARD_MESSAGE: &str = "statehouse: claim changed";
/// ClickHouse's FUNCTION_THROW_IF_VALUE_IS_NON_ZERO: a guard failed.
const GUARD_FAILED: u32 = 395;
/// ClickHouse's KEEPER_EXCEPTION, which also covers an unreachable Keeper.
const KEEPER_EXCEPTION: u32 = 999;

/// The holder of a claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimHolder {
    pub claim_id: Uuid,
    pub gateway_id: Uuid,
    /// Where peers reach the holder's gateway; empty when it said nothing.
    pub advertise_url: String,
    /// Server time at which the claim lapses unless renewed, in ms.
    pub expires_ms: i64,
}

/// A state_id's key, as Keeper holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeeperClaim {
    /// None once released: anyone may take it.
    pub holder: Option<ClaimHolder>,
    /// The highest fencing token reserved for the state_id so far (0: none).
    pub last_token: u64,
    /// A gateway that wants the claim and cannot be forwarded to: the holder
    /// should hand it over when its leases allow.
    pub waiting_gateway: Option<Uuid>,
}

impl KeeperClaim {
    /// Free to take at server time `now_ms`: released, or lapsed.
    pub fn takeable(&self, now_ms: i64) -> bool {
        self.holder.as_ref().is_none_or(|h| h.expires_ms <= now_ms)
    }

    /// The claim id a takeover must find still in place (nil for a released key).
    pub fn holder_claim_id(&self) -> Uuid {
        self.holder.as_ref().map_or(Uuid::nil(), |h| h.claim_id)
    }
}

/// One key as read, with the server's clock at the read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimRead {
    /// None: no gateway ever claimed the state_id.
    pub claim: Option<KeeperClaim>,
    pub now_ms: i64,
}

/// A claim about to be made.
#[derive(Clone, Debug)]
pub struct NewClaim<'a> {
    pub claim_id: Uuid,
    pub gateway_id: Uuid,
    pub advertise_url: &'a str,
    pub ttl: Duration,
    /// How many fencing tokens to reserve with it, after the key's `last_token`.
    pub tokens: u64,
}

/// What a conditional write did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Written: the key was as expected.
    Done,
    /// Not written: the key is not as expected (held by another, not lapsed,
    /// not mine any more, or already made).
    Refused,
    /// Not written: another write changed the key between this statement's
    /// read and its write. Read again and decide again.
    Raced,
}

#[derive(clickhouse::Row, Deserialize)]
struct ClaimRowIn {
    found: u64,
    claim_id: String,
    gateway_id: String,
    advertise_url: String,
    expires_ms: i64,
    last_token: u64,
    waiting_gateway: String,
    now_ms: i64,
}

/// The claims table's DDL (see [`Placement`]): KeeperMap on every node, all
/// nodes' tables on one Keeper path. The path is under the server's
/// `keeper_map_path_prefix` and names the schema and table, so gateways on
/// other tables never share keys.
pub(super) fn create_table_sql(table: &str, keeper_path: &str, placement: &Placement) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {table}{} (
            state_id String,
            claim_id UUID,
            gateway_id UUID,
            advertise_url String,
            expires_ms Int64,
            last_token UInt64,
            waiting_gateway UUID,
            waiting_since_ms Int64
        ) ENGINE = KeeperMap('{keeper_path}') PRIMARY KEY state_id",
        placement.on_cluster()
    )
}

/// `/statehouse/<schema>/<table>_claims`; both parts are plain identifiers.
pub(super) fn keeper_path(schema: &str, claims_table: &str) -> String {
    format!("/statehouse/{schema}/{claims_table}")
}

/// What a failed conditional write means, or the error itself when it is no
/// answer about the key (Keeper unreachable, a timeout, anything else).
fn outcome_of(err: StoreError) -> Result<Outcome, StoreError> {
    let text = match &err {
        StoreError::ClickHouse(clickhouse::error::Error::BadResponse(text)) => text.as_str(),
        _ => return Err(err),
    };
    match err.exception_code() {
        Some(GUARD_FAILED) if text.contains(GUARD_MESSAGE) => Ok(Outcome::Refused),
        Some(KEEPER_EXCEPTION) if text.contains("Node exists") => Ok(Outcome::Refused),
        Some(KEEPER_EXCEPTION) if text.contains("Bad version") || text.contains("No node") => {
            Ok(Outcome::Raced)
        }
        _ => Err(err),
    }
}

fn ms(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

fn parse_uuid(raw: &str) -> Result<Uuid, StoreError> {
    Uuid::parse_str(raw).map_err(|e| {
        StoreError::ClickHouse(clickhouse::error::Error::Custom(format!(
            "bad UUID {raw:?} in the claims table: {e}"
        )))
    })
}

impl ClaimRowIn {
    fn into_read(self) -> Result<ClaimRead, StoreError> {
        if self.found == 0 {
            return Ok(ClaimRead {
                claim: None,
                now_ms: self.now_ms,
            });
        }
        let claim_id = parse_uuid(&self.claim_id)?;
        let waiting = parse_uuid(&self.waiting_gateway)?;
        let holder = (!claim_id.is_nil())
            .then(|| {
                Ok::<_, StoreError>(ClaimHolder {
                    claim_id,
                    gateway_id: parse_uuid(&self.gateway_id)?,
                    advertise_url: self.advertise_url,
                    expires_ms: self.expires_ms,
                })
            })
            .transpose()?;
        Ok(ClaimRead {
            claim: Some(KeeperClaim {
                holder,
                last_token: self.last_token,
                waiting_gateway: (!waiting.is_nil()).then_some(waiting),
            }),
            now_ms: self.now_ms,
        })
    }
}

#[derive(Clone)]
pub struct KeeperClaimStore {
    ch: ClickHouse,
    /// `schema`.`table_claims`.
    table: String,
    keeper_path: String,
}

impl KeeperClaimStore {
    pub fn new(ch: ClickHouse, table: String, keeper_path: String) -> Self {
        Self {
            ch,
            table,
            keeper_path,
        }
    }

    /// Creates the table if missing. Fails when the server cannot run
    /// KeeperMap (no `keeper_map_path_prefix`, no Keeper, Keeper out of reach).
    pub async fn ensure_table(&self, placement: &Placement) -> Result<(), StoreError> {
        let create = create_table_sql(&self.table, &self.keeper_path, placement);
        self.ch.ddl(&create).await
    }

    /// Reads a key no state_id has: fails unless the server reaches Keeper.
    pub async fn probe(&self) -> Result<(), StoreError> {
        let sql = format!("SELECT count() FROM {} WHERE state_id = ''", self.table);
        self.ch
            .timed(
                "ensure_schema",
                self.ch.client().query(&sql).fetch_one::<u64>(),
            )
            .await
            .map(drop)
    }

    /// One state_id's key and the server's clock, in one round trip.
    pub async fn read(&self, id: &StateId) -> Result<ClaimRead, StoreError> {
        // An aggregate answers one row even when the key is missing.
        let sql = format!(
            "SELECT count() AS found, toString(any(claim_id)) AS claim_id,
                    toString(any(gateway_id)) AS gateway_id, any(advertise_url) AS advertise_url,
                    any(expires_ms) AS expires_ms, any(last_token) AS last_token,
                    toString(any(waiting_gateway)) AS waiting_gateway,
                    toUnixTimestamp64Milli(now64(3)) AS now_ms
             FROM {} WHERE state_id = {{id:String}}",
            self.table
        );
        let query = self.ch.client().query(&sql).param("id", id.as_str());
        let row = self
            .ch
            .timed("keeper_claim_read", query.fetch_one::<ClaimRowIn>())
            .await?;
        row.into_read()
    }

    /// The keys of `ids` that exist, with the server's clock, in one round
    /// trip: how a holder learns that other gateways wait.
    pub async fn read_many(
        &self,
        ids: &[StateId],
    ) -> Result<Vec<(StateId, ClaimRead)>, StoreError> {
        let sql = format!(
            "SELECT toUInt64(1) AS found, state_id, toString(claim_id) AS claim_id,
                    toString(gateway_id) AS gateway_id, advertise_url, expires_ms, last_token,
                    toString(waiting_gateway) AS waiting_gateway,
                    toUnixTimestamp64Milli(now64(3)) AS now_ms
             FROM {} WHERE state_id IN {{ids:Array(String)}}",
            self.table
        );
        #[derive(clickhouse::Row, Deserialize)]
        struct Keyed {
            found: u64,
            state_id: String,
            claim_id: String,
            gateway_id: String,
            advertise_url: String,
            expires_ms: i64,
            last_token: u64,
            waiting_gateway: String,
            now_ms: i64,
        }
        let query = self
            .ch
            .client()
            .query(&sql)
            .param("ids", ids.iter().map(StateId::as_str).collect::<Vec<_>>());
        let rows = self
            .ch
            .timed("keeper_claim_read", query.fetch_all::<Keyed>())
            .await?;
        let mut read = Vec::with_capacity(rows.len());
        for row in rows {
            let Ok(id) = StateId::parse(row.state_id) else {
                continue;
            };
            let claim = ClaimRowIn {
                found: row.found,
                claim_id: row.claim_id,
                gateway_id: row.gateway_id,
                advertise_url: row.advertise_url,
                expires_ms: row.expires_ms,
                last_token: row.last_token,
                waiting_gateway: row.waiting_gateway,
                now_ms: row.now_ms,
            };
            read.push((id, claim.into_read()?));
        }
        Ok(read)
    }

    /// The other gateways holding live claims with an advertised URL (one
    /// row per gateway): those a delete by pattern must tell.
    pub async fn holders(&self, except: Uuid) -> Result<Vec<(Uuid, String)>, StoreError> {
        let sql = format!(
            "SELECT DISTINCT toString(gateway_id), advertise_url FROM {}
             WHERE claim_id != toUUID('{NIL_UUID}') AND gateway_id != {{me:UUID}}
               AND advertise_url != '' AND expires_ms > toUnixTimestamp64Milli(now64(3))",
            self.table
        );
        let query = self.ch.client().query(&sql).param("me", except.to_string());
        let rows = self
            .ch
            .timed("keeper_claim_read", query.fetch_all::<(String, String)>())
            .await?;
        rows.into_iter()
            .map(|(gateway, url)| Ok((parse_uuid(&gateway)?, url)))
            .collect()
    }

    /// Makes the key of a state_id no gateway ever claimed, held by `claim`
    /// with tokens 1..=`claim.tokens` reserved. Exactly one of concurrent
    /// creates is `Done`; the others are `Refused`.
    pub async fn create(&self, id: &StateId, claim: &NewClaim<'_>) -> Result<Outcome, StoreError> {
        let sql = format!(
            "INSERT INTO {} (state_id, claim_id, gateway_id, advertise_url, expires_ms, last_token,
                             waiting_gateway, waiting_since_ms)
             SELECT {{id:String}}, {{claim:UUID}}, {{gateway:UUID}}, {{url:String}},
                    toUnixTimestamp64Milli(now64(3)) + {{ttl:Int64}}, {{tokens:UInt64}},
                    toUUID('{NIL_UUID}'), 0",
            self.table
        );
        let query = self
            .strict(&sql)
            .param("id", id.as_str())
            .param("claim", claim.claim_id.to_string())
            .param("gateway", claim.gateway_id.to_string())
            .param("url", claim.advertise_url)
            .param("ttl", ms(claim.ttl))
            .param("tokens", claim.tokens);
        self.write("keeper_claim_create", query).await
    }

    /// Takes a released or lapsed key for `claim`, if it still holds what the
    /// caller read: claim `seen_claim` (nil for released) and `seen_token`.
    /// A live claim of the same gateway's (a leftover whose answer was lost)
    /// may be taken over too.
    /// Reserves tokens `seen_token + 1 ..= seen_token + claim.tokens` and
    /// clears the waiter mark.
    pub async fn take_over(
        &self,
        id: &StateId,
        seen_claim: Uuid,
        seen_token: u64,
        claim: &NewClaim<'_>,
    ) -> Result<Outcome, StoreError> {
        let sql = format!(
            "ALTER TABLE {} UPDATE
                claim_id = {{claim:UUID}}, gateway_id = {{gateway:UUID}}, advertise_url = {{url:String}},
                expires_ms = toUnixTimestamp64Milli(now64(3)) + {{ttl:Int64}}
                    + throwIf(NOT (claim_id = {{seen:UUID}} AND last_token = {{seen_token:UInt64}}
                                   AND (claim_id = toUUID('{NIL_UUID}')
                                        OR expires_ms <= toUnixTimestamp64Milli(now64(3))
                                        OR gateway_id = {{gateway:UUID}})),
                              '{GUARD_MESSAGE}'),
                last_token = last_token + {{tokens:UInt64}},
                waiting_gateway = toUUID('{NIL_UUID}'), waiting_since_ms = 0
             WHERE state_id = {{id:String}}",
            self.table
        );
        let query = self
            .strict(&sql)
            .param("id", id.as_str())
            .param("claim", claim.claim_id.to_string())
            .param("gateway", claim.gateway_id.to_string())
            .param("url", claim.advertise_url)
            .param("ttl", ms(claim.ttl))
            .param("seen", seen_claim.to_string())
            .param("seen_token", seen_token)
            .param("tokens", claim.tokens);
        self.write("keeper_claim_take_over", query).await
    }

    /// Extends my claim to `ttl` from now by the server's clock. `Refused`:
    /// it is not mine any more, or it lapsed (a lapsed claim is not revived,
    /// another gateway may be taking it); `Raced`: another write (a waiter's
    /// mark) landed in between, so read and renew again.
    pub async fn renew(
        &self,
        id: &StateId,
        claim_id: Uuid,
        ttl: Duration,
    ) -> Result<Outcome, StoreError> {
        let sql = format!(
            "ALTER TABLE {} UPDATE
                expires_ms = toUnixTimestamp64Milli(now64(3)) + {{ttl:Int64}}
                    + throwIf(claim_id != {{claim:UUID}}
                              OR expires_ms <= toUnixTimestamp64Milli(now64(3)), '{GUARD_MESSAGE}')
             WHERE state_id = {{id:String}}",
            self.table
        );
        let query = self
            .strict(&sql)
            .param("id", id.as_str())
            .param("claim", claim_id.to_string())
            .param("ttl", ms(ttl));
        self.write("keeper_claim_renew", query).await
    }

    /// Raises the reserved-token mark from `seen_token` (what I read as the
    /// holder) to `last`, while the claim is mine and unlapsed.
    pub async fn reserve_tokens(
        &self,
        id: &StateId,
        claim_id: Uuid,
        seen_token: u64,
        last: u64,
    ) -> Result<Outcome, StoreError> {
        let sql = format!(
            "ALTER TABLE {} UPDATE
                last_token = {{last:UInt64}}
                    + throwIf(claim_id != {{claim:UUID}} OR last_token != {{seen_token:UInt64}}
                              OR {{last:UInt64}} <= last_token
                              OR expires_ms <= toUnixTimestamp64Milli(now64(3)), '{GUARD_MESSAGE}')
             WHERE state_id = {{id:String}}",
            self.table
        );
        let query = self
            .strict(&sql)
            .param("id", id.as_str())
            .param("claim", claim_id.to_string())
            .param("seen_token", seen_token)
            .param("last", last);
        self.write("keeper_claim_tokens", query).await
    }

    /// Gives my claim up (a release, or a hand-over to whoever takes it
    /// next): the holder and the waiter mark are cleared, the tokens stay.
    /// `Refused` when it is not mine: nothing changes.
    pub async fn release(&self, id: &StateId, claim_id: Uuid) -> Result<Outcome, StoreError> {
        let sql = format!(
            "ALTER TABLE {} UPDATE
                claim_id = toUUID('{NIL_UUID}'), gateway_id = toUUID('{NIL_UUID}'), advertise_url = '',
                expires_ms = 0 + throwIf(claim_id != {{claim:UUID}}, '{GUARD_MESSAGE}'),
                waiting_gateway = toUUID('{NIL_UUID}'), waiting_since_ms = 0
             WHERE state_id = {{id:String}}",
            self.table
        );
        let query = self
            .strict(&sql)
            .param("id", id.as_str())
            .param("claim", claim_id.to_string());
        self.write("keeper_claim_release", query).await
    }

    /// Tells `holder_claim`'s holder that `gateway_id` waits for the claim.
    /// A mark already there stays (the first waiter's); `Refused` when the
    /// key no longer holds `holder_claim`.
    pub async fn mark_waiting(
        &self,
        id: &StateId,
        holder_claim: Uuid,
        gateway_id: Uuid,
    ) -> Result<Outcome, StoreError> {
        let sql = format!(
            "ALTER TABLE {} UPDATE
                waiting_gateway = if(waiting_gateway = toUUID('{NIL_UUID}'), {{gateway:UUID}}, waiting_gateway),
                waiting_since_ms = if(waiting_gateway = toUUID('{NIL_UUID}'),
                                      toUnixTimestamp64Milli(now64(3)), waiting_since_ms)
                    + throwIf(claim_id != {{holder:UUID}} OR claim_id = toUUID('{NIL_UUID}'), '{GUARD_MESSAGE}')
             WHERE state_id = {{id:String}}",
            self.table
        );
        let query = self
            .strict(&sql)
            .param("id", id.as_str())
            .param("holder", holder_claim.to_string())
            .param("gateway", gateway_id.to_string());
        self.write("keeper_claim_wait", query).await
    }

    fn strict(&self, sql: &str) -> clickhouse::query::Query {
        self.ch
            .client()
            .query(sql)
            .with_setting("keeper_map_strict_mode", "1")
    }

    async fn write(
        &self,
        operation: &'static str,
        query: clickhouse::query::Query,
    ) -> Result<Outcome, StoreError> {
        match self.ch.timed(operation, query.execute()).await {
            Ok(()) => Ok(Outcome::Done),
            Err(err) => outcome_of(err),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn said(text: &str) -> StoreError {
        StoreError::ClickHouse(clickhouse::error::Error::BadResponse(text.to_owned()))
    }

    #[test]
    fn failed_guards_and_versions_are_answers_and_keeper_trouble_is_an_error() {
        let refused = format!(
            "Code: 395. DB::Exception: {GUARD_MESSAGE}: while executing 'FUNCTION throwIf(...)'"
        );
        assert_eq!(outcome_of(said(&refused)).unwrap(), Outcome::Refused);
        assert_eq!(
            outcome_of(said("Code: 999. DB::Exception: Transaction failed (Node exists): Op #0, path: /statehouse/x/data/AWE=. (KEEPER_EXCEPTION)")).unwrap(),
            Outcome::Refused
        );
        assert_eq!(
            outcome_of(said("Code: 999. DB::Exception: Transaction failed (Bad version): Op #0. (KEEPER_EXCEPTION)")).unwrap(),
            Outcome::Raced
        );
        for trouble in [
            "Code: 999. DB::Exception: All connection tries failed while connecting to ZooKeeper. (KEEPER_EXCEPTION)",
            "Code: 999. DB::Exception: Session expired. (KEEPER_EXCEPTION)",
            "Code: 395. DB::Exception: Value passed to 'throwIf' function is non-zero",
        ] {
            assert!(outcome_of(said(trouble)).is_err(), "{trouble}");
        }
        assert!(outcome_of(StoreError::Timeout(Duration::from_secs(5))).is_err());
    }

    #[test]
    fn a_key_is_takeable_once_released_or_lapsed() {
        let held = KeeperClaim {
            holder: Some(ClaimHolder {
                claim_id: Uuid::new_v4(),
                gateway_id: Uuid::new_v4(),
                advertise_url: String::new(),
                expires_ms: 1_000,
            }),
            last_token: 3,
            waiting_gateway: None,
        };
        assert!(!held.takeable(999));
        assert!(held.takeable(1_000));
        let released = KeeperClaim {
            holder: None,
            ..held
        };
        assert!(released.takeable(0));
        assert!(released.holder_claim_id().is_nil());
    }
}
