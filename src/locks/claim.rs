//! The gateway claim: which gateway is a state_id's authority. One
//! interface, two protocols chosen at start with `--coordination`:
//! [`table`] (candidates in the lease table and a settle, for one ClickHouse
//! node) and [`keeper`] (a KeeperMap key per state_id, for any topology).
//! Everything above the claim (leases in memory, forwarding, lease rows)
//! is the same for both.

mod keeper;
mod table;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::peer::{Peer, SeenLease};
use super::slot::{Delay, Inherited, Lapsed, LocalLease, TokenBlock, WonClaim};
use super::timing::ClaimTiming;
use crate::config::LockSettings;
use crate::domain::{Coordination, Lease, LeaseState, StateId};
use crate::metrics::Metrics;
use crate::store::{
    Candidate, IdLocks, KeeperClaimStore, LeaseRows, LeaseStore, StoreError, StoredLease, now_ms,
};

/// Fencing tokens reserved per ClickHouse write: a claim holder hands out
/// this many before it writes again.
const TOKENS_PER_BLOCK: u64 = 1024;

/// How often a gateway waiting in line for a claim looks whether its turn
/// has come.
const CLAIM_POLL: Duration = Duration::from_millis(100);

/// The claim protocol this gateway speaks.
#[derive(Clone)]
pub(super) enum Claims {
    Table,
    Keeper(Box<KeeperClaimStore>),
}

/// This gateway's side of the claim protocol: where claims and lease rows
/// are kept, and the settings their timing comes from. The lock handle
/// (`LockManager`) and the maintenance task share one.
pub(super) struct Coordinator {
    claims: Claims,
    leases: LeaseStore,
    settings: LockSettings,
    /// Every wait and margin derived from the claim TTL, the settle time
    /// and the query timeout.
    timing: ClaimTiming,
    metrics: Arc<Metrics>,
}

/// What one claim attempt came to.
pub(super) enum ClaimOutcome {
    Won(Box<WonClaim>),
    /// A gateway peers can reach holds the claim: the request belongs there.
    Elsewhere(Peer),
    Lost,
}

/// Who holds an id's claim, with the leases ClickHouse records for it.
pub(super) struct Authority {
    /// Gateways with a live claim on the id, the holder first (in table
    /// mode the others are candidates in line).
    pub claims: Vec<Candidate>,
    /// The id's lease rows: a state_id's one, a pool's that may matter.
    pub leases: Vec<StoredLease>,
    /// With no live claim: the gateway whose claim lapsed while its leases
    /// ran, if nobody claimed the id since and it advertised a URL. It may
    /// re-win the claim and keep them (see `locks::slot::Lapsed`), so it is
    /// asked first.
    pub lapsed: Option<Candidate>,
}

impl Authority {
    /// The gateway holding the claim, if any does.
    pub fn holder(&self) -> Option<&Candidate> {
        self.claims.first()
    }

    /// The recorded lease rows whose leases are in force, oldest first.
    pub fn in_force(&self) -> impl Iterator<Item = &StoredLease> {
        self.leases.iter().filter(|stored| {
            in_force(stored, |gateway| {
                self.claims.iter().any(|c| c.gateway_id == gateway)
            })
        })
    }

    /// The gateway to ask first when no claim is live: the lapsed holder,
    /// unless it is `me`.
    pub fn lapsed_holder(&self, me: Uuid) -> Option<&Candidate> {
        self.lapsed
            .as_ref()
            .filter(|c| self.claims.is_empty() && c.gateway_id != me)
    }

    /// The latest recorded lease in force: a state_id's lease.
    pub fn lease_in_force(&self) -> Option<&Lease> {
        self.in_force().last().map(|stored| &stored.record.lease)
    }
}

/// Whether a recorded lease is in force: this is the one place the rule is
/// written. Unexpired, and either handed over at a shutdown (no gateway
/// holds it; the next authority adopts it) or held by a gateway whose claim
/// on the id is live: a lease ends with its authority's claim.
pub(super) fn in_force(stored: &StoredLease, has_claim: impl Fn(Uuid) -> bool) -> bool {
    stored.unexpired
        && match stored.record.state {
            LeaseState::HandedOver => true,
            LeaseState::Held => has_claim(stored.record.lease.gateway_id),
            LeaseState::Released => false,
        }
}

impl Coordinator {
    pub fn new(
        settings: LockSettings,
        timing: ClaimTiming,
        leases: LeaseStore,
        keeper: KeeperClaimStore,
        metrics: Arc<Metrics>,
    ) -> Self {
        let claims = match settings.coordination {
            Coordination::Table => Claims::Table,
            Coordination::Keeper => Claims::Keeper(Box::new(keeper)),
        };
        Self {
            claims,
            leases,
            settings,
            timing,
            metrics,
        }
    }

    /// The claim timing, for the acquire loop, routing and maintenance.
    pub fn timing(&self) -> &ClaimTiming {
        &self.timing
    }

    /// Claims `id` for this gateway, waiting in line until `deadline` behind
    /// a holder that cannot be forwarded to. With `lapsed`, this gateway's
    /// own claim that lapsed with leases kept: re-won with nothing in
    /// between, the win adopts them again ([`WonClaim::readopted`]).
    pub(super) async fn try_claim(
        &self,
        id: &StateId,
        deadline: Instant,
        lapsed: Option<&Lapsed>,
    ) -> Result<ClaimOutcome, StoreError> {
        match &self.claims {
            Claims::Table => self.claim_in_table(id, deadline, lapsed).await,
            Claims::Keeper(store) => self.claim_in_keeper(store, id, deadline, lapsed).await,
        }
    }

    /// Reserves the next block of fencing tokens under the held claim, from
    /// `first` on at least. None: the claim turned out to be lost.
    pub(super) async fn reserve_tokens(
        &self,
        id: &StateId,
        claim_id: Uuid,
        first: u64,
    ) -> Result<Option<TokenBlock>, StoreError> {
        match &self.claims {
            Claims::Table => self.reserve_in_table(id, first).await.map(Some),
            Claims::Keeper(store) => self.reserve_in_keeper(store, id, claim_id, first).await,
        }
    }

    /// Renews held claims; answers the ones found lost (another gateway's
    /// now), which the caller drops.
    pub(super) async fn renew_claims(
        &self,
        held: &[(StateId, Uuid)],
    ) -> Result<Vec<Uuid>, StoreError> {
        match &self.claims {
            Claims::Table => {
                let ids: Vec<Uuid> = held.iter().map(|(_, claim)| *claim).collect();
                let renewed = self
                    .leases
                    .renew_claims(self.settings.gateway_id, &ids, self.timing.ttl())
                    .await?;
                Ok(ids.into_iter().filter(|id| !renewed.contains(id)).collect())
            }
            Claims::Keeper(store) => self.renew_in_keeper(store, held).await,
        }
    }

    /// Gives up held claims (idle, handed over, or at shutdown).
    pub(super) async fn withdraw_claims(
        &self,
        claims: &[(StateId, Uuid)],
    ) -> Result<(), StoreError> {
        match &self.claims {
            Claims::Table => {
                let ids: Vec<Uuid> = claims.iter().map(|(_, claim)| *claim).collect();
                self.leases
                    .withdraw_claims(self.settings.gateway_id, &ids)
                    .await
            }
            Claims::Keeper(store) => {
                for (id, claim_id) in claims {
                    store.release(id, *claim_id).await?;
                }
                Ok(())
            }
        }
    }

    /// Withdraws a claim without making anyone wait for it (a drop guard, a
    /// hand-over): nothing here depends on its landing before the caller goes on.
    pub(super) fn withdraw_in_background(&self, id: StateId, candidate: Candidate) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (claims, leases) = (self.claims.clone(), self.leases.clone());
        runtime.spawn(async move {
            let withdrawn = match &claims {
                Claims::Table => leases.withdraw_claim(&id, &candidate).await,
                Claims::Keeper(store) => store.release(&id, candidate.claim_id).await.map(drop),
            };
            if let Err(err) = withdrawn {
                tracing::warn!(state_id = %id, error = %err, "could not withdraw a claim");
            }
        });
    }

    /// Which of the held ids another gateway waits for.
    pub(super) async fn contested(&self, ids: &[StateId]) -> Result<HashSet<StateId>, StoreError> {
        match &self.claims {
            Claims::Table => Ok(self
                .leases
                .contested(self.settings.gateway_id, ids)
                .await?
                .into_iter()
                .collect()),
            Claims::Keeper(store) => Ok(store
                .read_many(ids)
                .await?
                .into_iter()
                .filter(|(_, read)| {
                    read.claim.as_ref().is_some_and(|c| {
                        c.waiting_gateway
                            .is_some_and(|w| w != self.settings.gateway_id)
                    })
                })
                .map(|(id, _)| id)
                .collect()),
        }
    }

    /// Who holds `id`'s claim, with the lease row recorded for it.
    pub(super) async fn authority(&self, id: &StateId) -> Result<Authority, StoreError> {
        match &self.claims {
            Claims::Table => {
                let locks = self.leases.id_locks(id).await?;
                // A lease row that runs with no live claim at all: its
                // gateway's claim lapsed, and no other was made since (a
                // winner's candidate stays live while its lease runs).
                let lapsed = locks
                    .leases
                    .iter()
                    .filter(|l| locks.candidates.is_empty() && l.unexpired)
                    .filter(|l| l.record.state == LeaseState::Held && !l.authority_url.is_empty())
                    .map(|l| Candidate {
                        claim_id: Uuid::nil(),
                        gateway_id: l.record.lease.gateway_id,
                        created_ms: 0,
                        advertise_url: l.authority_url.clone(),
                        expires_ms: 0,
                    })
                    .next_back();
                Ok(Authority {
                    claims: locks.candidates,
                    leases: locks.leases,
                    lapsed,
                })
            }
            Claims::Keeper(store) => {
                let (read, locks) = tokio::join!(store.read(id), self.leases.id_locks(id));
                let read = read?;
                let holder = read.claim.and_then(|c| c.holder).map(|h| Candidate {
                    claim_id: h.claim_id,
                    gateway_id: h.gateway_id,
                    created_ms: 0,
                    advertise_url: h.advertise_url,
                    expires_ms: h.expires_ms,
                });
                // A holder lapsed in the key: nobody claimed the id since
                // (a claim replaces it, a release clears it).
                let (live, lapsed) = match holder {
                    Some(h) if h.expires_ms > read.now_ms => (Some(h), None),
                    lapsed => (None, lapsed.filter(|h| !h.advertise_url.is_empty())),
                };
                Ok(Authority {
                    claims: live.into_iter().collect(),
                    leases: locks?.leases,
                    lapsed,
                })
            }
        }
    }

    /// The lease in force on `id` by ClickHouse's record: `seen`'s while it
    /// is fresh, else read now. A lease that a routing read did not see
    /// needs a claim it did not see either (a gateway hands its leases on
    /// before it withdraws its claims), and a new claim grants nothing for
    /// the settle time; half of that is the freshness kept.
    pub(super) async fn recorded_lease(
        &self,
        id: &StateId,
        seen: Option<&SeenLease>,
    ) -> Result<Option<Lease>, StoreError> {
        if let Some(seen) = seen.filter(|s| s.at.elapsed() < self.timing.seen_lease_fresh()) {
            return Ok(seen.lease.clone());
        }
        Ok(self.authority(id).await?.lease_in_force().cloned())
    }

    /// Every lease ClickHouse records as in force, through any gateway.
    pub(super) async fn recorded_leases(&self) -> Result<Vec<Lease>, StoreError> {
        let unexpired = self.leases.unexpired_leases().await?;
        let keeper_holders: HashMap<StateId, Uuid> = match &self.claims {
            Claims::Table => HashMap::new(),
            Claims::Keeper(store) => {
                let ids: Vec<StateId> = unexpired
                    .iter()
                    .filter_map(|l| l.latest())
                    .map(|l| l.record.lease.state_id.clone())
                    .collect();
                store
                    .read_many(&ids)
                    .await?
                    .into_iter()
                    .filter_map(|(id, read)| {
                        let holder = read.claim?.holder?;
                        (holder.expires_ms > read.now_ms).then_some((id, holder.gateway_id))
                    })
                    .collect()
            }
        };
        let keeper_holders = &keeper_holders;
        Ok(unexpired
            .into_iter()
            .flat_map(|locks| {
                let IdLocks { candidates, leases } = locks;
                leases.into_iter().filter_map(move |stored| {
                    let id = &stored.record.lease.state_id;
                    let has_claim = |gateway: Uuid| match &self.claims {
                        Claims::Table => candidates.iter().any(|c| c.gateway_id == gateway),
                        Claims::Keeper(_) => keeper_holders.get(id) == Some(&gateway),
                    };
                    in_force(&stored, has_claim).then(|| stored.record.lease.clone())
                })
            })
            .collect())
    }

    /// The other gateways that hold claims and can be reached.
    pub(super) async fn claim_holders(&self) -> Result<Vec<(Uuid, String)>, StoreError> {
        let me = self.settings.gateway_id;
        match &self.claims {
            Claims::Table => self.leases.peers(me).await,
            Claims::Keeper(store) => store.holders(me).await,
        }
    }

    /// What this gateway takes over with a claim just won, from the id's
    /// lease rows: leases handed on at a shutdown and still running, and the
    /// places the others keep (see [`place_end`]). The rows of leases that
    /// `readopting` keeps are this gateway's own, running on.
    pub(super) fn inherit(&self, rows: Vec<StoredLease>, readopting: Option<&Lapsed>) -> Inherited {
        let (now, now_ms) = (Instant::now(), now_ms());
        let mut inherited = Inherited::default();
        let kept = |stored: &StoredLease| {
            readopting.is_some_and(|l| l.leases.contains(&stored.record.lease.lease_id))
        };
        for stored in rows.into_iter().filter(|stored| !kept(stored)) {
            if stored.unexpired && stored.record.state == LeaseState::HandedOver {
                let record = stored.record;
                let remaining = u64::try_from(record.lease.expires_ms - now_ms).unwrap_or(0);
                inherited.leases.push(LocalLease {
                    deadline: now + Duration::from_millis(remaining),
                    version: record.version.renewed(),
                    lease: Lease {
                        gateway_id: self.settings.gateway_id,
                        ..record.lease
                    },
                });
            } else if let Some(free_at) = place_end(&stored, self.leases.rows(), now_ms) {
                inherited.delays.push(Delay::ending(free_at, now, now_ms));
            }
        }
        inherited
    }
}

/// Until when a recorded lease that is not in force keeps its place, if
/// that is still to come: its lock-delay after its end. A release or
/// force-unlock recorded its end; an expired lease ended at its expiry. An
/// unexpired one whose authority lost its claim (it crashed, or its
/// renewals did not land) ends now on a state_id, as this gateway takes the
/// claim over and refuses its holder's writes from here on; on a pool,
/// whose holders write nothing through a gateway, it runs until it would
/// have expired.
pub(super) fn place_end(stored: &StoredLease, rows: LeaseRows, now_ms: i64) -> Option<i64> {
    let record = &stored.record;
    let ended = match (record.ended_ms, rows) {
        (Some(ended), _) => ended,
        (None, LeaseRows::PerId) if stored.unexpired => now_ms,
        (None, LeaseRows::PerId) => record.lease.expires_ms.min(now_ms),
        (None, LeaseRows::PerLease) => record.lease.expires_ms,
    };
    let free_at = record.lease.free_at_ms(ended);
    (free_at > now_ms).then_some(free_at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{LeaseInfo, LeaseVersion};
    use crate::store::LeaseRecord;

    const HOLDER: Uuid = Uuid::from_u128(1);
    const OTHER: Uuid = Uuid::from_u128(2);

    fn stored(state: LeaseState, unexpired: bool) -> StoredLease {
        StoredLease {
            record: LeaseRecord {
                lease: Lease {
                    state_id: StateId::parse("id".to_owned()).unwrap(),
                    lease_id: Uuid::new_v4(),
                    owner: "worker".to_owned(),
                    fencing_token: 7,
                    gateway_id: HOLDER,
                    acquired_ms: 1,
                    expires_ms: 2,
                    lock_delay: Duration::ZERO,
                    info: LeaseInfo::default(),
                    limit: 1,
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

    fn claims(gateways: &[Uuid]) -> impl Fn(Uuid) -> bool {
        let gateways = gateways.to_vec();
        move |gateway| gateways.contains(&gateway)
    }

    /// A lease with a 5 s lock-delay that expires at 10 000 ms.
    fn delayed(state: LeaseState, unexpired: bool, ended_ms: Option<i64>) -> StoredLease {
        let mut stored = stored(state, unexpired);
        stored.record.lease.expires_ms = 10_000;
        stored.record.lease.lock_delay = Duration::from_secs(5);
        stored.record.ended_ms = ended_ms;
        stored
    }

    #[test]
    fn a_lock_delay_runs_from_the_recorded_end_or_the_expiry() {
        // Forced at 4 000 ms: free 5 s later, whatever its expiry says.
        let forced = delayed(LeaseState::Released, true, Some(4_000));
        assert_eq!(place_end(&forced, LeaseRows::PerId, 6_000), Some(9_000));
        assert_eq!(place_end(&forced, LeaseRows::PerId, 9_000), None);
        // Expired at 10 000 ms: free 5 s after that.
        let expired = delayed(LeaseState::Held, false, None);
        assert_eq!(place_end(&expired, LeaseRows::PerId, 12_000), Some(15_000));
        assert_eq!(place_end(&expired, LeaseRows::PerId, 15_001), None);
        // A release row carries no delay.
        let mut released = delayed(LeaseState::Released, true, Some(4_000));
        released.record.lease.lock_delay = Duration::ZERO;
        assert_eq!(place_end(&released, LeaseRows::PerId, 4_001), None);
    }

    #[test]
    fn an_unexpired_lease_whose_authority_is_gone_ends_at_the_take_over() {
        // Its holder hears of the loss only from the new authority: the
        // delay runs from then, not from the crash nor from the expiry.
        let orphaned = delayed(LeaseState::Held, true, None);
        assert_eq!(place_end(&orphaned, LeaseRows::PerId, 7_000), Some(12_000));
    }

    #[test]
    fn a_pool_lease_whose_authority_is_gone_keeps_its_place_until_it_would_have_expired() {
        // Its holder runs on, unaware: no other takes its place before its
        // expiry and lock-delay are over.
        let orphaned = delayed(LeaseState::Held, true, None);
        assert_eq!(
            place_end(&orphaned, LeaseRows::PerLease, 7_000),
            Some(15_000)
        );
        let mut plain = orphaned.clone();
        plain.record.lease.lock_delay = Duration::ZERO;
        assert_eq!(place_end(&plain, LeaseRows::PerLease, 7_000), Some(10_000));
        assert_eq!(place_end(&plain, LeaseRows::PerLease, 10_000), None);
    }

    #[test]
    fn a_held_lease_is_in_force_only_while_its_gateway_holds_a_live_claim() {
        assert!(in_force(&stored(LeaseState::Held, true), claims(&[HOLDER])));
        assert!(in_force(
            &stored(LeaseState::Held, true),
            claims(&[OTHER, HOLDER])
        ));
        assert!(!in_force(&stored(LeaseState::Held, true), claims(&[OTHER])));
        assert!(!in_force(&stored(LeaseState::Held, true), claims(&[])));
    }

    #[test]
    fn a_handed_over_lease_is_in_force_with_no_claim_until_it_expires() {
        assert!(in_force(&stored(LeaseState::HandedOver, true), claims(&[])));
        assert!(!in_force(
            &stored(LeaseState::HandedOver, false),
            claims(&[])
        ));
    }

    #[test]
    fn released_and_expired_leases_are_not_in_force() {
        assert!(!in_force(
            &stored(LeaseState::Released, true),
            claims(&[HOLDER])
        ));
        assert!(!in_force(
            &stored(LeaseState::Held, false),
            claims(&[HOLDER])
        ));
    }

    #[test]
    fn an_authority_read_names_the_first_claim_its_holder() {
        let candidate = |gateway_id| Candidate {
            claim_id: Uuid::new_v4(),
            gateway_id,
            created_ms: 0,
            advertise_url: String::new(),
            expires_ms: 0,
        };
        let read = Authority {
            claims: vec![candidate(OTHER), candidate(HOLDER)],
            leases: vec![stored(LeaseState::Held, true)],
            lapsed: None,
        };
        assert_eq!(read.holder().map(|c| c.gateway_id), Some(OTHER));
        assert!(read.lease_in_force().is_some(), "its gateway is in line");
    }
}
