//! The transitions a request or the background task makes on a slot, one
//! method each. A transition changes the state and answers, as [`Effects`],
//! what is left for after the lock is released: rows to record, a claim to
//! withdraw, waiters to wake. None does I/O, so each is tested alone.

use super::*;

impl SlotState {
    /// Joins the line of a slot of `asking.limit` places: answers the new
    /// waiter's ticket. A slot nobody holds or waits on takes the limit; one
    /// in use refuses another, answering its own. The waiter goes behind
    /// every waiter of its priority or higher, ahead of the lower ones.
    pub fn join(&mut self, asking: Asking) -> Effects<Result<u64, usize>> {
        if self.leases.is_empty() && self.queue.is_empty() {
            self.limit = asking.limit;
        } else if self.limit() != asking.limit {
            return Effects::quiet(Err(self.limit()));
        }
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let queued = Queued {
            ticket,
            priority: asking.priority,
            slots: asking.slots,
        };
        let at = self
            .queue
            .iter()
            .position(|q| q.priority < asking.priority)
            .unwrap_or(self.queue.len());
        self.queue.insert(at, queued);
        Effects::quiet(Ok(ticket))
    }

    /// Leaves the line, granted or not: the next in line may now go first.
    pub fn leave(&mut self, ticket: u64) -> Effects<()> {
        self.queue.retain(|q| q.ticket != ticket);
        Effects::waking(())
    }

    /// A claim attempt has ended, however: the next one may start.
    pub fn end_claim_attempt(&mut self) -> Effects<()> {
        self.claiming = false;
        Effects::waking(())
    }

    /// Renews `lease_id` for `ttl` from `now`, if it is a current lease
    /// under the claim: answers its row to record.
    pub fn renew(
        &mut self,
        lease_id: Uuid,
        ttl: Duration,
        now: Instant,
        now_ms: i64,
    ) -> Effects<LeaseAct<(Lease, LeaseVersion)>> {
        let Some(local) = self.current_mut(lease_id) else {
            return Effects::quiet(self.not_current(lease_id));
        };
        local.lease.expires_ms = now_ms.saturating_add(millis(ttl));
        local.version = local.version.renewed();
        local.deadline = now + ttl;
        let row = (local.lease.clone(), local.version);
        self.last_used = Some(now);
        Effects::quiet(LeaseAct::Done(row))
    }

    /// Why `lease_id` is not current here: kept under a lapsed claim, or
    /// none of this gateway's.
    fn not_current<T>(&self, lease_id: Uuid) -> LeaseAct<T> {
        let kept =
            self.lapsed.is_some() && self.leases.iter().any(|l| l.lease.lease_id == lease_id);
        if kept {
            LeaseAct::Lapsed
        } else {
            LeaseAct::Unknown
        }
    }

    /// Ends `lease_id` at its holder's request, if it is a current lease
    /// under the claim, or one kept under a lapsed claim (ending a lease
    /// early is safe whoever holds the claim). The claim goes with it when
    /// another gateway waits and nothing here needs it; writes sent under
    /// the lease that may still land keep it (maintenance hands it over then).
    pub fn release(&mut self, lease_id: Uuid, now: Instant) -> Effects<Option<Released>> {
        if self.current_mut(lease_id).is_none()
            && self.not_current::<()>(lease_id) != LeaseAct::Lapsed
        {
            return Effects::quiet(None);
        }
        let at = self
            .leases
            .iter()
            .position(|l| l.lease.lease_id == lease_id)
            .expect("checked above");
        let lease = self.leases.remove(at);
        self.last_used = Some(now);
        if self.leases.is_empty() {
            self.lapsed = None;
        }
        let handover = self.claim.as_ref().is_some_and(|c| c.handover)
            && self.queue.is_empty()
            && self.claim_can_go();
        let withdraw = if handover { self.claim.take() } else { None };
        Effects::waking(Some(Released {
            lease,
            withdraw: withdraw.map(|c| c.candidate),
        }))
    }

    /// The current lease `lease_id` under the claim, if it is one.
    fn current_mut(&mut self, lease_id: Uuid) -> Option<&mut LocalLease> {
        self.claim.as_ref()?;
        self.leases
            .iter_mut()
            .find(|l| l.lease.lease_id == lease_id)
    }

    /// A force-unlock through this gateway: None when it is not the id's
    /// authority (no claim, lapsed or held), else every lease it ended, an
    /// earlier authority's that kept its place included.
    pub fn force_unlock(&mut self, now: Instant, now_ms: i64) -> Effects<Option<Vec<LocalLease>>> {
        if !self.answers_for() {
            return Effects::quiet(None);
        }
        self.lapsed = None;
        let ended = self.end_all_by_force(now, now_ms);
        Effects::waking_if(!ended.is_empty(), Some(ended))
    }

    /// `lease_id` was force-unlocked through a gateway that could not forward
    /// to this one: if it is still current, it ends here too.
    pub fn forced_elsewhere(&mut self, lease_id: Uuid, now: Instant, now_ms: i64) -> Effects<()> {
        let ended = self.end_by_force(lease_id, now, now_ms).is_some();
        Effects::waking_if(ended, ())
    }

    /// A claim attempt won: the claim and its tokens are taken on, with what
    /// the earlier authority left (running leases, kept places), and the
    /// attempt ends, in one step: no waiter sees the id unclaimed with no
    /// attempt under way, to start one that would wait in line behind this
    /// gateway's own claim (a waiter that joined ahead of the winner). The winner
    /// is granted at once, before any hand-over, if it is still first in
    /// line (a higher priority may have joined ahead meanwhile) and its
    /// slots fit.
    /// Gateways without the claim admitted writes under an adopted lease by
    /// its row, so the next grant also waits out their budget,
    /// `write_budget` from `now`.
    pub fn claim_won(
        &mut self,
        won: WonClaim,
        grant: Grant<'_>,
        write_budget: Duration,
    ) -> Effects<Adopted> {
        let Grant {
            id,
            waiter,
            gateway_id,
            now,
            now_ms,
        } = grant;
        self.claiming = false;
        let adopted = self.take_claim(won, now, write_budget);
        let granted = if self.is_first(waiter.ticket) && self.fits(waiter.slots) {
            self.grant(id, waiter, gateway_id, now_ms, now)
        } else {
            None
        };
        Effects::waking(Adopted { adopted, granted })
    }

    /// A claim attempt of the background task's won the lapsed claim back,
    /// or another claim: taken on as [`SlotState::claim_won`] does, with no
    /// waiter to grant. Answers the rows of the leases adopted.
    pub fn claim_rewon(
        &mut self,
        won: WonClaim,
        now: Instant,
        write_budget: Duration,
    ) -> Effects<Vec<(Lease, LeaseVersion)>> {
        Effects::waking(self.take_claim(won, now, write_budget))
    }

    /// Starts a claim attempt for writes (see `locks::write_claim`), if
    /// nothing here claims or holds the id already and no acquire waits
    /// (its own attempt comes first): answers whether it was started. The
    /// attempt is marked under way, as an acquire's is (see [`ClaimAttempt`]).
    pub fn start_claim_for_writes(&mut self) -> Effects<bool> {
        let free = self.claim.is_none()
            && self.lapsed.is_none()
            && !self.claiming
            && self.queue.is_empty();
        if free {
            self.claiming = true;
        }
        Effects::quiet(free)
    }

    /// A claim attempt for writes won: taken on as [`SlotState::claim_won`]
    /// does, with no waiter to grant, and in use from `now`, so that it is
    /// kept until `--claim-idle` after the last write (see
    /// [`SlotState::send`]). Answers the rows of the leases adopted.
    pub fn claim_won_for_writes(
        &mut self,
        won: WonClaim,
        now: Instant,
        write_budget: Duration,
    ) -> Effects<Vec<(Lease, LeaseVersion)>> {
        let adopted = self.take_claim(won, now, write_budget);
        self.last_used = Some(now);
        Effects::waking(adopted)
    }

    /// Takes a won claim on. Leases kept under a lapsed claim run on if the
    /// win re-adopted them (nothing showed another claim or grant since);
    /// else another gateway may have granted meanwhile, and they end.
    fn take_claim(
        &mut self,
        won: WonClaim,
        now: Instant,
        write_budget: Duration,
    ) -> Vec<(Lease, LeaseVersion)> {
        if self.lapsed.take().is_some() && !won.readopted {
            self.leases.clear();
        }
        self.claim = Some(won.claim);
        self.tokens = won.tokens;
        self.delayed.extend(won.inherited.delays);
        // A claim re-won after a lapse reads the same rows again.
        for lease in won.inherited.orphaned {
            let id = lease.lease.lease_id;
            if !self.orphaned.iter().any(|l| l.lease.lease_id == id) {
                self.orphaned.push(lease);
            }
        }
        let adopted: Vec<(Lease, LeaseVersion)> = won
            .inherited
            .leases
            .iter()
            .map(|l| (l.lease.clone(), l.version))
            .collect();
        if !adopted.is_empty() {
            self.leases.extend(won.inherited.leases);
            self.start_send(now + write_budget);
        }
        adopted
    }

    /// A claim attempt on `lapsed` found the id claimed by another gateway
    /// (or lost it to one): the leases kept under it end, if they are still
    /// kept under that claim. Their holders get 409 from now on.
    pub fn lapse_refused(&mut self, lapsed: Uuid) -> Effects<()> {
        let ours = self.lapsed.as_ref().is_some_and(|c| c.claim_id == lapsed);
        if ours {
            self.lapsed = None;
            self.leases.clear();
        }
        Effects::waking_if(ours, ())
    }

    /// A renewal or a token reservation of `claim_id`, if it is still the
    /// claim here, was refused: the claim had run out in ClickHouse or
    /// Keeper when it ran (no gateway takes a claim over before that; a
    /// renewal queued past the TTL meets one that ran out unclaimed). That
    /// says nothing of another gateway, so it is a lapse, not a loss: the
    /// leases are kept, and the claim attempt that re-wins the id finds out.
    pub fn claim_refused(
        &mut self,
        id: &StateId,
        claim_id: Uuid,
        metrics: &Metrics,
    ) -> Effects<()> {
        let ours = self.claim_id() == Some(claim_id);
        if ours {
            self.lapse_claim(id, metrics);
        }
        Effects::waking_if(ours, ())
    }

    /// A renewal of `claim_id` landed: it is valid until `valid_until`, if
    /// it is still the claim here (it may have been dropped or replaced).
    /// One that lapsed here while the renewal was on its way comes back
    /// with its leases: the renewal found it live, so it never ran out in
    /// ClickHouse or Keeper, and no other gateway can have claimed the id.
    pub fn claim_renewed(
        &mut self,
        claim_id: Uuid,
        valid_until: Instant,
        now: Instant,
    ) -> Effects<()> {
        if let Some(claim) = self.claim_mut(claim_id) {
            claim.valid_until = claim.valid_until.max(valid_until);
            return Effects::quiet(());
        }
        let back = self.claim.is_none()
            && now < valid_until
            && self.lapsed.as_ref().is_some_and(|c| c.claim_id == claim_id);
        if back {
            self.claim = self.lapsed.take().map(|candidate| HeldClaim {
                candidate,
                valid_until,
                handover: false,
            });
        }
        Effects::waking_if(back, ())
    }

    /// Whether another gateway waits for `claim_id`, to hand it over when
    /// nothing here needs it any more.
    pub fn contested(&mut self, claim_id: Uuid, contested: bool) -> Effects<()> {
        if let Some(claim) = self.claim_mut(claim_id) {
            claim.handover = contested;
        }
        Effects::quiet(())
    }

    fn claim_mut(&mut self, claim_id: Uuid) -> Option<&mut HeldClaim> {
        self.claim
            .as_mut()
            .filter(|c| c.candidate.claim_id == claim_id)
    }

    /// A maintenance tick at `now`: lets the claim go, if it may (see
    /// [`SlotState::claim_can_go`]), when another gateway waits for it, or
    /// when no one is in line and no lease has begun, been renewed or ended,
    /// and no write gone out, for `idle_release`; else answers the claim that stays, with its leases.
    pub fn tick(&mut self, now: Instant, idle_release: Duration) -> Effects<Tick> {
        let idle_for = self
            .last_used
            .map_or(Duration::MAX, |t| now.duration_since(t));
        let Some(claim) = &self.claim else {
            return Effects::quiet(match self.lapsed_claim() {
                Some(lapsed) if !self.claiming => {
                    self.claiming = true;
                    Tick::Lapsed(lapsed)
                }
                _ => Tick::Unclaimed,
            });
        };
        let goes = self.claim_can_go()
            && (claim.handover || (self.queue.is_empty() && idle_for >= idle_release));
        if !goes {
            let held = Tick::Held(claim.candidate.claim_id, self.holders());
            return Effects::quiet(held);
        }
        let claim = self.claim.take().expect("checked above");
        Effects::waking(Tick::Gone(claim.candidate.claim_id))
    }

    /// Hands the claim back at shutdown: answers it, with the leases it ends
    /// here (to record as handed over, for the next authority to adopt).
    /// Leases kept under a lapsed claim are not handed on: another gateway
    /// may have claimed the id meanwhile, and a hand-over row would bring
    /// them back to life.
    pub fn hand_back(&mut self) -> Effects<Option<(Uuid, Vec<LocalLease>)>> {
        if self.lapsed.take().is_some() {
            self.leases.clear();
        }
        let Some(claim) = self.claim.take() else {
            return Effects::quiet(None);
        };
        let handed = self.leases.drain(..).collect();
        Effects::quiet(Some((claim.candidate.claim_id, handed)))
    }

    /// A newly reserved token block, taken if the claim it was reserved
    /// under still stands and it lies above the one held.
    pub fn add_tokens(&mut self, claim_id: Uuid, block: TokenBlock) -> Effects<()> {
        if self.claim_mut(claim_id).is_some() && block.next > self.tokens.last {
            self.tokens = block;
        }
        Effects::quiet(())
    }

    /// A write goes out under the claim at `now`, and may land until
    /// `until`: answers its number. The claim is in use: an idle one goes
    /// `--claim-idle` after its last write, as after its last lease.
    pub fn send(&mut self, now: Instant, until: Instant) -> Effects<u64> {
        self.last_used = Some(now);
        Effects::quiet(self.start_send(until))
    }

    fn start_send(&mut self, until: Instant) -> u64 {
        let number = self.next_send;
        self.next_send += 1;
        self.sending.insert(number, until);
        number
    }

    /// Write `number` landed or failed: it holds no grant back any more.
    pub fn send_done(&mut self, number: u64) -> Effects<()> {
        self.sending.remove(&number);
        Effects::waking(())
    }

    /// Write `number`'s outcome is unknown: it may land until `until`.
    pub fn send_unknown(&mut self, number: u64, until: Instant) -> Effects<()> {
        if let Some(end) = self.sending.get_mut(&number) {
            *end = until;
        }
        Effects::quiet(())
    }

    /// The claim held here, if any: this gateway is then the id's authority.
    pub fn claim_id(&self) -> Option<Uuid> {
        self.claim.as_ref().map(|c| c.candidate.claim_id)
    }

    /// The lapsed claim and the leases kept under it, if any.
    pub fn lapsed_claim(&self) -> Option<Lapsed> {
        self.lapsed.as_ref().map(|claim| Lapsed {
            claim: claim.clone(),
            leases: self.leases.iter().map(|l| l.lease.lease_id).collect(),
        })
    }

    /// Whether this gateway answers for the id: it holds the claim, or
    /// keeps leases under its lapsed claim (whose holders it answers 503).
    pub fn answers_for(&self) -> bool {
        self.claim.is_some() || self.lapsed.is_some()
    }

    /// The current lease of a state_id: the first of a pool's.
    pub fn lease(&self) -> Option<&Lease> {
        self.leases.first().map(|l| &l.lease)
    }

    /// Every current lease, oldest first.
    pub fn holders(&self) -> Vec<Lease> {
        self.leases.iter().map(|l| l.lease.clone()).collect()
    }

    /// How many places the slot has: 1 on a state_id, a pool's limit.
    pub fn limit(&self) -> usize {
        self.limit.max(1)
    }

    /// How many slots the current leases hold.
    pub fn used(&self) -> usize {
        self.leases.iter().map(|l| l.lease.slots).sum()
    }

    /// The waiters in the order they are granted.
    pub fn waiters(&self) -> Vec<Queued> {
        self.queue.iter().copied().collect()
    }

    /// Whether no write sent under the claim may still land.
    pub fn nothing_landing(&self) -> bool {
        self.sending.is_empty()
    }

    /// Where a write admitted under `claim_id`, carrying `mine` (or no
    /// lease), stands at `now`. Decided here alone: a claim past its
    /// validity, or a lease past its deadline, has ended whether or not
    /// anyone has looked since ([`SlotState::expire`]).
    pub fn standing(&self, claim_id: Uuid, mine: Option<Uuid>, now: Instant) -> Standing {
        let claim = self
            .claim
            .as_ref()
            .filter(|c| c.candidate.claim_id == claim_id && now < c.valid_until);
        let current = self
            .leases
            .first()
            .filter(|l| now < l.deadline)
            .map(|l| &l.lease);
        if claim.is_none() && self.lapsed.as_ref().is_some_and(|c| c.claim_id == claim_id) {
            return Standing::Lapsed;
        }
        match (claim, current, mine) {
            (Some(claim), None, None) => Standing::Until(claim.valid_until),
            (Some(claim), Some(current), Some(mine)) if current.lease_id == mine => {
                Standing::Until(claim.valid_until)
            }
            (Some(_), Some(holder), None) => Standing::Locked(holder.clone()),
            _ => Standing::Gone,
        }
    }
}

#[cfg(test)]
mod tests;
