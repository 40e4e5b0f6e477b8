//! The gateway claim: which gateway is a state_id's authority. One
//! interface ([`protocol::ClaimProtocol`]), two protocols chosen at start
//! with `--coordination`: [`table`] (candidates in the lease table and a
//! settle, for one ClickHouse node, which a lone member of [`membership`]
//! skips) and [`keeper`] (a KeeperMap key per state_id, for any topology),
//! each in its own file; the steps their claim attempts share are in
//! [`claimant`], the guard that withdraws an abandoned claim in [`guard`]. Everything above the claim (leases in
//! memory, forwarding, lease rows) is the same for both.

mod claimant;
mod guard;
mod keeper;
mod key_reads;
mod membership;
mod protocol;
mod table;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use uuid::Uuid;

use self::claimant::Claimant;
use self::keeper::KeeperClaims;
use self::key_reads::KeyReads;
use self::membership::Membership;
use self::protocol::ClaimProtocol;
pub(super) use self::protocol::{Authority, ClaimOutcome};
use self::table::TableClaims;
use super::peer::SeenLease;
use super::slot::{Lapsed, TokenBlock};
use super::timing::ClaimTiming;
use crate::config::LockSettings;
use crate::domain::{Coordination, Lease, StateId};
use crate::metrics::Metrics;
use crate::store::{Candidate, KeeperClaimStore, LeaseStore, StoreError};

/// This gateway's side of the claim protocol: the protocol it speaks, and
/// the timing its claims follow. The lock handle (`LockManager`) and the
/// maintenance task share one.
pub(super) struct Coordinator {
    /// Where claims are kept and how they are won: every operation on a
    /// claim is handed to it.
    protocol: Box<dyn ClaimProtocol>,
    /// Every wait and margin derived from the claim TTL, the settle time
    /// and the query timeout.
    timing: ClaimTiming,
    /// Table mode's membership, kept alive by [`Coordinator::keep_membership`].
    membership: Option<Arc<Membership>>,
}

impl Coordinator {
    pub fn new(
        settings: LockSettings,
        timing: ClaimTiming,
        leases: LeaseStore,
        keeper: KeeperClaimStore,
        metrics: Arc<Metrics>,
    ) -> Self {
        let coordination = settings.coordination;
        // Every table-mode gateway is a member, whatever its settle: a
        // lone member's skip is safe only if every gateway that may claim
        // announces itself (see `membership`).
        let membership = match (coordination, leases.members()) {
            (Coordination::Table, Some(members)) => Some(Arc::new(Membership::new(
                members.clone(),
                settings.gateway_id,
                timing,
            ))),
            _ => None,
        };
        let claimant = Claimant {
            leases,
            settings,
            timing,
            metrics,
        };
        let protocol: Box<dyn ClaimProtocol> = match coordination {
            Coordination::Table => Box::new(TableClaims {
                claimant,
                membership: membership.clone(),
            }),
            Coordination::Keeper => Box::new(KeeperClaims {
                claimant,
                store: keeper,
                routed: KeyReads::default(),
            }),
        };
        Self {
            protocol,
            timing,
            membership,
        }
    }

    /// Keeps this gateway a member (table mode): joins at once, then beats
    /// every `member_beat`, for as long as it runs. A beat that fails is
    /// retried at the next; if the row may have lapsed meanwhile, the next
    /// beat (or claim) joins again, and claims wait the join out.
    pub(super) async fn keep_membership(&self) {
        let Some(membership) = &self.membership else {
            return std::future::pending().await;
        };
        let mut tick = tokio::time::interval(self.timing.member_beat());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            tick.tick().await;
            match membership.beat().await {
                Ok(()) => failing = false,
                // Said once a run of failures: a user that may not write
                // fails every beat, and takes no lock either.
                Err(err) if !failing => {
                    failing = true;
                    tracing::warn!(error = %err, "membership heartbeat not written; retrying");
                }
                Err(err) => tracing::debug!(error = %err, "membership heartbeat not written"),
            }
        }
    }

    /// Whether a routing read asked for at `at` still stands in for a fresh
    /// one: for half the settle, as a new claim grants nothing before it
    /// settles; in table mode only while this gateway has been a member
    /// throughout, as only a gateway that read no other live member grants
    /// without settling.
    pub fn seen_fresh(&self, at: Instant) -> bool {
        at.elapsed() < self.timing.seen_lease_fresh()
            && self
                .membership
                .as_ref()
                .is_none_or(|membership| membership.member_since(at))
    }

    /// The claim timing, for the acquire loop, routing and maintenance.
    pub fn timing(&self) -> &ClaimTiming {
        &self.timing
    }

    /// Claims `id` for this gateway, waiting in line until `deadline` behind
    /// a holder that cannot be forwarded to; with `lapsed`, re-winning this
    /// gateway's lapsed claim (see [`ClaimProtocol::try_claim`]).
    pub(super) async fn try_claim(
        &self,
        id: &StateId,
        deadline: Instant,
        lapsed: Option<&Lapsed>,
    ) -> Result<ClaimOutcome, StoreError> {
        self.protocol.try_claim(id, deadline, lapsed).await
    }

    /// Reserves the next block of fencing tokens under the held claim, from
    /// `first` on at least. None: the claim turned out to be lost.
    pub(super) async fn reserve_tokens(
        &self,
        id: &StateId,
        claim_id: Uuid,
        first: u64,
    ) -> Result<Option<TokenBlock>, StoreError> {
        self.protocol.reserve_tokens(id, claim_id, first).await
    }

    /// Renews held claims; answers the ones found lost (another gateway's
    /// now), which the caller drops.
    pub(super) async fn renew_claims(
        &self,
        held: &[(StateId, Uuid)],
    ) -> Result<Vec<Uuid>, StoreError> {
        self.protocol.renew_claims(held).await
    }

    /// Gives up held claims (idle, handed over, or at shutdown).
    pub(super) async fn withdraw_claims(
        &self,
        claims: &[(StateId, Uuid)],
    ) -> Result<(), StoreError> {
        self.protocol.withdraw_claims(claims).await
    }

    /// Withdraws a claim without making anyone wait for it (a drop guard, a
    /// hand-over): nothing here depends on its landing before the caller goes on.
    pub(super) fn withdraw_in_background(&self, id: StateId, candidate: Candidate) {
        self.protocol.withdraw_in_background(id, candidate);
    }

    /// Which of the held ids another gateway waits for.
    pub(super) async fn contested(&self, ids: &[StateId]) -> Result<HashSet<StateId>, StoreError> {
        self.protocol.contested(ids).await
    }

    /// Who holds `id`'s claim, with the lease row recorded for it; with its
    /// current state row too when `with_row` (one statement all the same),
    /// which the store keeps for the write.
    pub(super) async fn authority(
        &self,
        id: &StateId,
        with_row: bool,
    ) -> Result<Authority, StoreError> {
        self.protocol.authority(id, with_row).await
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
        if let Some(seen) = seen.filter(|s| self.seen_fresh(s.at)) {
            return Ok(seen.lease.clone());
        }
        Ok(self.authority(id, false).await?.lease_in_force().cloned())
    }

    /// Every lease ClickHouse records as in force, through any gateway.
    pub(super) async fn recorded_leases(&self) -> Result<Vec<Lease>, StoreError> {
        self.protocol.recorded_leases().await
    }

    /// The other gateways that hold claims and can be reached.
    pub(super) async fn claim_holders(&self) -> Result<Vec<(Uuid, String)>, StoreError> {
        self.protocol.claim_holders().await
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::claimant::{orphaned, place_end};
    use super::protocol::in_force;
    use super::*;
    use crate::domain::LeaseState;
    use crate::store::StoredLease;

    const HOLDER: Uuid = Uuid::from_u128(1);
    const OTHER: Uuid = Uuid::from_u128(2);

    fn stored(state: LeaseState, unexpired: bool) -> StoredLease {
        StoredLease::for_tests(state, unexpired, HOLDER, 1)
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
        assert_eq!(place_end(&forced, 6_000), Some(9_000));
        assert_eq!(place_end(&forced, 9_000), None);
        // Expired at 10 000 ms: free 5 s after that.
        let expired = delayed(LeaseState::Held, false, None);
        assert_eq!(place_end(&expired, 12_000), Some(15_000));
        assert_eq!(place_end(&expired, 15_001), None);
        // A release row carries no delay.
        let mut released = delayed(LeaseState::Released, true, Some(4_000));
        released.record.lease.lock_delay = Duration::ZERO;
        assert_eq!(place_end(&released, 4_001), None);
    }

    #[test]
    fn a_lease_whose_authority_is_gone_is_held_until_it_would_have_expired() {
        // Its holder may run on unaware (its authority may only be frozen):
        // the next authority keeps it as held until its expiry, and its
        // lock-delay runs from then (see `locks::slot::orphan_tests`).
        let running = delayed(LeaseState::Held, true, None);
        assert!(orphaned(&running, 7_000));
        assert!(!orphaned(&running, 10_000), "expired: only its lock-delay");
        assert_eq!(place_end(&running, 10_000), Some(15_000));
        let forced = delayed(LeaseState::Released, true, Some(4_000));
        assert!(!orphaned(&forced, 7_000), "ended by a force-unlock");
        let handed = delayed(LeaseState::HandedOver, true, None);
        assert!(!orphaned(&handed, 7_000), "adopted, not kept");
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
