//! Lease-style locks, on two levels (see design.md):
//!
//! 1. The gateway claim, in ClickHouse: before this gateway grants the first
//!    lease on a state_id it proposes a candidate row, waits the settle time,
//!    and holds the claim only if its candidate is the earliest live one. The
//!    claim is renewed in the background, handed over when another gateway
//!    waits for it, and dropped when idle; a crashed gateway's claim expires.
//! 2. Worker leases, in memory: while the claim is held, leases are granted
//!    first come, first served without touching the settle time. Each grant is
//!    persisted (it carries the fencing token, which must survive restarts, and
//!    feeds `GET /v1/locks` on every gateway).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Mutex as AsyncMutex, Notify};
use uuid::Uuid;

use crate::domain::StateId;
use crate::metrics::{LockEvent, Metrics};
use crate::store::{Candidate, LeaseRow, LeaseStore, StoreError, now_ms};

/// Bits of a lease row's version below the fencing token: room for renewals.
const VERSION_SEQ_BITS: u32 = 20;
const RELEASED_SEQ: u64 = (1 << VERSION_SEQ_BITS) - 1;
/// How often a candidate waiting in line looks whether its turn has come.
const CLAIM_POLL: Duration = Duration::from_millis(100);

#[derive(Clone, Debug)]
pub struct LockSettings {
    pub gateway_id: Uuid,
    /// How long a claim candidate waits before checking whether it is the earliest.
    pub settle: Duration,
    /// How long a claim lives without renewal; renewed every third of it.
    pub claim_ttl: Duration,
    /// A claim with no lease and no waiter for this long is released.
    pub claim_idle: Duration,
}

/// A granted lease, as this gateway or ClickHouse knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub state_id: StateId,
    pub lease_id: Uuid,
    pub owner: String,
    pub fencing_token: u64,
    pub gateway_id: Uuid,
    pub acquired_ms: i64,
    pub expires_ms: i64,
}

impl From<LeaseRow> for Lease {
    fn from(row: LeaseRow) -> Self {
        Self {
            state_id: row.state_id,
            lease_id: row.lease_id,
            owner: row.owner,
            fencing_token: row.fencing_token,
            gateway_id: row.gateway_id,
            acquired_ms: row.acquired_ms,
            expires_ms: row.expires_ms,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("{state_id} is locked and the wait ran out")]
    Held {
        state_id: StateId,
        holder: Option<Box<Lease>>,
    },
    #[error(
        "lease {0} is not the current lease of this state (released, expired, force-unlocked or unknown)"
    )]
    NotCurrent(Uuid),
    #[error("lease {lease_id} is held through gateway {gateway_id}; renew or release it there")]
    HeldElsewhere { lease_id: Uuid, gateway_id: Uuid },
    #[error("{state_id} is locked; writes need the holder's Lease-Id")]
    Locked {
        state_id: StateId,
        holder: Box<Lease>,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

struct HeldClaim {
    candidate: Candidate,
    version: u64,
    /// Past this instant the claim may have expired in ClickHouse: nothing
    /// granted under it counts any more.
    valid_until: Instant,
    /// Another gateway waits: hand the claim over when the current lease ends.
    handover: bool,
}

struct LocalLease {
    lease: Lease,
    version: u64,
    deadline: Instant,
}

#[derive(Default)]
struct SlotState {
    claim: Option<HeldClaim>,
    /// A waiter is running a claim attempt (settle included) without the slot lock.
    claiming: bool,
    lease: Option<LocalLease>,
    /// Tickets of waiting acquires, first come first served.
    queue: VecDeque<u64>,
    next_ticket: u64,
    next_token: u64,
    last_used: Option<Instant>,
}

impl SlotState {
    /// Drops what has run out by now; says what it dropped.
    fn expire(&mut self, now: Instant, metrics: &Metrics) {
        if self.claim.as_ref().is_some_and(|c| now >= c.valid_until) {
            self.claim = None;
            metrics.lock_event(LockEvent::ClaimLost);
            if self.lease.take().is_some() {
                metrics.lock_event(LockEvent::Expiry);
            }
        }
        if self.lease.as_ref().is_some_and(|l| now >= l.deadline) {
            self.lease = None;
            metrics.lock_event(LockEvent::Expiry);
        }
    }

    fn is_idle(&self) -> bool {
        self.claim.is_none() && !self.claiming && self.lease.is_none() && self.queue.is_empty()
    }
}

/// A waiter's place in a slot's queue, given up on drop.
struct InLine {
    slot: Arc<Slot>,
    ticket: u64,
}

impl Drop for InLine {
    fn drop(&mut self) {
        let (slot, ticket) = (self.slot.clone(), self.ticket);
        tokio::spawn(async move {
            slot.state.lock().await.queue.retain(|t| *t != ticket);
            slot.changed.notify_waiters();
        });
    }
}

/// Clears `claiming` if a claim attempt is abandoned midway (its future
/// dropped); a finished attempt clears it itself and forgets this guard.
struct Claiming<'a>(&'a Slot);

impl Drop for Claiming<'_> {
    fn drop(&mut self) {
        if let Ok(mut st) = self.0.state.try_lock() {
            st.claiming = false;
        }
        self.0.changed.notify_waiters();
    }
}

#[derive(Default)]
struct Slot {
    state: AsyncMutex<SlotState>,
    changed: Notify,
}

pub struct LockManager {
    settings: LockSettings,
    leases: LeaseStore,
    metrics: Arc<Metrics>,
    slots: Mutex<HashMap<StateId, Arc<Slot>>>,
}

/// What one claim attempt came to.
enum ClaimOutcome {
    Won(Box<WonClaim>),
    Lost,
}

struct WonClaim {
    claim: HeldClaim,
    next_token: u64,
    adopted: Option<LocalLease>,
}

fn ms(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

impl LockManager {
    pub fn new(settings: LockSettings, leases: LeaseStore, metrics: Arc<Metrics>) -> Self {
        Self {
            settings,
            leases,
            metrics,
            slots: Mutex::new(HashMap::new()),
        }
    }

    fn slot(&self, id: &StateId) -> Arc<Slot> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots.entry(id.clone()).or_default().clone()
    }

    fn existing_slot(&self, id: &StateId) -> Option<Arc<Slot>> {
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    /// Grants a lease on `id` to `owner`, waiting up to `wait` behind earlier
    /// waiters; a first acquire still runs one claim attempt (settle included)
    /// even with no wait at all.
    pub async fn acquire(
        &self,
        id: &StateId,
        owner: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<Lease, LockError> {
        let slot = self.slot(id);
        let deadline = Instant::now() + wait;
        let ticket = {
            let mut st = slot.state.lock().await;
            let ticket = st.next_ticket;
            st.next_ticket += 1;
            st.queue.push_back(ticket);
            ticket
        };
        // Leaves the queue however this ends: also when the client goes away
        // and the server drops this future mid-wait, which would otherwise
        // leave a dead ticket at the front that nobody behind it gets past.
        let _in_line = InLine {
            slot: slot.clone(),
            ticket,
        };
        let result = self
            .wait_for_grant(id, &slot, ticket, owner, ttl, deadline)
            .await;
        match &result {
            Ok(_) => self.metrics.lock_event(LockEvent::Grant),
            Err(LockError::Held { .. }) => self.metrics.lock_event(LockEvent::Timeout),
            Err(_) => {}
        }
        result
    }

    async fn wait_for_grant(
        &self,
        id: &StateId,
        slot: &Slot,
        ticket: u64,
        owner: &str,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<Lease, LockError> {
        let mut attempted_claim = false;
        let mut counted_wait = false;
        loop {
            let notified = slot.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();

            let mut st = slot.state.lock().await;
            let now = Instant::now();
            st.expire(now, &self.metrics);
            let my_turn = st.queue.front() == Some(&ticket) && st.lease.is_none() && !st.claiming;
            if my_turn {
                match st.claim.as_ref().map(|c| c.handover) {
                    Some(false) => return self.grant(id, &mut st, owner, ttl).await,
                    Some(true) => {
                        // Another gateway is waiting: let it go first.
                        let claim = st.claim.take().expect("checked above");
                        drop(st);
                        self.withdraw(id, &claim.candidate).await;
                        slot.changed.notify_waiters();
                        continue;
                    }
                    None if attempted_claim && now >= deadline => {}
                    None => {
                        st.claiming = true;
                        drop(st);
                        let claiming = Claiming(slot);
                        let outcome = self.try_claim(id, deadline).await;
                        std::mem::forget(claiming);
                        attempted_claim = true;
                        let mut st = slot.state.lock().await;
                        st.claiming = false;
                        slot.changed.notify_waiters();
                        match outcome {
                            Ok(ClaimOutcome::Won(won)) => {
                                st.claim = Some(won.claim);
                                st.next_token = st.next_token.max(won.next_token);
                                st.lease = won.adopted;
                                // The winner gets a lease before any hand-over,
                                // unless a lease from before is still running.
                                if st.lease.is_none() {
                                    return self.grant(id, &mut st, owner, ttl).await;
                                }
                                continue;
                            }
                            Ok(ClaimOutcome::Lost) => {
                                drop(st);
                                if Instant::now() >= deadline {
                                    let holder = self.leases.latest_lease(id).await?;
                                    return Err(LockError::Held {
                                        state_id: id.clone(),
                                        holder: holder
                                            .filter(|(_, live)| *live)
                                            .map(|(row, _)| Box::new(row.into())),
                                    });
                                }
                                // Our candidate lapsed in line: stand in line again.
                                continue;
                            }
                            Err(err) => return Err(err.into()),
                        }
                    }
                }
            }
            if now >= deadline && (attempted_claim || st.claim.is_some() || !my_turn) {
                return Err(LockError::Held {
                    state_id: id.clone(),
                    holder: st.lease.as_ref().map(|l| Box::new(l.lease.clone())),
                });
            }
            if !counted_wait {
                counted_wait = true;
                self.metrics.lock_event(LockEvent::Wait);
            }
            let wake_at = st
                .lease
                .as_ref()
                .map_or(deadline, |l| l.deadline.min(deadline));
            drop(st);
            tokio::select! {
                () = &mut notified => {}
                () = tokio::time::sleep_until(wake_at.into()) => {}
            }
        }
    }

    /// Grants under a held claim: persist first, so the fencing token is
    /// durable before anyone sees it.
    async fn grant(
        &self,
        id: &StateId,
        st: &mut SlotState,
        owner: &str,
        ttl: Duration,
    ) -> Result<Lease, LockError> {
        let token = st.next_token;
        // Burn the token even if persisting fails: the row may have landed.
        st.next_token += 1;
        let now = now_ms();
        let lease = Lease {
            state_id: id.clone(),
            lease_id: Uuid::new_v4(),
            owner: owner.to_owned(),
            fencing_token: token,
            gateway_id: self.settings.gateway_id,
            acquired_ms: now,
            expires_ms: now + ms(ttl),
        };
        let version = token << VERSION_SEQ_BITS;
        self.leases
            .write_lease(&row_of(&lease, version, false))
            .await?;
        let deadline = Instant::now() + ttl;
        st.lease = Some(LocalLease {
            lease: lease.clone(),
            version,
            deadline,
        });
        st.last_used = Some(Instant::now());
        Ok(lease)
    }

    /// Claims `id`: proposes a candidate stamped with the server's clock, lets
    /// it settle, then keeps it in line (renewed) until it is the earliest live
    /// candidate or `deadline` passes. Staying in line is what makes gateways
    /// take turns: the holder sees the waiting candidate and hands over, and the
    /// waiter wins by its place, not by a race against fresh candidates.
    async fn try_claim(&self, id: &StateId, deadline: Instant) -> Result<ClaimOutcome, StoreError> {
        let claim_id = Uuid::new_v4();
        let mut written_at = Instant::now();
        self.leases
            .propose_claim(
                id,
                claim_id,
                self.settings.gateway_id,
                self.settings.claim_ttl,
            )
            .await?;
        tokio::time::sleep(self.settings.settle).await;
        let mut version = 1;
        loop {
            let candidates = match self.leases.candidates(id).await {
                Ok(candidates) => candidates,
                Err(err) => {
                    self.withdraw(id, &self.unplaced(claim_id)).await;
                    return Err(err);
                }
            };
            let Some(mine) = candidates.iter().find(|c| c.claim_id == claim_id).cloned() else {
                // Our candidate lapsed (a stall longer than the claim TTL).
                self.metrics.lock_event(LockEvent::ClaimLoss);
                return Ok(ClaimOutcome::Lost);
            };
            if candidates.first().map(|c| c.claim_id) == Some(claim_id) {
                return self
                    .won(id, mine, version, written_at, candidates.len() > 1)
                    .await;
            }
            let now = Instant::now();
            if now >= deadline {
                self.withdraw(id, &mine).await;
                self.metrics.lock_event(LockEvent::ClaimLoss);
                return Ok(ClaimOutcome::Lost);
            }
            if now.duration_since(written_at) >= self.settings.claim_ttl / 3 {
                if let Err(err) = self
                    .leases
                    .renew_claim(id, &mine, self.settings.claim_ttl, version + 1)
                    .await
                {
                    self.withdraw(id, &mine).await;
                    return Err(err);
                }
                version += 1;
                written_at = now;
            }
            tokio::time::sleep(CLAIM_POLL.min(deadline - now)).await;
        }
    }

    /// A candidate whose place in line is unknown, for withdrawing it.
    fn unplaced(&self, claim_id: Uuid) -> Candidate {
        Candidate {
            claim_id,
            gateway_id: self.settings.gateway_id,
            created_ms: 0,
        }
    }

    /// Takes over a claim just won: the next fencing token, and any lease
    /// still running from a gateway that held the claim before.
    async fn won(
        &self,
        id: &StateId,
        mine: Candidate,
        version: u64,
        written_at: Instant,
        others_waiting: bool,
    ) -> Result<ClaimOutcome, StoreError> {
        let latest = match self.leases.latest_lease(id).await {
            Ok(latest) => latest,
            Err(err) => {
                self.withdraw(id, &mine).await;
                return Err(err);
            }
        };
        self.metrics.lock_event(LockEvent::ClaimWin);
        let next_token = latest.as_ref().map_or(1, |(row, _)| row.fencing_token + 1);
        // A lease granted through a gateway that went away is still the
        // current one until it ends: adopt it rather than break it.
        let adopted = latest.filter(|(_, live)| *live).map(|(row, _)| {
            let remaining = u64::try_from(row.expires_ms - now_ms()).unwrap_or(0);
            LocalLease {
                version: row.version,
                deadline: Instant::now() + Duration::from_millis(remaining),
                lease: row.into(),
            }
        });
        Ok(ClaimOutcome::Won(Box::new(WonClaim {
            claim: HeldClaim {
                candidate: mine,
                version,
                valid_until: written_at + self.claim_margin(),
                handover: others_waiting,
            },
            next_token,
            adopted,
        })))
    }

    /// How long a claim written at some instant is surely still live: its TTL
    /// less a tenth for clock rate and scheduling slack.
    fn claim_margin(&self) -> Duration {
        self.settings.claim_ttl - self.settings.claim_ttl / 10
    }

    async fn withdraw(&self, id: &StateId, candidate: &Candidate) {
        if let Err(err) = self.leases.withdraw_claim(id, candidate).await {
            // It expires by itself; until then it only delays other gateways.
            tracing::warn!(state_id = %id, error = %err, "could not withdraw a claim");
        }
    }

    /// Extends the current lease by `ttl` from now.
    pub async fn renew(
        &self,
        id: &StateId,
        lease_id: Uuid,
        ttl: Duration,
    ) -> Result<Lease, LockError> {
        if let Some(slot) = self.existing_slot(id) {
            let mut st = slot.state.lock().await;
            st.expire(Instant::now(), &self.metrics);
            if let Some(local) = st.lease.as_mut().filter(|l| l.lease.lease_id == lease_id) {
                let mut renewed = local.lease.clone();
                renewed.expires_ms = now_ms() + ms(ttl);
                let version = local.version + 1;
                self.leases
                    .write_lease(&row_of(&renewed, version, false))
                    .await?;
                local.lease = renewed.clone();
                local.version = version;
                local.deadline = Instant::now() + ttl;
                st.last_used = Some(Instant::now());
                self.metrics.lock_event(LockEvent::Renewal);
                return Ok(renewed);
            }
        }
        Err(self.not_here(id, lease_id).await)
    }

    /// Releases the lease if it is the current one.
    pub async fn release(&self, id: &StateId, lease_id: Uuid) -> Result<(), LockError> {
        if let Some(slot) = self.existing_slot(id) {
            let mut st = slot.state.lock().await;
            st.expire(Instant::now(), &self.metrics);
            if st
                .lease
                .as_ref()
                .is_some_and(|l| l.lease.lease_id == lease_id)
            {
                let local = st.lease.take().expect("checked above");
                st.last_used = Some(Instant::now());
                let handover = st.claim.as_ref().is_some_and(|c| c.handover) && st.queue.is_empty();
                let claim = if handover { st.claim.take() } else { None };
                drop(st);
                slot.changed.notify_waiters();
                self.metrics.lock_event(LockEvent::Release);
                self.persist_release(local.lease, local.version);
                if let Some(claim) = claim {
                    self.withdraw(id, &claim.candidate).await;
                }
                return Ok(());
            }
        }
        Err(self.not_here(id, lease_id).await)
    }

    /// Why `lease_id` is not a lease this gateway can act on.
    async fn not_here(&self, id: &StateId, lease_id: Uuid) -> LockError {
        match self.leases.latest_lease(id).await {
            Ok(Some((row, true)))
                if row.lease_id == lease_id && row.gateway_id != self.settings.gateway_id =>
            {
                LockError::HeldElsewhere {
                    lease_id,
                    gateway_id: row.gateway_id,
                }
            }
            Ok(_) => LockError::NotCurrent(lease_id),
            Err(err) => LockError::Store(err),
        }
    }

    /// Recording a release is not needed for safety (the row's version orders
    /// it before any later grant), so the caller does not wait for it. It is
    /// retried through a ClickHouse outage, so that `GET /v1/locks` stops
    /// showing the lease once ClickHouse is back; after the lease's own expiry
    /// the row shows nothing anyway.
    fn persist_release(&self, lease: Lease, version: u64) {
        let leases = self.leases.clone();
        let row = row_of(&lease, (version & !RELEASED_SEQ) | RELEASED_SEQ, true);
        tokio::spawn(async move {
            let mut pause = Duration::from_millis(200);
            while let Err(err) = leases.write_lease(&row).await {
                if now_ms() >= row.expires_ms {
                    return;
                }
                tracing::warn!(state_id = %row.state_id, error = %err, retry_in = ?pause, "could not record a lease release yet");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
            }
        });
    }

    /// Ends whatever lease `id` has, through any gateway. Answers whether there was one.
    pub async fn force_unlock(&self, id: &StateId) -> Result<bool, LockError> {
        if let Some(slot) = self.existing_slot(id) {
            let mut st = slot.state.lock().await;
            st.expire(Instant::now(), &self.metrics);
            if let Some(local) = &st.lease {
                // Recorded first: a force-unlock that fails leaves the lease as it was.
                let row = row_of(&local.lease, local.version | RELEASED_SEQ, true);
                self.leases.write_lease(&row).await?;
                st.lease = None;
                drop(st);
                slot.changed.notify_waiters();
                self.metrics.lock_event(LockEvent::ForcedRelease);
                return Ok(true);
            }
        }
        // Held through another gateway: mark it released; that gateway sees it
        // at its next claim renewal and stops honouring the lease.
        match self.leases.latest_lease(id).await? {
            Some((row, true)) => {
                let version = row.version | RELEASED_SEQ;
                self.leases
                    .write_lease(&LeaseRow {
                        released: true,
                        version,
                        ..row
                    })
                    .await?;
                self.metrics.lock_event(LockEvent::ForcedRelease);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// The current lease of `id`, through any gateway.
    pub async fn current(&self, id: &StateId) -> Result<Option<Lease>, LockError> {
        if let Some(slot) = self.existing_slot(id) {
            let mut st = slot.state.lock().await;
            st.expire(Instant::now(), &self.metrics);
            if st.claim.is_some() {
                return Ok(st.lease.as_ref().map(|l| l.lease.clone()));
            }
        }
        let latest = self.leases.latest_lease(id).await?;
        Ok(latest.filter(|(_, live)| *live).map(|(row, _)| row.into()))
    }

    /// Every current lease, through any gateway.
    pub async fn all(&self) -> Result<Vec<Lease>, LockError> {
        Ok(self
            .leases
            .live_leases()
            .await?
            .into_iter()
            .map(Lease::from)
            .collect())
    }

    /// Whether a write to `id` carrying `lease_id` (or none) may go ahead now.
    pub async fn check_write(&self, id: &StateId, lease_id: Option<Uuid>) -> Result<(), LockError> {
        let current = self.current(id).await?;
        match (current, lease_id) {
            (None, None) => Ok(()),
            (Some(lease), Some(given)) if lease.lease_id == given => Ok(()),
            (Some(holder), None) => Err(LockError::Locked {
                state_id: id.clone(),
                holder: Box::new(holder),
            }),
            (_, Some(given)) => Err(LockError::NotCurrent(given)),
        }
    }

    /// The slots as they are now, to visit without holding the map's lock.
    fn snapshot(&self) -> Vec<(StateId, Arc<Slot>)> {
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(id, slot)| (id.clone(), slot.clone()))
            .collect()
    }

    /// Withdraws every claim this gateway holds (at shutdown).
    pub async fn withdraw_all_claims(&self) {
        for (id, slot) in self.snapshot() {
            let claim = slot.state.lock().await.claim.take();
            if let Some(claim) = claim {
                self.withdraw(&id, &claim.candidate).await;
            }
        }
    }

    /// Keeps claims alive, hands them over, drops idle ones, and notices
    /// leases force-unlocked through another gateway. Runs until dropped.
    pub async fn maintain(self: Arc<Self>) {
        let period = self.settings.claim_ttl / 3;
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            for (id, slot) in self.snapshot() {
                self.maintain_slot(&id, &slot).await;
            }
        }
    }

    async fn maintain_slot(&self, id: &StateId, slot: &Arc<Slot>) {
        let mut st = slot.state.lock().await;
        let now = Instant::now();
        st.expire(now, &self.metrics);
        if let Some(local) = &st.lease
            && let Ok(Some((row, _))) = self.leases.latest_lease(id).await
            && row.lease_id == local.lease.lease_id
            && row.released
        {
            st.lease = None;
            slot.changed.notify_waiters();
        }
        let idle_for = st
            .last_used
            .map_or(Duration::MAX, |t| now.duration_since(t));
        let drop_claim = st.claim.as_ref().is_some_and(|claim| {
            st.lease.is_none()
                && (claim.handover || (st.queue.is_empty() && idle_for >= self.settings.claim_idle))
        });
        if drop_claim {
            let claim = st.claim.take().expect("checked above");
            drop(st);
            self.withdraw(id, &claim.candidate).await;
            slot.changed.notify_waiters();
        } else if let Some(claim) = st.claim.as_mut() {
            let started = Instant::now();
            let version = claim.version + 1;
            let renewed = self
                .leases
                .renew_claim(id, &claim.candidate, self.settings.claim_ttl, version)
                .await;
            match renewed {
                Ok(()) => {
                    claim.version = version;
                    claim.valid_until = started + self.claim_margin();
                    if let Ok(candidates) = self.leases.candidates(id).await {
                        claim.handover = candidates
                            .iter()
                            .any(|c| c.claim_id != claim.candidate.claim_id);
                    }
                }
                Err(err) => {
                    tracing::warn!(state_id = %id, error = %err, "could not renew a claim; it lapses if this goes on");
                }
            }
            drop(st);
        } else {
            drop(st);
        }
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(existing) = slots.get(id)
            && Arc::strong_count(existing) <= 2
            && existing.state.try_lock().is_ok_and(|st| st.is_idle())
        {
            slots.remove(id);
        }
    }
}

fn row_of(lease: &Lease, version: u64, released: bool) -> LeaseRow {
    LeaseRow {
        state_id: lease.state_id.clone(),
        lease_id: lease.lease_id,
        gateway_id: lease.gateway_id,
        owner: lease.owner.clone(),
        fencing_token: lease.fencing_token,
        acquired_ms: lease.acquired_ms,
        expires_ms: lease.expires_ms,
        released,
        version,
    }
}
