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
use tokio::sync::futures::Notified;
use uuid::Uuid;

use crate::domain::{Lease, LeaseInfo, LeaseVersion, StateId};
use crate::metrics::{LockEvent, Metrics};
use crate::store::Candidate;

#[derive(Default)]
pub(super) struct Slot {
    state: Mutex<SlotState>,
    /// Woken whenever a change may let a waiter in: a lease ends, a claim
    /// comes or goes, a waiter leaves the line, a write lands. Only
    /// [`Slot::apply`] wakes it, as the transition it ran asks.
    changed: Notify,
}

impl Slot {
    pub fn lock(&self) -> MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The state as of `now`: what has run out by then (a lapsed claim, an
    /// expired lease, an ended lock-delay, writes that have surely landed)
    /// is dropped first, so that no decision is taken on it.
    pub fn current(
        &self,
        id: &StateId,
        now: Instant,
        metrics: &Metrics,
    ) -> MutexGuard<'_, SlotState> {
        let mut st = self.lock();
        st.expire(id, now, metrics);
        st
    }

    /// Runs `transition` under the lock, at one instant read here, then
    /// releases the lock and wakes the waiters if the transition asks: the
    /// one place they are woken, never with the lock held.
    pub fn apply<T>(&self, transition: impl FnOnce(&mut SlotState, Instant) -> Effects<T>) -> T {
        let now = Instant::now();
        let Effects { out, wake } = transition(&mut self.lock(), now);
        if wake {
            self.changed.notify_waiters();
        }
        out
    }

    /// A wake-up to wait for: enabled before the state is read, it is not
    /// missed when a change lands between the read and the wait.
    pub fn changed(&self) -> Notified<'_> {
        self.changed.notified()
    }
}

/// What a transition leaves for after the slot's lock is released: its
/// answer to the caller (rows to record, a claim to withdraw), and whether
/// waiters must be woken, which [`Slot::apply`] does.
#[must_use]
pub(super) struct Effects<T> {
    pub out: T,
    /// The change may let a waiter in.
    pub wake: bool,
}

impl<T> Effects<T> {
    /// A change no waiter needs to hear of.
    pub fn quiet(out: T) -> Self {
        Self { out, wake: false }
    }

    /// A change that may let a waiter in.
    pub fn waking(out: T) -> Self {
        Self { out, wake: true }
    }

    /// A change that wakes the waiters if `wake`.
    pub fn waking_if(wake: bool, out: T) -> Self {
        Self { out, wake }
    }
}

#[derive(Default)]
pub(super) struct SlotState {
    /// This gateway's claim on the state_id, without which it grants nothing.
    claim: Option<HeldClaim>,
    /// A waiter runs a claim attempt (settle included) outside the lock; no
    /// other waiter starts one meanwhile.
    claiming: bool,
    /// The current lease, granted under the claim.
    lease: Option<LocalLease>,
    /// Tickets of waiting acquires, first come first served.
    queue: VecDeque<u64>,
    /// The ticket the next waiter to join the line gets.
    next_ticket: u64,
    /// Fencing tokens reserved for this gateway's grants.
    tokens: TokenBlock,
    /// When a lease last began, was renewed or ended: idle claims go.
    last_used: Option<Instant>,
    /// Writes on their way to ClickHouse under the claim, by number, each
    /// with the instant by which it has surely ended (landed, failed or
    /// given up on). One sent just before its lease ended may still land,
    /// and the next holder must read it: no grant, and no hand-over of the
    /// claim, while any is here (see `locks::write`).
    sending: HashMap<u64, Instant>,
    /// The number the next write to go out gets.
    next_send: u64,
    /// A lease with a lock-delay ended by expiry or force-unlock: nothing is
    /// granted until the delay has passed, so the old holder's run is gone.
    delayed: Option<Delay>,
}

/// A lease released by its holder: its row to record, and the claim to
/// withdraw when another gateway waits for it and nothing holds it here.
pub(super) struct Released {
    pub lease: LocalLease,
    pub withdraw: Option<Candidate>,
}

/// The rows a won claim leaves to record: a running lease it adopted, and
/// the winner's own, when it was granted at once.
pub(super) struct Adopted {
    pub adopted: Option<(Lease, LeaseVersion)>,
    pub granted: Option<(Lease, LeaseVersion)>,
}

/// What a maintenance tick finds in a slot.
#[derive(Debug, PartialEq)]
pub(super) enum Tick {
    /// The claim went, idle or handed over: withdraw it.
    Gone(Uuid),
    /// The claim stays: renew it, and look out for a force-unlock of its
    /// lease through another gateway.
    Held(Uuid, Option<Lease>),
    /// No claim here.
    Unclaimed,
}

/// Where a write under the claim stands, as the slot sees it now.
#[derive(Debug, PartialEq)]
pub(super) enum Standing {
    /// It may go, and must be done by this instant: the claim's validity.
    Until(Instant),
    /// It carries no lease, and this one holds the id.
    Locked(Lease),
    /// Its lease, or the claim it was admitted under, has ended.
    Gone,
}

/// The end of a lock-delay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Delay {
    pub until: Instant,
    /// The same instant by the clock of `free_at` answers (ms since the epoch).
    pub free_at_ms: i64,
}

impl Delay {
    /// A delay that ends at `free_at_ms`, placed on the monotonic clock by
    /// `now` and `now_ms`, the same moment on both clocks.
    pub fn ending(free_at_ms: i64, now: Instant, now_ms: i64) -> Self {
        let left = u64::try_from(free_at_ms.saturating_sub(now_ms)).unwrap_or(0);
        Self {
            until: now + Duration::from_millis(left),
            free_at_ms,
        }
    }
}

pub(super) struct HeldClaim {
    pub candidate: Candidate,
    /// Past this instant the claim may have lapsed in ClickHouse: nothing
    /// granted under it counts any more.
    pub valid_until: Instant,
    /// Another gateway waits: hand the claim over when the current lease ends.
    pub handover: bool,
}

/// A claim attempt won: the claim, its first token block, and what the id's
/// lease row leaves to this authority.
pub(super) struct WonClaim {
    pub claim: HeldClaim,
    pub tokens: TokenBlock,
    /// What the id's lease row leaves to this authority.
    pub inherited: Inherited,
}

/// What a claim just won takes over from the id's lease row.
#[derive(Default)]
pub(super) struct Inherited {
    /// A lease handed on by a gateway that shut down, still running.
    pub lease: Option<LocalLease>,
    /// The rest of the lock-delay of a lease that ended under an earlier
    /// authority: it holds across a restart or crash of that authority.
    pub delay: Option<Delay>,
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
    /// The lock-delay its lease will carry.
    pub lock_delay: Duration,
    /// The info its lease will carry.
    pub info: LeaseInfo,
}

/// What a grant needs besides the state: the id, the waiter it goes to,
/// this gateway, and the moment on both clocks.
pub(super) struct Grant<'a> {
    pub id: &'a StateId,
    pub waiter: &'a Waiter<'a>,
    pub gateway_id: Uuid,
    pub now: Instant,
    pub now_ms: i64,
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
    /// Give up: the id is in a lock-delay that ends (ms since the epoch)
    /// after the waiter's wait.
    Delayed(i64),
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
        if let Some(expired) = self.lease.take_if(|l| now >= l.deadline) {
            self.delay_after(&expired, expired.deadline, expired.lease.expires_ms);
            metrics.lock_event(LockEvent::Expiry);
        }
        if self.delayed.is_some_and(|d| now >= d.until) {
            self.delayed = None;
        }
        self.sending.retain(|_, until| now < *until);
    }

    /// Ends the current lease by force (a force-unlock), at `now`: its
    /// lock-delay starts now.
    fn end_by_force(&mut self, now: Instant, now_ms: i64) -> Option<LocalLease> {
        let ended = self.lease.take()?;
        self.delay_after(&ended, now, now_ms);
        Some(ended)
    }

    /// Starts `ended`'s lock-delay, if it has one, from `at` (`at_ms`).
    fn delay_after(&mut self, ended: &LocalLease, at: Instant, at_ms: i64) {
        if !ended.lease.lock_delay.is_zero() {
            self.delayed = Some(Delay::ending(ended.lease.free_at_ms(at_ms), at, at_ms));
        }
    }

    /// Takes on a lock-delay that began under an earlier authority of the
    /// id; of two, the later end holds.
    fn inherit_delay(&mut self, delay: Delay) {
        if self.delayed.is_none_or(|d| d.until < delay.until) {
            self.delayed = Some(delay);
        }
    }

    /// The claim turned out to be another gateway's (a renewal or a token
    /// reservation refused): it ends here, and its lease with it.
    fn lose_claim(&mut self, id: &StateId, metrics: &Metrics) {
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
            && self.delayed.is_none()
    }

    /// Until when writes sent earlier may still land, if any may.
    pub fn landing_until(&self) -> Option<Instant> {
        self.sending.values().max().copied()
    }

    /// Whether the claim may go (idle, or handed over): no lease runs under
    /// it and no write sent under it may still land.
    fn claim_can_go(&self) -> bool {
        // Held through a lock-delay too: another gateway would not know of it.
        self.lease.is_none() && self.sending.is_empty() && self.delayed.is_none()
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
        if let Some(delay) = self.delayed {
            // No lease exists during a lock-delay, and none is granted: a
            // waiter that cannot wait it out is told when it ends.
            let step = if waiter.deadline < delay.until {
                Step::Delayed(delay.free_at_ms)
            } else {
                Step::Wait(delay.until)
            };
            return Decision {
                step,
                withdraw: None,
            };
        }
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
    fn grant(
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
            lock_delay: waiter.lock_delay,
            info: waiter.info.clone(),
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
        let ticket = slot.apply(|st, _| st.join());
        Self { slot, ticket }
    }
}

impl Drop for InLine {
    fn drop(&mut self) {
        self.slot.apply(|st, _| st.leave(self.ticket));
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
        self.0.apply(|st, _| st.end_claim_attempt());
    }
}

/// Reaches into the state, for tests of the modules that use a slot: they
/// start from a claim and a lease as they stand, or end them abruptly.
#[cfg(test)]
impl SlotState {
    pub fn claim_for_tests(&mut self) -> &mut Option<HeldClaim> {
        &mut self.claim
    }

    pub fn lease_for_tests(&mut self) -> &mut Option<LocalLease> {
        &mut self.lease
    }

    /// How many writes are on their way under the claim.
    pub fn sending_for_tests(&self) -> usize {
        self.sending.len()
    }
}

mod transitions;

#[cfg(test)]
mod tests;
