//! What has run out by now, how many places a slot has free, and what a
//! waiter does next: pure functions of the state and the time, so that
//! every acquire, on a state_id or a pool, is decided by the same rules.

use super::*;

impl SlotState {
    /// Drops what has run out by now: a lapsed claim (its leases are kept,
    /// acting on nothing, until a claim attempt re-wins it or finds another
    /// gateway's), expired leases, an earlier authority's included (their
    /// lock-delays begin), ended delays, writes that have surely landed.
    /// Nobody is woken for it: every waiter already sleeps no later than the
    /// first of these ends (see `next_step`).
    pub fn expire(&mut self, id: &StateId, now: Instant, metrics: &Metrics) {
        if self.claim.as_ref().is_some_and(|c| now >= c.valid_until) {
            self.lapse_claim(id, metrics);
        }
        let (expired, running): (Vec<_>, Vec<_>) =
            self.leases.drain(..).partition(|l| now >= l.deadline);
        self.leases = running;
        for lease in expired {
            self.delay_after(&lease, lease.deadline, lease.lease.expires_ms);
            metrics.lock_event(LockEvent::Expiry);
        }
        if self.leases.is_empty() {
            self.lapsed = None;
        }
        // Counted as expiries by the authority that granted them, if at all.
        let (expired, running): (Vec<_>, Vec<_>) =
            self.orphaned.drain(..).partition(|l| now >= l.deadline);
        self.orphaned = running;
        for lease in expired {
            self.delay_after(&lease, lease.deadline, lease.lease.expires_ms);
        }
        self.delayed.retain(|d| now < d.until);
        self.sending.retain(|_, until| now < *until);
    }

    /// Ends every lease holding the id by force (a force-unlock), at `now`:
    /// the current ones and an earlier authority's; their lock-delays start now.
    pub(super) fn end_all_by_force(&mut self, now: Instant, now_ms: i64) -> Vec<LocalLease> {
        let ended: Vec<LocalLease> = self
            .leases
            .drain(..)
            .chain(self.orphaned.drain(..))
            .collect();
        for lease in &ended {
            self.delay_after(lease, now, now_ms);
        }
        ended
    }

    /// Ends `lease_id` by force, if it is current: its lock-delay starts now.
    pub(super) fn end_by_force(
        &mut self,
        lease_id: Uuid,
        now: Instant,
        now_ms: i64,
    ) -> Option<LocalLease> {
        let at = self
            .leases
            .iter()
            .position(|l| l.lease.lease_id == lease_id)?;
        let ended = self.leases.remove(at);
        self.delay_after(&ended, now, now_ms);
        Some(ended)
    }

    /// Starts `ended`'s lock-delay, if it has one, from `at` (`at_ms`).
    fn delay_after(&mut self, ended: &LocalLease, at: Instant, at_ms: i64) {
        if !ended.lease.lock_delay.is_zero() {
            let free_at_ms = ended.lease.free_at_ms(at_ms);
            self.delayed
                .push(Delay::ending(free_at_ms, ended.lease.slots, at, at_ms));
        }
    }

    /// The claim may have run out in ClickHouse or Keeper: it is past its
    /// validity, or a renewal found it gone. Nothing is granted, renewed or
    /// written under it any more; its leases are kept, acting on nothing,
    /// until a claim attempt re-wins it with nothing in between (they run
    /// on) or finds another gateway's claim or grant (they end).
    pub(super) fn lapse_claim(&mut self, id: &StateId, metrics: &Metrics) {
        let Some(claim) = self.claim.take() else {
            return;
        };
        metrics.lock_event(LockEvent::ClaimLost);
        if !self.leases.is_empty() {
            tracing::warn!(state_id = %id, "claim lapsed: its renewals did not land in time; its leases are kept, answering 503, until the claim is re-won or found taken");
            self.lapsed = Some(claim.candidate);
        }
    }

    pub fn is_idle(&self) -> bool {
        self.claim.is_none()
            && self.lapsed.is_none()
            && !self.claiming
            && self.leases.is_empty()
            && self.queue.is_empty()
            && self.sending.is_empty()
            && self.delayed.is_empty()
            && self.orphaned.is_empty()
    }

    /// Until when writes sent earlier may still land, if any may.
    pub fn landing_until(&self) -> Option<Instant> {
        self.sending.values().max().copied()
    }

    /// Whether the claim may go (idle, or handed over): no lease runs under
    /// it, no place is kept, and no write sent under it may still land.
    pub(super) fn claim_can_go(&self) -> bool {
        // Held through a lock-delay too: another gateway would not know of it.
        self.leases.is_empty()
            && self.sending.is_empty()
            && self.delayed.is_empty()
            && self.orphaned.is_empty()
    }

    /// The slots kept besides the current leases: ended leases' lock-delays,
    /// and an earlier authority's leases.
    fn kept(&self) -> usize {
        let orphaned: usize = self.orphaned.iter().map(|l| l.lease.slots).sum();
        orphaned + self.delayed.iter().map(|d| d.slots).sum::<usize>()
    }

    /// Whether a lease holds the id: one granted here, or an earlier
    /// authority's that keeps its place.
    fn held(&self) -> bool {
        !self.leases.is_empty() || !self.orphaned.is_empty()
    }

    /// The holder a refused acquire is told of: the current lease, else the
    /// earlier authority's lease that ends first.
    pub fn holder(&self) -> Option<&Lease> {
        self.lease().or_else(|| {
            self.orphaned
                .iter()
                .min_by_key(|l| l.deadline)
                .map(|l| &l.lease)
        })
    }

    /// The leases an earlier authority granted that keep their places here,
    /// as their rows were read: they hold the id, though not as current
    /// leases of this gateway's (nothing renews them or writes under them).
    pub fn orphaned(&self) -> Vec<Lease> {
        self.orphaned.iter().map(|l| l.lease.clone()).collect()
    }

    /// Whether `slots` more fit beside the leases and the kept places.
    pub(super) fn fits(&self, slots: usize) -> bool {
        self.used() + self.kept() + slots <= self.limit()
    }

    /// Whether `ticket` is first in line: the only waiter that may be granted.
    pub(super) fn is_first(&self, ticket: u64) -> bool {
        self.queue.front().is_some_and(|q| q.ticket == ticket)
    }

    /// With no lease holding the id and delays keeping too many places for
    /// the first in line (`slots` when the line is empty): the delay whose
    /// end frees enough of them.
    fn delay_to_wait_out(&self, slots: usize) -> Option<Delay> {
        let slots = self.queue.front().map_or(slots, |q| q.slots);
        if self.held() || self.fits(slots) {
            return None;
        }
        let mut ends = self.delayed.clone();
        ends.sort_by_key(|d| d.until);
        // Places free as delays end: the first end that leaves room is the
        // one to wait for (slots <= limit, so the last end always does).
        let mut kept = self.kept();
        ends.into_iter().find(|d| {
            kept -= d.slots;
            kept + slots <= self.limit()
        })
    }

    /// Decides what `waiter` does next on `id`, from this state and the time
    /// alone. The caller has called [`SlotState::expire`] with the same
    /// `now`. A claim attempt it decides on is marked under way here.
    pub fn next_step(
        &mut self,
        id: &StateId,
        waiter: &Waiter<'_>,
        rules: &Rules,
        now: Instant,
        now_ms: i64,
    ) -> Effects<Decision> {
        if let Some(delay) = self.delay_to_wait_out(waiter.slots) {
            // No lease exists during a lock-delay, and none is granted: a
            // waiter that cannot wait it out is told when it ends.
            let step = if waiter.deadline < delay.until {
                Step::Delayed(delay.free_at_ms)
            } else {
                Step::Wait(delay.until)
            };
            return Effects::quiet(Decision {
                step,
                withdraw: None,
            });
        }
        let mut withdraw = None;
        let first = self.is_first(waiter.ticket);
        let turn = first && self.fits(waiter.slots) && !self.claiming && self.sending.is_empty();
        if turn {
            if self.leases.is_empty() && self.claim.as_ref().is_some_and(|c| c.handover) {
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
                None => {
                    self.claiming = true;
                    Some(Step::Claim(self.lapsed_claim()))
                }
            };
            if let Some(step) = step {
                return Effects::quiet(Decision { step, withdraw });
            }
        }
        let landing = self.landing_until();
        let step = if now >= waiter.deadline
            && (waiter.attempted_claim || self.claim.is_some() || !turn)
        {
            // A lease about to exist (a claim attempt, a grant or the end of
            // a write under way ahead of this waiter) is worth a short wait,
            // so that the 409 names its holder.
            let coming = !self.held()
                && !waiter.attempted_claim
                && (self.claiming || landing.is_some() || !first);
            let grace_ends = waiter.deadline + rules.holder_grace;
            if coming && now < grace_ends {
                Step::Wait(landing.map_or(grace_ends, |t| t.min(grace_ends)))
            } else {
                Step::GiveUp(self.holder().cloned())
            }
        } else {
            // Asleep no later than the first lease or kept place to end, so
            // that an expiry needs no wake-up.
            let until = self
                .leases
                .iter()
                .chain(&self.orphaned)
                .map(|l| l.deadline)
                .chain(self.delayed.iter().map(|d| d.until))
                .fold(waiter.deadline, Instant::min);
            Step::Wait(landing.map_or(until, |t| t.min(until)))
        };
        Effects::quiet(Decision { step, withdraw })
    }

    /// Grants a lease under the held claim: the next reserved token, the
    /// lease added to the current ones. None when the token block is spent.
    pub(super) fn grant(
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
            limit: self.limit(),
            slots: waiter.slots,
        };
        let version = LeaseVersion::granted(token);
        self.leases.push(LocalLease {
            lease: lease.clone(),
            version,
            deadline: now + waiter.ttl,
        });
        self.last_used = Some(now);
        Some((lease, version))
    }
}
