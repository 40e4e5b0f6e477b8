//! The lease tables, `<table>_lease` for state_ids and `<table>_pool_lease`
//! for pools: gateway claims (one candidate row per attempt, ordered by
//! server time, with the claimant's advertised URL), lease rows (see
//! [`LeaseRows`]), and per id one row holding the highest fencing token
//! reserved for it. ReplacingMergeTree keeps each row's highest
//! `version`, so writes that land out of order still resolve to the newest.
//! This file holds what the rows are: the table's DDL, the rows as written and
//! read, and how one id's rows read as its [`IdLocks`]; `lease_table` sends
//! the statements.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::ddl::Placement;
use super::error::StoreError;
use crate::domain::{Forced, Lease, LeaseInfo, LeaseState, LeaseVersion, StateId};

pub(super) const NIL_UUID: &str = "00000000-0000-0000-0000-000000000000";

/// How a lease table keeps its leases' rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseRows {
    /// One row per state_id, its latest lease: a state_id has one at a time,
    /// and the row keeps its last fencing token and lock-delay for good.
    PerId,
    /// One row per lease (its `claim_id` is the lease's id): a pool holds
    /// several at a time. A row goes a day after its lease expired; the
    /// pool's reserved tokens stay in its `tokens` row.
    PerLease,
}

/// A live claim candidate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub claim_id: Uuid,
    pub gateway_id: Uuid,
    /// Server time of the insert, in ms: the claim's place in line.
    pub created_ms: i64,
    /// Where peers reach the claimant's gateway; empty when it said nothing.
    pub advertise_url: String,
    /// Server time at which the candidate lapses unless renewed, in ms.
    pub expires_ms: i64,
}

/// A lease row, as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseRecord {
    pub lease: Lease,
    pub version: LeaseVersion,
    pub state: LeaseState,
    /// When a release or a force-unlock ended the lease (ms since the
    /// epoch); none while it runs. A release row carries no lock-delay.
    pub ended_ms: Option<i64>,
    /// Who forced the lease's end and why; none unless a force-unlock ended it.
    pub forced: Option<Forced>,
}

impl LeaseRecord {
    /// How the row says its lease ended (the `ended_by` column): empty while
    /// it runs; an expiry is no row's doing, so it is read from the expiry.
    pub(super) fn ended_by(&self) -> &'static str {
        match (self.state, &self.forced) {
            (LeaseState::Released, Some(_)) => ENDED_FORCED,
            (LeaseState::Released, None) => ENDED_RELEASED,
            _ => "",
        }
    }
}

impl LeaseRecord {
    /// Until when (ms since the epoch) the row says something the next
    /// authority needs: the lease runs, or its lock-delay does.
    pub fn matters_until_ms(&self) -> i64 {
        let ended = self.ended_ms.unwrap_or(self.lease.expires_ms);
        self.lease.free_at_ms(ended.max(self.lease.expires_ms))
    }
}

/// A lease row as ClickHouse holds it. Whether it is in force also takes
/// the id's claim, which the lock protocol decides (`locks::claim`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredLease {
    pub record: LeaseRecord,
    /// Not expired by ClickHouse's clock.
    pub unexpired: bool,
    /// Where peers reach the gateway that granted it (empty when it said
    /// nothing): after its claim lapsed, it may still re-win the claim and
    /// answer for the lease.
    pub authority_url: String,
}

/// A row as the lock core's unit tests start from: `gateway_id`'s lease
/// with token 7, granted at `acquired_ms` and expiring 1 ms later.
#[cfg(test)]
impl StoredLease {
    pub fn for_tests(
        state: LeaseState,
        unexpired: bool,
        gateway_id: Uuid,
        acquired_ms: i64,
    ) -> Self {
        Self {
            record: LeaseRecord {
                lease: Lease {
                    state_id: StateId::parse("id".to_owned()).unwrap(),
                    lease_id: Uuid::new_v4(),
                    owner: "worker".to_owned(),
                    fencing_token: 7,
                    gateway_id,
                    acquired_ms,
                    expires_ms: acquired_ms + 1,
                    lock_delay: std::time::Duration::ZERO,
                    info: LeaseInfo::default(),
                    limit: 1,
                    slots: 1,
                },
                version: LeaseVersion::granted(7),
                state,
                ended_ms: None,
                forced: None,
            },
            unexpired,
            authority_url: String::new(),
        }
    }
}

/// Every column, for batched lease writes.
#[derive(clickhouse::Row, Serialize)]
pub(super) struct LeaseRowOut {
    pub(super) state_id: String,
    pub(super) kind: i8,
    #[serde(with = "clickhouse::serde::uuid")]
    pub(super) claim_id: Uuid,
    #[serde(with = "clickhouse::serde::uuid")]
    pub(super) lease_id: Uuid,
    #[serde(with = "clickhouse::serde::uuid")]
    pub(super) gateway_id: Uuid,
    pub(super) owner: String,
    pub(super) fencing_token: u64,
    pub(super) created_at: i64,
    pub(super) expires_at: i64,
    pub(super) released: u8,
    pub(super) version: u64,
    pub(super) advertise_url: String,
    pub(super) lock_delay_ms: u64,
    /// 0 while the lease runs.
    pub(super) ended_at: i64,
    pub(super) info: String,
    pub(super) ended_by: &'static str,
    pub(super) actor: String,
    pub(super) reason: String,
    /// The lease's limit: 1 on a state_id, a pool's limit.
    pub(super) pool_limit: u32,
    /// The places it occupies: 1 on a state_id, 1..=limit on a pool.
    pub(super) slots: u32,
}

const KIND_CLAIM: i8 = 1;
pub(super) const KIND_LEASE: i8 = 2;
/// A reservation of fencing tokens: its `fencing_token` is the last reserved.
const KIND_TOKENS: i8 = 3;

/// A claim or lease row as read: the columns of both kinds.
#[derive(Clone, clickhouse::Row, Deserialize)]
pub(super) struct LockRowIn {
    pub(super) kind_code: i8,
    pub(super) state_id: String,
    pub(super) claim_id: String,
    pub(super) lease_id: String,
    pub(super) gateway_id: String,
    pub(super) owner: String,
    pub(super) fencing_token: u64,
    pub(super) created_ms: i64,
    pub(super) expires_ms: i64,
    pub(super) released: u8,
    pub(super) version: u64,
    pub(super) advertise_url: String,
    pub(super) lock_delay_ms: u64,
    /// 0 while the lease runs.
    pub(super) ended_ms: i64,
    pub(super) info: String,
    pub(super) ended_by: String,
    pub(super) actor: String,
    pub(super) reason: String,
    pub(super) pool_limit: u32,
    /// 0 on a row written before leases had it: one place.
    pub(super) slots: u32,
    /// Not expired by ClickHouse's clock.
    pub(super) unexpired: u8,
}

pub(super) const ENDED_RELEASED: &str = "released";
pub(super) const ENDED_FORCED: &str = "forced";

pub(super) const KIND_TYPE: &str = "Enum8('claim' = 1, 'lease' = 2, 'tokens' = 3)";

pub(super) const INSERT_COLUMNS: &str = "(state_id, kind, claim_id, lease_id, gateway_id, owner, fencing_token, created_at, expires_at, released, version, advertise_url)";

pub(super) fn parse_uuid(raw: &str) -> Result<Uuid, StoreError> {
    Uuid::parse_str(raw).map_err(|e| {
        StoreError::ClickHouse(clickhouse::error::Error::Custom(format!(
            "bad UUID {raw:?}: {e}"
        )))
    })
}

/// What ClickHouse records of one id's locks: its live claim candidates
/// and its lease rows, read together in one query.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IdLocks {
    /// Earliest (server time, then id) first: the first is the claim
    /// holder, or about to be.
    pub candidates: Vec<Candidate>,
    /// Its lease rows, oldest grant first: one on a state_id, those that may
    /// still matter on a pool.
    pub leases: Vec<StoredLease>,
    /// The latest candidate that lapsed, within [`LAPSED_CLAIMS_READ`],
    /// without being withdrawn: its gateway stopped renewing it (it crashed,
    /// or was cut off from ClickHouse) and, if it lives, may still answer for
    /// leases granted under it whose rows have not landed.
    pub lapsed: Option<Candidate>,
    /// The highest fencing token of the id reserved or handed out (0 for
    /// none): its reservation row, read with the rest, so that a claim won
    /// by this read reserves above it without reading it again.
    pub last_token: u64,
}

impl IdLocks {
    /// The latest lease row: a state_id's only one.
    pub fn latest(&self) -> Option<&StoredLease> {
        self.leases.last()
    }

    /// Sorts rows of one id into its candidates and its lease rows.
    pub(super) fn assemble(rows: Vec<LockRowIn>) -> Result<Self, StoreError> {
        let mut locks = Self::default();
        for row in rows {
            if row.kind_code == KIND_TOKENS {
                locks.last_token = locks.last_token.max(row.fencing_token);
            } else if row.kind_code == KIND_CLAIM {
                let live = row.unexpired != 0;
                let candidate = Candidate {
                    claim_id: parse_uuid(&row.claim_id)?,
                    gateway_id: parse_uuid(&row.gateway_id)?,
                    created_ms: row.created_ms,
                    advertise_url: row.advertise_url,
                    expires_ms: row.expires_ms,
                };
                if live {
                    locks.candidates.push(candidate);
                } else {
                    // Rows come earliest first: the last one is the latest.
                    locks.lapsed = Some(candidate);
                }
            } else if let Some(lease) = stored_lease(row)? {
                locks.last_token = locks.last_token.max(lease.record.lease.fencing_token);
                locks.leases.push(lease);
            }
        }
        Ok(locks)
    }
}

/// A lease row as read, or None when its id is not one the gateway serves.
fn stored_lease(row: LockRowIn) -> Result<Option<StoredLease>, StoreError> {
    let Ok(state_id) = StateId::parse(row.state_id) else {
        return Ok(None);
    };
    let record = LeaseRecord {
        lease: Lease {
            state_id,
            lease_id: parse_uuid(&row.lease_id)?,
            gateway_id: parse_uuid(&row.gateway_id)?,
            owner: row.owner,
            fencing_token: row.fencing_token,
            acquired_ms: row.created_ms,
            expires_ms: row.expires_ms,
            lock_delay: std::time::Duration::from_millis(row.lock_delay_ms),
            info: LeaseInfo::from_stored(&row.info),
            limit: usize::try_from(row.pool_limit).unwrap_or(1).max(1),
            slots: usize::try_from(row.slots).unwrap_or(1).max(1),
        },
        version: LeaseVersion::from_bits(row.version),
        state: LeaseState::from_column(row.released),
        ended_ms: (row.ended_ms > 0).then_some(row.ended_ms),
        forced: (row.ended_by == ENDED_FORCED).then_some(Forced {
            actor: row.actor,
            reason: row.reason,
        }),
    };
    Ok(Some(StoredLease {
        record,
        unexpired: row.unexpired != 0,
        authority_url: row.advertise_url,
    }))
}

/// How long after it lapsed an unwithdrawn candidate is still read (see
/// [`IdLocks::lapsed`]): longer than a gateway is cut off from ClickHouse and
/// lives on, short enough that a crashed one is soon forgotten.
pub const LAPSED_CLAIMS_READ: std::time::Duration = std::time::Duration::from_secs(600);
const LAPSED_CLAIMS_READ_SECONDS: u64 = LAPSED_CLAIMS_READ.as_secs();

/// Claim and lease rows of `table` matching `filter`, by id, then earliest
/// first. Of a pool's lease rows, those that may still keep a place: their
/// lease or its lock-delay has not run out.
pub(super) fn lock_rows_sql(table: &str, filter: &str, rows: LeaseRows) -> String {
    format!(
        "SELECT {LOCK_COLUMNS} FROM {table} FINAL WHERE {}
         ORDER BY state_id, created_at, claim_id",
        lock_rows_filter(filter, rows)
    )
}

/// The columns of [`LockRowIn`], in its order.
pub(super) const LOCK_COLUMNS: &str =
    "CAST(kind AS Int8) AS kind_code, state_id, toString(claim_id) AS claim_id,
    toString(lease_id) AS lease_id, toString(gateway_id) AS gateway_id, owner,
    fencing_token, toUnixTimestamp64Milli(created_at) AS created_ms,
    toUnixTimestamp64Milli(expires_at) AS expires_ms, released, version,
    advertise_url, lock_delay_ms, toUnixTimestamp64Milli(ended_at) AS ended_ms,
    info, ended_by, actor, reason, pool_limit, slots,
    expires_at > now64(3) AS unexpired";

/// The rows of [`lock_rows_sql`]: those `filter` selects that may matter,
/// and the id's token reservation (one row an id, the highest kept).
pub(super) fn lock_rows_filter(filter: &str, rows: LeaseRows) -> String {
    let leases = match rows {
        LeaseRows::PerId => "kind = 'lease'",
        LeaseRows::PerLease => {
            "kind = 'lease' AND expires_at + toIntervalMillisecond(lock_delay_ms) > now64(3)"
        }
    };
    format!(
        "{filter}
           AND (({leases}) OR kind = 'tokens' OR (kind = 'claim' AND released = 0
                AND expires_at > now64(3) - toIntervalSecond({LAPSED_CLAIMS_READ_SECONDS})))"
    )
}

/// Puts one id's lock rows in `lock_rows_sql`'s order: earliest first, then
/// by claim id as text (its `ORDER BY created_at, claim_id` sorts by the
/// `claim_id` it selects, the text; ClickHouse compares strings bytewise, as
/// Rust does).
pub(super) fn in_lock_order(locks: &mut [LockRowIn]) {
    locks.sort_by(|a, b| {
        (a.created_ms, a.claim_id.as_str()).cmp(&(b.created_ms, b.claim_id.as_str()))
    });
}

/// The lease table's DDL (see [`Placement`]). Claims are only needed while
/// they can matter; token rows stay, since they carry the last fencing token
/// of their id, and so do a state_id's lease rows, one per id.
pub(super) fn create_table_sql(table: &str, placement: &Placement, rows: LeaseRows) -> String {
    let gone = match rows {
        LeaseRows::PerId => "kind = 'claim'",
        LeaseRows::PerLease => "kind IN ('claim', 'lease')",
    };
    format!(
        "CREATE TABLE IF NOT EXISTS {table}{} (
            state_id String,
            kind {KIND_TYPE},
            claim_id UUID,
            lease_id UUID,
            gateway_id UUID,
            owner String,
            fencing_token UInt64,
            created_at DateTime64(3),
            expires_at DateTime64(3),
            released UInt8,
            version UInt64,
            advertise_url String DEFAULT '',
            lock_delay_ms UInt64 DEFAULT 0,
            ended_at DateTime64(3) DEFAULT 0,
            info String DEFAULT '',
            ended_by LowCardinality(String) DEFAULT '',
            actor String DEFAULT '',
            reason String DEFAULT '',
            pool_limit UInt32 DEFAULT 0,
            slots UInt32 DEFAULT 0
        ) ENGINE = {}
        ORDER BY (state_id, kind, claim_id)
        TTL toDateTime(expires_at) + INTERVAL 1 DAY DELETE WHERE {gone}",
        placement.on_cluster(),
        placement.merge_tree("ReplacingMergeTree", "version"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOLDER: &str = "11111111-1111-1111-1111-111111111111";
    const OTHER: &str = "22222222-2222-2222-2222-222222222222";

    fn claim(gateway: &str) -> LockRowIn {
        LockRowIn {
            kind_code: KIND_CLAIM,
            state_id: "id".into(),
            claim_id: Uuid::new_v4().to_string(),
            lease_id: NIL_UUID.into(),
            gateway_id: gateway.into(),
            owner: String::new(),
            fencing_token: 0,
            created_ms: 1,
            expires_ms: 2,
            released: 0,
            version: 1,
            advertise_url: "http://peer".into(),
            lock_delay_ms: 0,
            ended_ms: 0,
            info: String::new(),
            ended_by: String::new(),
            actor: String::new(),
            reason: String::new(),
            pool_limit: 0,
            slots: 0,
            unexpired: 1,
        }
    }

    fn lease(state: LeaseState, unexpired: bool) -> LockRowIn {
        LockRowIn {
            kind_code: KIND_LEASE,
            claim_id: NIL_UUID.into(),
            lease_id: Uuid::new_v4().to_string(),
            gateway_id: HOLDER.into(),
            owner: "worker".into(),
            fencing_token: 7,
            released: state as u8,
            advertise_url: String::new(),
            unexpired: u8::from(unexpired),
            ..claim(HOLDER)
        }
    }

    /// The record a lone lease row reads as.
    fn record_of(row: LockRowIn) -> LeaseRecord {
        IdLocks::assemble(vec![row])
            .unwrap()
            .leases
            .pop()
            .unwrap()
            .record
    }

    #[test]
    fn a_pools_lease_rows_are_kept_apart_in_grant_order() {
        let rows = vec![claim(HOLDER), lease(LeaseState::Held, true), {
            let mut second = lease(LeaseState::Held, true);
            second.fencing_token = 8;
            second.pool_limit = 3;
            second
        }];
        let locks = IdLocks::assemble(rows).unwrap();
        let tokens: Vec<u64> = locks
            .leases
            .iter()
            .map(|l| l.record.lease.fencing_token)
            .collect();
        assert_eq!(tokens, [7, 8]);
        assert_eq!(locks.latest().unwrap().record.lease.limit, 3);
        assert_eq!(locks.leases[0].record.lease.limit, 1, "a state_id's row");
    }

    #[test]
    fn a_lease_row_says_whether_it_expired() {
        let unexpired = |rows| {
            IdLocks::assemble(rows)
                .unwrap()
                .leases
                .pop()
                .unwrap()
                .unexpired
        };
        assert!(unexpired(vec![lease(LeaseState::Held, true)]));
        assert!(!unexpired(vec![
            claim(HOLDER),
            lease(LeaseState::Held, false)
        ]));
    }

    #[test]
    fn a_row_matters_until_its_lease_and_its_lock_delay_have_run_out() {
        let mut locks = IdLocks::assemble(vec![lease(LeaseState::Held, true)]).unwrap();
        let mut record = locks.leases.pop().unwrap().record;
        record.lease.expires_ms = 10_000;
        assert_eq!(record.matters_until_ms(), 10_000);
        record.lease.lock_delay = std::time::Duration::from_secs(5);
        assert_eq!(record.matters_until_ms(), 15_000);
        // Forced before its expiry: the expiry still bounds what views need.
        record.ended_ms = Some(4_000);
        assert_eq!(record.matters_until_ms(), 15_000);
        record.ended_ms = Some(12_000);
        assert_eq!(record.matters_until_ms(), 17_000);
    }

    #[test]
    fn a_lease_row_carries_its_lock_delay_and_its_end() {
        let mut row = lease(LeaseState::Released, false);
        row.lock_delay_ms = 15_000;
        row.ended_ms = 1_234;
        let record = record_of(row);
        assert_eq!(record.lease.lock_delay, std::time::Duration::from_secs(15));
        assert_eq!(record.ended_ms, Some(1_234));
        let running = IdLocks::assemble(vec![lease(LeaseState::Held, true)]).unwrap();
        assert_eq!(running.latest().unwrap().record.ended_ms, None);
    }

    #[test]
    fn a_lease_row_carries_its_info_and_who_forced_its_end() {
        let mut row = lease(LeaseState::Released, false);
        row.info = r#"{"host":"a"}"#.into();
        row.ended_by = ENDED_FORCED.into();
        row.actor = "ops".into();
        row.reason = "stuck".into();
        let record = record_of(row);
        assert_eq!(record.lease.info.as_str(), r#"{"host":"a"}"#);
        assert_eq!(record.ended_by(), ENDED_FORCED);
        assert_eq!(
            record.forced,
            Some(Forced {
                actor: "ops".into(),
                reason: "stuck".into()
            })
        );
        let mut released = IdLocks::assemble(vec![lease(LeaseState::Released, false)]).unwrap();
        let record = released.leases.pop().unwrap().record;
        assert_eq!(record.ended_by(), ENDED_RELEASED);
        assert_eq!(record.lease.info, LeaseInfo::default());
        let held = IdLocks::assemble(vec![lease(LeaseState::Held, true)]).unwrap();
        assert_eq!(held.latest().unwrap().record.ended_by(), "");
    }

    #[test]
    fn candidates_keep_their_order_and_the_lease_row_is_apart() {
        let rows = vec![claim(OTHER), claim(HOLDER), lease(LeaseState::Held, true)];
        let locks = IdLocks::assemble(rows).unwrap();
        let gateways: Vec<String> = locks
            .candidates
            .iter()
            .map(|c| c.gateway_id.to_string())
            .collect();
        assert_eq!(gateways, [OTHER, HOLDER]);
        assert_eq!(locks.latest().unwrap().record.lease.fencing_token, 7);
    }

    #[test]
    fn a_lapsed_candidate_is_kept_apart_the_latest_one_and_a_lease_row_names_its_authority() {
        let lapsed = |gateway: &str, created_ms: i64| LockRowIn {
            created_ms,
            unexpired: 0,
            ..claim(gateway)
        };
        let mut row = lease(LeaseState::Held, true);
        row.advertise_url = "http://holder".into();
        let rows = vec![lapsed(OTHER, 1), lapsed(HOLDER, 5), claim(OTHER), row];
        let locks = IdLocks::assemble(rows).unwrap();
        assert_eq!(
            locks.candidates.len(),
            1,
            "only live candidates are in line"
        );
        let lapsed = locks.lapsed.as_ref().expect("the lapsed candidate is read");
        assert_eq!(lapsed.gateway_id.to_string(), HOLDER);
        assert_eq!(locks.latest().unwrap().authority_url, "http://holder");
    }

    #[test]
    fn the_token_reservation_row_gives_the_last_token_and_is_no_lease() {
        let tokens = |last: u64| LockRowIn {
            kind_code: KIND_TOKENS,
            fencing_token: last,
            ..claim(NIL_UUID)
        };
        let locks = IdLocks::assemble(vec![tokens(1024), lease(LeaseState::Held, true)]).unwrap();
        assert_eq!(locks.last_token, 1024);
        assert_eq!(locks.leases.len(), 1, "the reservation is not a lease");
        assert!(locks.candidates.is_empty() && locks.lapsed.is_none());
        let recorded = IdLocks::assemble(vec![lease(LeaseState::Held, true)]).unwrap();
        assert_eq!(recorded.last_token, 7, "a lease row's token counts too");
        assert_eq!(IdLocks::assemble(Vec::new()).unwrap().last_token, 0);
    }
}
