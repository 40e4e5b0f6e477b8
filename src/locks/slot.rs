//! One state_id's lock state on this gateway, the pure decision of what a
//! waiter does next, and the guards that keep the state right when an
//! acquire is abandoned at an await point.
//!
//! The state sits behind a std `Mutex` that is never held across an
//! `.await`: every critical section is a few field updates, so an async mutex
//! would only add a second way to wait, and a guard's `Drop` can always take
//! the lock synchronously instead of hoping a `try_lock` succeeds.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use uuid::Uuid;

use crate::domain::{Lease, LeaseVersion, StateId};
use crate::metrics::{LockEvent, Metrics};
use crate::store::Candidate;

#[derive(Default)]
pub(super) struct Slot {
    state: Mutex<SlotState>,
    /// Woken whenever a change may let a waiter in: a lease ends, a claim
    /// comes or goes, a waiter leaves the line, a write lands.
    pub changed: Notify,
}

impl Slot {
    pub fn lock(&self) -> MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Default)]
pub(super) struct SlotState {
    /// This gateway's claim on the state_id, without which it grants nothing.
    pub claim: Option<HeldClaim>,
    /// A waiter runs a claim attempt (settle included) outside the lock; no
    /// other waiter starts one meanwhile.
    pub claiming: bool,
    /// The current lease, granted under the claim.
    pub lease: Option<LocalLease>,
    /// Tickets of waiting acquires, first come first served.
    pub queue: VecDeque<u64>,
    pub next_ticket: u64,
    /// Fencing tokens reserved for this gateway's grants.
    pub tokens: TokenBlock,
    /// When a lease last began, was renewed or ended: idle claims go.
    pub last_used: Option<Instant>,
    /// Writes on their way to ClickHouse under the claim, by number, each
    /// with the instant by which it has surely ended (landed, failed or
    /// given up on). One sent just before its lease ended may still land,
    /// and the next holder must read it: no grant, and no hand-over of the
    /// claim, while any is here (see `locks::write`).
    pub sending: HashMap<u64, Instant>,
    pub next_send: u64,
}

pub(super) struct HeldClaim {
    pub candidate: Candidate,
    /// Past this instant the claim may have lapsed in ClickHouse: nothing
    /// granted under it counts any more.
    pub valid_until: Instant,
    /// Another gateway waits: hand the claim over when the current lease ends.
    pub handover: bool,
}

/// Fencing tokens reserved in ClickHouse for this gateway to hand out:
/// `next..=last`, empty once `next` passes `last`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct TokenBlock {
    pub next: u64,
    pub last: u64,
}

pub(super) struct LocalLease {
    pub lease: Lease,
    pub version: LeaseVersion,
    pub deadline: Instant,
}

/// A waiting acquire, as the decision sees it.
pub(super) struct Waiter<'a> {
    pub ticket: u64,
    pub owner: &'a str,
    pub ttl: Duration,
    /// When its `wait_seconds` run out.
    pub deadline: Instant,
    /// It ran a claim attempt of its own already.
    pub attempted_claim: bool,
}

/// The gateway's rules that a decision applies.
#[derive(Clone, Copy)]
pub(super) struct Rules {
    pub gateway_id: Uuid,
    /// The least validity a claim must have left to grant under it.
    pub grant_margin: Duration,
    /// How long past its deadline a waiter stays for a lease that is about
    /// to exist (a claim attempt or a grant under way ahead of it), so that
    /// its 409 can name the holder.
    pub holder_grace: Duration,
}

/// What a waiter does next.
#[derive(Debug, PartialEq)]
pub(super) enum Step {
    /// Granted: the lease is installed; its row is the caller's to record.
    Granted(Lease, LeaseVersion),
    /// The claim has too little validity left to grant under: renew it first.
    RenewClaim(Uuid),
    /// The token block is spent: reserve the next one.
    ReserveTokens { claim_id: Uuid, first: u64 },
    /// Run a claim attempt.
    Claim,
    /// Give up: the wait ran out. With the holder this gateway knows of.
    GiveUp(Option<Lease>),
    /// Sleep until woken or until this instant.
    Wait(Instant),
}

/// A decision and the effect that comes with it, for the caller to carry
/// out once the slot's lock is released.
pub(super) struct Decision {
    pub step: Step,
    /// A claim handed over to the gateway that waits for it: withdraw it.
    pub withdraw: Option<Candidate>,
}

impl SlotState {
    /// Drops what has run out by now.
    pub fn expire(&mut self, id: &StateId, now: Instant, metrics: &Metrics) {
        if self.claim.as_ref().is_some_and(|c| now >= c.valid_until) {
            self.claim = None;
            metrics.lock_event(LockEvent::ClaimLost);
            tracing::warn!(state_id = %id, "claim lapsed: its renewals did not land in time; its lease ends with it");
            if self.lease.take().is_some() {
                metrics.lock_event(LockEvent::Expiry);
            }
        }
        if self.lease.as_ref().is_some_and(|l| now >= l.deadline) {
            self.lease = None;
            metrics.lock_event(LockEvent::Expiry);
        }
        self.sending.retain(|_, until| now < *until);
    }

    /// The claim turned out to be another gateway's (a renewal or a token
    /// reservation refused): it ends here, and its lease with it.
    pub fn lose_claim(&mut self, id: &StateId, metrics: &Metrics) {
        if self.claim.take().is_some() {
            metrics.lock_event(LockEvent::ClaimLost);
            tracing::warn!(state_id = %id, "claim lost to another gateway; its lease ends with it");
            if self.lease.take().is_some() {
                metrics.lock_event(LockEvent::Expiry);
            }
        }
    }

    pub fn is_idle(&self) -> bool {
        self.claim.is_none()
            && !self.claiming
            && self.lease.is_none()
            && self.queue.is_empty()
            && self.sending.is_empty()
    }

    /// Until when writes sent earlier may still land, if any may.
    pub fn landing_until(&self) -> Option<Instant> {
        self.sending.values().max().copied()
    }

    /// Whether the claim may go (idle, or handed over): no lease runs under
    /// it and no write sent under it may still land.
    pub fn claim_can_go(&self) -> bool {
        self.lease.is_none() && self.sending.is_empty()
    }

    /// Decides what `waiter` does next on `id`, from this state and the time
    /// alone. The caller has called [`SlotState::expire`] with the same `now`.
    pub fn next_step(
        &mut self,
        id: &StateId,
        waiter: &Waiter<'_>,
        rules: &Rules,
        now: Instant,
        now_ms: i64,
    ) -> Decision {
        let mut withdraw = None;
        let first = self.queue.front() == Some(&waiter.ticket);
        let turn = first && self.lease.is_none() && !self.claiming && self.sending.is_empty();
        if turn {
            if self.claim.as_ref().is_some_and(|c| c.handover) {
                // Another gateway is waiting: let it go first.
                withdraw = self.claim.take().map(|c| c.candidate);
            }
            let step = match &self.claim {
                Some(claim)
                    if claim.valid_until.saturating_duration_since(now) < rules.grant_margin =>
                {
                    Some(Step::RenewClaim(claim.candidate.claim_id))
                }
                Some(claim) => {
                    let claim_id = claim.candidate.claim_id;
                    let first = self.tokens.next;
                    Some(
                        match self.grant(id, waiter, rules.gateway_id, now_ms, now) {
                            Some((lease, version)) => Step::Granted(lease, version),
                            None => Step::ReserveTokens { claim_id, first },
                        },
                    )
                }
                None if waiter.attempted_claim && now >= waiter.deadline => None,
                None => Some(Step::Claim),
            };
            if let Some(step) = step {
                return Decision { step, withdraw };
            }
        }
        let landing = self.landing_until();
        let step = if now >= waiter.deadline
            && (waiter.attempted_claim || self.claim.is_some() || !turn)
        {
            // A lease about to exist (a claim attempt, a grant or the end of
            // a write under way ahead of this waiter) is worth a short wait,
            // so that the 409 names its holder.
            let coming = self.lease.is_none()
                && !waiter.attempted_claim
                && (self.claiming || landing.is_some() || !first);
            let grace_ends = waiter.deadline + rules.holder_grace;
            if coming && now < grace_ends {
                Step::Wait(landing.map_or(grace_ends, |t| t.min(grace_ends)))
            } else {
                Step::GiveUp(self.lease.as_ref().map(|l| l.lease.clone()))
            }
        } else {
            let until = self
                .lease
                .as_ref()
                .map_or(waiter.deadline, |l| l.deadline.min(waiter.deadline));
            Step::Wait(landing.map_or(until, |t| t.min(until)))
        };
        Decision { step, withdraw }
    }

    /// Grants a lease under the held claim: the next reserved token, the
    /// lease installed as current. None when the token block is spent.
    pub fn grant(
        &mut self,
        id: &StateId,
        waiter: &Waiter<'_>,
        gateway_id: Uuid,
        now_ms: i64,
        now: Instant,
    ) -> Option<(Lease, LeaseVersion)> {
        if self.tokens.next == 0 || self.tokens.next > self.tokens.last {
            return None;
        }
        let token = self.tokens.next;
        self.tokens.next += 1;
        let lease = Lease {
            state_id: id.clone(),
            lease_id: Uuid::new_v4(),
            owner: waiter.owner.to_owned(),
            fencing_token: token,
            gateway_id,
            acquired_ms: now_ms,
            expires_ms: now_ms.saturating_add(millis(waiter.ttl)),
        };
        let version = LeaseVersion::granted(token);
        self.lease = Some(LocalLease {
            lease: lease.clone(),
            version,
            deadline: now + waiter.ttl,
        });
        self.last_used = Some(now);
        Some((lease, version))
    }

    /// Takes a newly reserved block, if the claim it was reserved under still stands.
    pub fn add_tokens(&mut self, claim_id: Uuid, block: TokenBlock) {
        let claim_stands = self
            .claim
            .as_ref()
            .is_some_and(|c| c.candidate.claim_id == claim_id);
        if claim_stands && block.next > self.tokens.last {
            self.tokens = block;
        }
    }
}

pub(super) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// A waiter's place in a slot's line, given up on drop: also when the client
/// goes away and the server drops the acquire mid-wait, which would otherwise
/// leave a dead ticket at the front that nobody behind it gets past.
pub(super) struct InLine {
    slot: Arc<Slot>,
    pub ticket: u64,
}

impl InLine {
    pub fn slot(&self) -> &Slot {
        &self.slot
    }

    pub fn join(slot: Arc<Slot>) -> Self {
        let ticket = {
            let mut st = slot.lock();
            let ticket = st.next_ticket;
            st.next_ticket += 1;
            st.queue.push_back(ticket);
            ticket
        };
        Self { slot, ticket }
    }
}

impl Drop for InLine {
    fn drop(&mut self) {
        self.slot.lock().queue.retain(|t| *t != self.ticket);
        self.slot.changed.notify_waiters();
    }
}

/// Marks a claim attempt under way; clears the mark however the attempt
/// ends, so an abandoned one never blocks the waiters behind it.
pub(super) struct ClaimAttempt<'a>(&'a Slot);

impl<'a> ClaimAttempt<'a> {
    /// Sets the mark, under the lock that decided this waiter claims next.
    pub fn begin(st: &mut SlotState, slot: &'a Slot) -> Self {
        st.claiming = true;
        Self(slot)
    }
}

impl Drop for ClaimAttempt<'_> {
    fn drop(&mut self) {
        self.0.lock().claiming = false;
        self.0.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GATEWAY: Uuid = Uuid::from_u128(7);

    fn id() -> StateId {
        StateId::parse("dev:tap-to-target".to_owned()).unwrap()
    }

    fn rules() -> Rules {
        Rules {
            gateway_id: GATEWAY,
            grant_margin: Duration::from_secs(5),
            holder_grace: Duration::from_secs(2),
        }
    }

    fn waiter(ticket: u64, deadline: Instant) -> Waiter<'static> {
        Waiter {
            ticket,
            owner: "worker",
            ttl: Duration::from_secs(30),
            deadline,
            attempted_claim: false,
        }
    }

    /// A slot holding a fresh claim with tokens to grant, and these waiters in line.
    fn claimed(now: Instant, tickets: &[u64]) -> SlotState {
        SlotState {
            claim: Some(HeldClaim {
                candidate: Candidate {
                    claim_id: Uuid::from_u128(1),
                    gateway_id: GATEWAY,
                    created_ms: 0,
                    advertise_url: String::new(),
                    expires_ms: 0,
                },
                valid_until: now + Duration::from_secs(9),
                handover: false,
            }),
            tokens: TokenBlock { next: 5, last: 9 },
            queue: tickets.iter().copied().collect(),
            next_ticket: tickets.len() as u64,
            ..SlotState::default()
        }
    }

    fn decide(st: &mut SlotState, waiter: &Waiter<'_>, now: Instant) -> Decision {
        st.expire(&id(), now, &Metrics::default());
        st.next_step(&id(), waiter, &rules(), now, 1_000)
    }

    #[test]
    fn the_first_in_line_is_granted_the_next_token() {
        let now = Instant::now();
        let mut st = claimed(now, &[0, 1]);
        let decision = decide(&mut st, &waiter(0, now), now);
        let Step::Granted(lease, _) = decision.step else {
            panic!("not granted: {:?}", decision.step)
        };
        assert_eq!(lease.fencing_token, 5);
        assert_eq!(lease.expires_ms, 31_000);
        assert_eq!(st.tokens.next, 6);
        // The second waits for the lease to end, or for its own deadline.
        let later = now + Duration::from_secs(60);
        assert_eq!(
            decide(&mut st, &waiter(1, later), now).step,
            Step::Wait(now + Duration::from_secs(30))
        );
    }

    #[test]
    fn a_lease_ends_for_the_next_grant_only_once_its_writes_have_landed() {
        let now = Instant::now();
        let mut st = claimed(now, &[1]);
        // The lease ended (released); a write sent under it may land for 3 s.
        st.sending.insert(0, now + Duration::from_secs(3));
        let deadline = now + Duration::from_secs(60);
        assert_eq!(
            decide(&mut st, &waiter(1, deadline), now).step,
            Step::Wait(now + Duration::from_secs(3)),
            "no grant while the write may land"
        );
        // The write answered: its entry goes, and the waiter is granted.
        st.sending.remove(&0);
        assert!(matches!(
            decide(&mut st, &waiter(1, deadline), now).step,
            Step::Granted(..)
        ));
    }

    #[test]
    fn a_write_abandoned_in_flight_holds_the_id_until_its_budget_is_spent() {
        let now = Instant::now();
        let mut st = claimed(now, &[1]);
        st.sending.insert(0, now + Duration::from_secs(3));
        let deadline = now + Duration::from_secs(60);
        let later = now + Duration::from_secs(3);
        assert!(matches!(
            decide(&mut st, &waiter(1, deadline), later).step,
            Step::Granted(..)
        ));
        assert!(st.sending.is_empty());
    }

    #[test]
    fn no_hand_over_while_a_write_may_land() {
        let now = Instant::now();
        let mut st = claimed(now, &[]);
        st.sending.insert(0, now + Duration::from_secs(1));
        assert!(!st.claim_can_go());
        assert!(!st.is_idle());
        st.sending.clear();
        assert!(st.claim_can_go());
    }

    #[test]
    fn a_waiter_out_of_time_behind_a_claim_attempt_waits_to_name_the_holder() {
        let now = Instant::now();
        let mut st = SlotState {
            claiming: true,
            queue: [0, 1].into(),
            ..SlotState::default()
        };
        // Wait 0: its deadline is now, but the lease is about to exist.
        let late = waiter(1, now);
        assert_eq!(
            decide(&mut st, &late, now).step,
            Step::Wait(now + Duration::from_secs(2))
        );
        // The attempt won and granted: the 409 names the holder.
        let mut st = claimed(now, &[0, 1]);
        let Step::Granted(lease, _) = decide(&mut st, &waiter(0, now), now).step else {
            panic!("the first is granted")
        };
        assert_eq!(decide(&mut st, &late, now).step, Step::GiveUp(Some(lease)));
    }

    #[test]
    fn past_the_grace_a_waiter_gives_up_without_a_holder_it_does_not_know() {
        let now = Instant::now();
        let mut st = SlotState {
            claiming: true,
            queue: [0, 1].into(),
            ..SlotState::default()
        };
        let after_grace = now + Duration::from_secs(2);
        assert_eq!(
            decide(&mut st, &waiter(1, now), after_grace).step,
            Step::GiveUp(None)
        );
    }

    #[test]
    fn a_contested_claim_is_handed_over_before_the_next_claim_attempt() {
        let now = Instant::now();
        let mut st = claimed(now, &[0]);
        st.claim.as_mut().unwrap().handover = true;
        let decision = decide(&mut st, &waiter(0, now + Duration::from_secs(5)), now);
        assert_eq!(decision.step, Step::Claim);
        assert_eq!(
            decision.withdraw.map(|c| c.claim_id),
            Some(Uuid::from_u128(1))
        );
        assert!(st.claim.is_none());
    }

    #[test]
    fn a_claim_short_of_validity_is_renewed_and_a_spent_block_refilled_first() {
        let now = Instant::now();
        let mut st = claimed(now, &[0]);
        st.claim.as_mut().unwrap().valid_until = now + Duration::from_secs(4);
        let deadline = now + Duration::from_secs(5);
        assert_eq!(
            decide(&mut st, &waiter(0, deadline), now).step,
            Step::RenewClaim(Uuid::from_u128(1))
        );
        let mut st = claimed(now, &[0]);
        st.tokens = TokenBlock { next: 10, last: 9 };
        assert_eq!(
            decide(&mut st, &waiter(0, deadline), now).step,
            Step::ReserveTokens {
                claim_id: Uuid::from_u128(1),
                first: 10
            }
        );
    }

    #[test]
    fn a_claim_that_lapses_ends_its_lease_and_the_next_waiter_claims_anew() {
        let now = Instant::now();
        let mut st = claimed(now, &[0, 1]);
        assert!(matches!(
            decide(&mut st, &waiter(0, now), now).step,
            Step::Granted(..)
        ));
        let lapsed = now + Duration::from_secs(9);
        let deadline = lapsed + Duration::from_secs(5);
        assert_eq!(
            decide(&mut st, &waiter(1, deadline), lapsed).step,
            Step::Wait(deadline)
        );
        st.queue.pop_front();
        assert_eq!(
            decide(&mut st, &waiter(1, deadline), lapsed).step,
            Step::Claim
        );
    }
}
