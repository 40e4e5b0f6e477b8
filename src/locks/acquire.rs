//! Acquiring a lease: the I/O half of the slot's pure decisions. An
//! acquirer asks its slot what to do next (`SlotState::next_step`), does it
//! (a claim attempt, a renewal, a token reservation, a wait) with no slot
//! lock held, applies the outcome, and asks again, until it is granted or
//! gives up. Every await is a place where the acquire may be dropped (its
//! client hung up): the guards in `slot` and `claim` leave the line and
//! withdraw what it proposed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::claim::{ClaimOutcome, Coordinator};
use super::error::LockError;
use super::record::{Recorder, withdraw_after_rows};
use super::slot::{
    Adopted, Asking, ClaimAttempt, Grant, InLine, Released, Rules, Slot, Step, Waiter,
};
use super::slots::Slots;
use crate::config::LockSettings;
use crate::domain::{Lease, LeaseInfo, StateId};
use crate::metrics::LockEvent;
use crate::store::now_ms;

/// How often a 409 looks again for a holder that another gateway granted a
/// moment ago (see [`Acquirer::held_elsewhere`]).
const HOLDER_POLL: Duration = Duration::from_millis(25);

/// What an acquire asks for.
pub struct Ask {
    /// Who takes the lease.
    pub owner: String,
    /// How many slots the id has: 1 on a state_id, a pool's limit.
    pub limit: usize,
    /// How many of them the lease occupies (1..=limit).
    pub slots: usize,
    /// Its place in line: waiters of a higher priority are granted first,
    /// those of one priority in arrival order.
    pub priority: i32,
    pub ttl: Duration,
    /// How long to wait behind earlier waiters.
    pub wait: Duration,
    /// Cut to `--max-lock-delay` by the lock handle.
    pub lock_delay: Duration,
    pub info: LeaseInfo,
}

/// A grant not yet answered: dropped unanswered, its lease is taken back
/// and recorded as released, so that no place stays held for a holder that
/// never heard of it.
struct Unanswered<'a> {
    slot: &'a Slot,
    recorder: &'a Recorder,
    lease_id: Uuid,
    answered: bool,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        self.slot.apply_recording(
            |st, now| st.release(self.lease_id, now),
            |taken| {
                if let Some(Released { lease, .. }) = taken {
                    self.recorder.released(lease.lease.clone(), lease.version);
                }
            },
        );
    }
}

/// One acquire, with the parts of the lock core it uses.
pub(super) struct Acquirer<'a> {
    pub slots: &'a Slots,
    pub coordinator: &'a Arc<Coordinator>,
    pub recorder: &'a Arc<Recorder>,
    pub settings: &'a LockSettings,
}

impl Acquirer<'_> {
    /// Grants a lease on `id` as `ask` says, one of `ask.limit` at a time,
    /// waiting up to `ask.wait` behind earlier waiters; a first acquire still
    /// runs one claim attempt (settle included) even with no wait at all.
    pub async fn acquire(self, id: &StateId, ask: Ask) -> Result<Lease, LockError> {
        let deadline = Instant::now() + ask.wait;
        let asking = Asking {
            limit: ask.limit,
            slots: ask.slots,
            priority: ask.priority,
        };
        let in_line = InLine::join(self.slots.get_or_make(id), asking).map_err(|held| {
            LockError::LimitMismatch {
                state_id: id.clone(),
                limit: held,
            }
        })?;
        let waiter = Waiter {
            ticket: in_line.ticket,
            slots: ask.slots,
            owner: &ask.owner,
            ttl: ask.ttl,
            deadline,
            attempted_claim: false,
            lock_delay: ask.lock_delay,
            info: ask.info,
        };
        let result = match self.wait_for_grant(id, &in_line, waiter).await {
            Ok(lease) => self.answer(in_line.slot(), lease).await,
            Err(err) => Err(err),
        };
        match &result {
            Ok(_) => self.slots.metrics().lock_event(LockEvent::Grant),
            Err(LockError::Held { .. }) => self.slots.metrics().lock_event(LockEvent::Timeout),
            Err(_) => {}
        }
        result
    }

    /// Answers a grant once its row has landed where rows must land first
    /// (a pool's: its holders are known to a next authority only by their
    /// rows). A grant whose row failed, or whose acquire is dropped while
    /// the row is on its way (its client hung up), is taken back.
    async fn answer(&self, slot: &Slot, lease: Lease) -> Result<Lease, LockError> {
        let mut unanswered = Unanswered {
            slot,
            recorder: self.recorder,
            lease_id: lease.lease_id,
            answered: false,
        };
        self.recorder.landed().await?;
        unanswered.answered = true;
        Ok(lease)
    }

    async fn wait_for_grant(
        &self,
        id: &StateId,
        in_line: &InLine,
        mut waiter: Waiter<'_>,
    ) -> Result<Lease, LockError> {
        let slot = in_line.slot();
        let rules = self.rules();
        let deadline = waiter.deadline;
        let mut counted_wait = false;
        loop {
            let notified = slot.changed();
            tokio::pin!(notified);
            notified.as_mut().enable();

            let metrics = self.slots.metrics();
            let decision = slot.apply_current(id, metrics, |st, now| {
                st.next_step(id, &waiter, &rules, now, now_ms())
            });
            let mut attempt =
                matches!(decision.step, Step::Claim(_)).then(|| ClaimAttempt::under_way(slot));
            if let Some(candidate) = decision.withdraw {
                withdraw_after_rows(self.recorder, self.coordinator, id.clone(), candidate);
            }
            match decision.step {
                Step::Granted(lease, version) => {
                    self.recorder.held(&lease, version);
                    return Ok(lease);
                }
                Step::RenewClaim(claim_id) => {
                    let started = Instant::now();
                    let lost = self
                        .coordinator
                        .renew_claims(&[(id.clone(), claim_id)])
                        .await?;
                    let metrics = self.slots.metrics();
                    if lost.contains(&claim_id) {
                        slot.apply(|st, _| st.claim_refused(id, claim_id, metrics));
                    } else {
                        let valid_until = self.coordinator.timing().valid_until(started);
                        slot.apply(|st, now| st.claim_renewed(claim_id, valid_until, now));
                    }
                }
                Step::ReserveTokens { claim_id, first } => {
                    let block = self.coordinator.reserve_tokens(id, claim_id, first).await?;
                    let metrics = self.slots.metrics();
                    slot.apply(|st, _| match block {
                        Some(block) => st.add_tokens(claim_id, block),
                        None => st.claim_refused(id, claim_id, metrics),
                    });
                }
                Step::Claim(lapsed) => {
                    let outcome = self
                        .coordinator
                        .try_claim(id, deadline, lapsed.as_ref())
                        .await;
                    waiter.attempted_claim = true;
                    if let (Some(lapsed), Ok(ClaimOutcome::Elsewhere(_) | ClaimOutcome::Lost)) =
                        (&lapsed, &outcome)
                    {
                        slot.apply(|st, _| st.lapse_refused(lapsed.claim.claim_id));
                    }
                    if !matches!(outcome, Ok(ClaimOutcome::Won(_))) {
                        // Cleared before anything else waits; a won claim
                        // ends the attempt as it is taken on (`claim_won`).
                        attempt = None;
                    }
                    match outcome? {
                        ClaimOutcome::Won(won) => {
                            let write_budget = self.coordinator.timing().write_budget();
                            let Adopted { adopted, granted } = slot.apply(|st, now| {
                                let grant = Grant {
                                    id,
                                    waiter: &waiter,
                                    gateway_id: self.settings.gateway_id,
                                    now,
                                    now_ms: now_ms(),
                                };
                                st.claim_won(*won, grant, write_budget)
                            });
                            if let Some(attempt) = attempt.take() {
                                attempt.ended();
                            }
                            for (lease, version) in adopted {
                                self.recorder.held(&lease, version);
                            }
                            if let Some((lease, version)) = granted {
                                self.recorder.held(&lease, version);
                                return Ok(lease);
                            }
                        }
                        ClaimOutcome::Elsewhere(peer) => return Err(LockError::Elsewhere(peer)),
                        ClaimOutcome::Lost if Instant::now() >= deadline => {
                            return Err(self.held_elsewhere(id).await);
                        }
                        ClaimOutcome::Unsettled if Instant::now() >= deadline => {
                            return Err(self.unsettled(id).await);
                        }
                        // Our candidate lapsed in line: stand in line again.
                        ClaimOutcome::Lost | ClaimOutcome::Unsettled => {}
                    }
                }
                Step::GiveUp(Some(holder)) => {
                    return Err(LockError::Held {
                        state_id: id.clone(),
                        holder: Some(Box::new(holder)),
                    });
                }
                // A claim attempt ahead of this waiter is still in line at
                // ClickHouse: the holder is whoever ClickHouse records.
                Step::GiveUp(None) => return Err(self.held_elsewhere(id).await),
                Step::Delayed(free_at_ms) => {
                    return Err(LockError::Delayed {
                        state_id: id.clone(),
                        free_at_ms,
                    });
                }
                Step::Wait(wake_at) => {
                    if !counted_wait {
                        counted_wait = true;
                        self.slots.metrics().lock_event(LockEvent::Wait);
                    }
                    tokio::select! {
                        () = &mut notified => {}
                        () = tokio::time::sleep_until(wake_at.into()) => {}
                    }
                }
            }
        }
    }

    fn rules(&self) -> Rules {
        Rules {
            gateway_id: self.settings.gateway_id,
            grant_margin: self.coordinator.timing().grant_margin(),
            // A claim attempt takes the settle and a few round trips; a write
            // under way, one.
            holder_grace: self.coordinator.timing().holder_grace(),
        }
    }

    /// The answer to an acquire whose last claim attempt did not settle by
    /// its deadline (its own candidate ran out first, or one of this
    /// gateway's was ahead): unless ClickHouse records a holder (409 naming
    /// it), nobody is known to hold the id, and the answer is 503, not a 409
    /// naming no one.
    async fn unsettled(&self, id: &StateId) -> LockError {
        match self.coordinator.recorded_lease(id, None).await {
            Ok(Some(holder)) => LockError::Held {
                state_id: id.clone(),
                holder: Some(Box::new(holder)),
            },
            Ok(None) => LockError::Unsettled(id.clone()),
            Err(err) => err.into(),
        }
    }

    /// The 409 for an id that another gateway holds the claim on. Its lease
    /// row is written behind its grant, so a lease granted a moment ago may
    /// not be recorded yet: the record is read again for a while (a gateway
    /// that just won a claim grants at once).
    async fn held_elsewhere(&self, id: &StateId) -> LockError {
        let started = Instant::now();
        loop {
            match self.coordinator.recorded_lease(id, None).await {
                Ok(Some(holder)) => {
                    return LockError::Held {
                        state_id: id.clone(),
                        holder: Some(Box::new(holder)),
                    };
                }
                Ok(None) if started.elapsed() < self.coordinator.timing().holder_wait() => {
                    tokio::time::sleep(HOLDER_POLL).await;
                }
                Ok(None) => {
                    return LockError::Held {
                        state_id: id.clone(),
                        holder: None,
                    };
                }
                Err(err) => return err.into(),
            }
        }
    }
}
