//! One id's lock state on this gateway: a state_id's one lease, or a pool's
//! leases up to its limit of slots, with the line of waiters for them
//! (highest priority first, first come first served within a priority), the
//! claim they are granted under and the fencing tokens they take; the pure
//! decision of what a waiter does next; and the guards that keep the state
//! right when an acquire is abandoned at an await point.
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
    /// [`Slot::apply_recording`] wakes it, as the transition it ran asks.
    changed: Notify,
}

impl Slot {
    fn guard(&self) -> MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the state as it stands: no change, no wake-up.
    pub fn read<T>(&self, read: impl FnOnce(&SlotState) -> T) -> T {
        read(&self.guard())
    }

    /// Reads the state as of now (see [`Slot::apply_current`]).
    pub fn current<T>(
        &self,
        id: &StateId,
        metrics: &Metrics,
        read: impl FnOnce(&SlotState) -> T,
    ) -> T {
        self.apply_current(id, metrics, |st, _| Effects::quiet(read(st)))
    }

    /// [`Slot::apply`] on the state as of now: what has run out by then (a
    /// lapsed claim, an expired lease, an ended lock-delay, writes that have
    /// surely landed) is dropped first, so that no decision is taken on it.
    pub fn apply_current<T>(
        &self,
        id: &StateId,
        metrics: &Metrics,
        transition: impl FnOnce(&mut SlotState, Instant) -> Effects<T>,
    ) -> T {
        self.apply(|st, now| {
            st.expire(id, now, metrics);
            transition(st, now)
        })
    }

    /// Runs `transition` under the lock, at one instant read here, then
    /// releases the lock and wakes the waiters if the transition asks: the
    /// one place they are woken, never with the lock held.
    pub fn apply<T>(&self, transition: impl FnOnce(&mut SlotState, Instant) -> Effects<T>) -> T {
        self.apply_recording(transition, |_| {})
    }

    /// [`Slot::apply_current`] that queues the rows of the leases the
    /// transition ended (`record`) before any waiter wakes: a woken waiter
    /// may hand the claim over, which writes the rows queued so far first,
    /// and the next authority must read how those leases ended, or it keeps
    /// their places until they would have expired.
    pub fn apply_current_recording<T>(
        &self,
        id: &StateId,
        metrics: &Metrics,
        transition: impl FnOnce(&mut SlotState, Instant) -> Effects<T>,
        record: impl FnOnce(&T),
    ) -> T {
        self.apply_recording(
            |st, now| {
                st.expire(id, now, metrics);
                transition(st, now)
            },
            record,
        )
    }

    /// [`Slot::apply`], with `record` run on the answer after the lock is
    /// released and before the waiters are woken.
    pub fn apply_recording<T>(
        &self,
        transition: impl FnOnce(&mut SlotState, Instant) -> Effects<T>,
        record: impl FnOnce(&T),
    ) -> T {
        let now = Instant::now();
        let Effects { out, wake } = transition(&mut self.guard(), now);
        record(&out);
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
    /// This gateway's claim on the id, without which it grants nothing.
    claim: Option<HeldClaim>,
    /// The claim that lapsed here while leases ran under it (Keeper or
    /// ClickHouse out of reach past the claim TTL). Its leases stay in
    /// `leases` but act on nothing: renewals and writes answer 503, and no
    /// lease is granted. A claim attempt that re-wins the claim with nothing
    /// in between adopts them again; one that finds another gateway's claim
    /// ends them (see [`Lapsed`]).
    lapsed: Option<Candidate>,
    /// A waiter runs a claim attempt (settle included) outside the lock; no
    /// other waiter starts one meanwhile.
    claiming: bool,
    /// The leases granted under the claim, oldest first: one at most on a
    /// state_id, on a pool as many as their slots fit in `limit`.
    leases: Vec<LocalLease>,
    /// How many slots may be held at once: 1 on a state_id, a pool's limit.
    /// The first waiter of a slot nobody holds or waits on sets it; while
    /// anyone does, a waiter asking for another is refused.
    limit: usize,
    /// The waiting acquires in the order they are granted: highest priority
    /// first, by ticket (arrival) within a priority. Only the first may be
    /// granted, so no later waiter passes it, even one that would fit.
    queue: VecDeque<Queued>,
    /// The ticket the next waiter to join the line gets.
    next_ticket: u64,
    /// Fencing tokens reserved for this gateway's grants.
    tokens: TokenBlock,
    /// When a lease last began, was renewed or ended, or a write went out
    /// under the claim: idle claims go.
    last_used: Option<Instant>,
    /// Writes on their way to ClickHouse under the claim, by number, each
    /// with the instant by which it has surely ended (landed, failed or
    /// given up on). One sent just before its lease ended may still land,
    /// and the next holder must read it: no grant, and no hand-over of the
    /// claim, while any is here (see `locks::write`).
    sending: HashMap<u64, Instant>,
    /// The number the next write to go out gets.
    next_send: u64,
    /// Leases with a lock-delay that ended by expiry or force-unlock, here or
    /// under an earlier authority: each keeps its place until it ends, so
    /// that the old holder's run is gone before another takes the place.
    delayed: Vec<Delay>,
    /// Leases an earlier authority granted that ran when it lost the claim
    /// (it crashed, froze, or its renewals did not land): their holders may
    /// run on unaware, so each keeps its place until it would have expired,
    /// then its lock-delay. Nothing renews them or writes under them here,
    /// but they hold the id: a refused acquire names them.
    orphaned: Vec<LocalLease>,
}

/// A lease released by its holder: its row to record, and the claim to
/// withdraw when another gateway waits for it and nothing holds it here.
pub(super) struct Released {
    pub lease: LocalLease,
    pub withdraw: Option<Candidate>,
}

/// The rows a won claim leaves to record: the running leases it adopted,
/// and the winner's own, when it was granted at once.
pub(super) struct Adopted {
    pub adopted: Vec<(Lease, LeaseVersion)>,
    pub granted: Option<(Lease, LeaseVersion)>,
}

/// What a maintenance tick finds in a slot.
#[derive(Debug, PartialEq)]
pub(super) enum Tick {
    /// The claim went, idle or handed over: withdraw it.
    Gone(Uuid),
    /// The claim stays: renew it, and look out for a force-unlock of its
    /// leases through another gateway.
    Held(Uuid, Vec<Lease>),
    /// The claim lapsed with leases kept: try to re-win it. The attempt is
    /// marked under way (see [`ClaimAttempt`]).
    Lapsed(Lapsed),
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
    /// The claim it was admitted under lapsed and is not re-won yet: it is
    /// not sent, and may be tried again.
    Lapsed,
}

/// What a lease operation (a renewal, a release) found.
#[derive(Debug, PartialEq)]
pub(super) enum LeaseAct<T> {
    /// Done, answering this.
    Done(T),
    /// The lease is kept under a lapsed claim: nothing was done.
    Lapsed,
    /// It is no lease of this gateway's.
    Unknown,
}

/// A lapsed claim of this gateway's and the leases kept under it: what a
/// claim attempt tries to re-win, so that they run on.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Lapsed {
    pub claim: Candidate,
    /// The kept leases: their rows are this gateway's own grants, not an
    /// earlier authority's to inherit.
    pub leases: Vec<Uuid>,
}

/// The end of a lock-delay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Delay {
    pub until: Instant,
    /// The same instant by the clock of `free_at` answers (ms since the epoch).
    pub free_at_ms: i64,
    /// The slots it keeps: its lease's.
    pub slots: usize,
}

impl Delay {
    /// A delay of `slots` that ends at `free_at_ms`, placed on the monotonic
    /// clock by `now` and `now_ms`, the same moment on both clocks.
    pub fn ending(free_at_ms: i64, slots: usize, now: Instant, now_ms: i64) -> Self {
        let left = u64::try_from(free_at_ms.saturating_sub(now_ms)).unwrap_or(0);
        Self {
            until: now + Duration::from_millis(left),
            free_at_ms,
            slots,
        }
    }
}

/// What an acquire asks of a slot as it joins the line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Asking {
    /// The slot's limit as the acquire knows it.
    pub limit: usize,
    /// How many of the limit its lease will occupy.
    pub slots: usize,
    /// Its place in line: higher goes first.
    pub priority: i32,
}

/// A waiter in line, as the line orders it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Queued {
    pub ticket: u64,
    pub priority: i32,
    pub slots: usize,
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
    /// The claim re-won is the lapsed one the attempt was given, and
    /// nothing shows another claim or grant since: its kept leases run on.
    pub readopted: bool,
}

/// What a claim just won takes over from the id's lease rows.
#[derive(Default)]
pub(super) struct Inherited {
    /// Leases handed on by a gateway that shut down, still running.
    pub leases: Vec<LocalLease>,
    /// Leases of an earlier authority that lost its claim while they ran
    /// (see `SlotState::orphaned`).
    pub orphaned: Vec<LocalLease>,
    /// The rest of the lock-delays of an earlier authority's ended leases,
    /// which hold across a restart or crash of that authority.
    pub delays: Vec<Delay>,
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
    /// How many slots its lease will occupy.
    pub slots: usize,
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
    /// Run a claim attempt, re-winning this lapsed claim if one is given.
    Claim(Option<Lapsed>),
    /// Give up: the wait ran out. With the holder this gateway knows of.
    GiveUp(Option<Lease>),
    /// Give up: the id is in a lock-delay that ends (ms since the epoch)
    /// after the waiter's wait, and no lease holds it.
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

    /// Joins `slot`'s line as `asking` says; a slot in use with another
    /// limit refuses, answering its own.
    pub fn join(slot: Arc<Slot>, asking: Asking) -> Result<Self, usize> {
        let ticket = slot.apply(|st, _| st.join(asking))?;
        Ok(Self { slot, ticket })
    }
}

impl Drop for InLine {
    fn drop(&mut self) {
        self.slot.apply(|st, _| st.leave(self.ticket));
    }
}

/// A claim attempt under way, marked so by the decision that started it
/// (`SlotState::next_step`); clears the mark however the attempt ends, so an
/// abandoned one never blocks the waiters behind it.
pub(super) struct ClaimAttempt<'a>(Option<&'a Slot>);

impl<'a> ClaimAttempt<'a> {
    /// Taken at once after the decision, with no await in between.
    pub fn under_way(slot: &'a Slot) -> Self {
        Self(Some(slot))
    }

    /// The attempt was ended by the transition that took its won claim on
    /// ([`SlotState::claim_won`]): there is no mark left to clear, and one
    /// cleared now might be a later attempt's.
    pub fn ended(mut self) {
        self.0 = None;
    }
}

impl Drop for ClaimAttempt<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.0 {
            slot.apply(|st, _| st.end_claim_attempt());
        }
    }
}

/// Reaches into the state, for tests of the modules that use a slot: they
/// start from a claim and a lease as they stand, or end them abruptly.
#[cfg(test)]
impl Slot {
    pub fn lock(&self) -> MutexGuard<'_, SlotState> {
        self.guard()
    }
}

#[cfg(test)]
impl SlotState {
    pub fn claim_for_tests(&mut self) -> &mut Option<HeldClaim> {
        &mut self.claim
    }

    pub fn leases_for_tests(&mut self) -> &mut Vec<LocalLease> {
        &mut self.leases
    }

    /// How many writes are on their way under the claim.
    pub fn sending_for_tests(&self) -> usize {
        self.sending.len()
    }
}

mod decide;
mod transitions;

#[cfg(test)]
mod fixtures;
#[cfg(test)]
mod lapse_tests;
#[cfg(test)]
mod orphan_tests;
#[cfg(test)]
mod pool_tests;
#[cfg(test)]
mod schedule_tests;
#[cfg(test)]
mod tests;
