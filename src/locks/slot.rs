//! One state_id's lock state on this gateway, and the guards that keep it
//! right when an acquire is abandoned at an await point.
//!
//! The state sits behind a std `Mutex` that is never held across an
//! `.await`: every critical section is a few field updates, so an async mutex
//! would only add a second way to wait, and a guard's `Drop` can always take
//! the lock synchronously instead of hoping a `try_lock` succeeds.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use uuid::Uuid;

use crate::domain::{Lease, StateId};
use crate::metrics::{LockEvent, Metrics};
use crate::store::{Candidate, LeaseVersion};

#[derive(Default)]
pub(super) struct Slot {
    state: Mutex<SlotState>,
    /// Woken whenever a change may let a waiter in: a lease ends, a claim
    /// comes or goes, a waiter leaves the line.
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
    }

    pub fn is_idle(&self) -> bool {
        self.claim.is_none() && !self.claiming && self.lease.is_none() && self.queue.is_empty()
    }

    /// Grants a lease under the held claim: the next reserved token, the
    /// lease installed as current. None when the token block is spent.
    pub fn grant(
        &mut self,
        id: &StateId,
        owner: &str,
        ttl: Duration,
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
            owner: owner.to_owned(),
            fencing_token: token,
            gateway_id,
            acquired_ms: now_ms,
            expires_ms: now_ms.saturating_add(millis(ttl)),
        };
        let version = LeaseVersion::granted(token);
        self.lease = Some(LocalLease {
            lease: lease.clone(),
            version,
            deadline: now + ttl,
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
