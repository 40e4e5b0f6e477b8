//! Lease-style locks, on two levels (see design.md):
//!
//! 1. The gateway claim, in ClickHouse ([`claim`]): before this gateway
//!    grants the first lease on a state_id it proposes a candidate row, waits
//!    the settle time, and holds the claim only if its candidate is the
//!    earliest live one. Held claims are renewed in the background
//!    ([`maintain`]), handed over when another gateway waits for them, and
//!    dropped when idle; a crashed gateway's claims lapse.
//! 2. Worker leases, in memory ([`slot`]): while the claim is held, leases are
//!    granted first come, first served without touching the settle time. Each
//!    grant is recorded before it is answered (it carries the fencing token,
//!    and feeds `GET /v1/locks` on every gateway).
//!
//! Invariants, for checking the code against:
//! - One authority per state_id: a gateway grants, renews and releases leases
//!   on an id only while it holds the claim, and stops at `valid_until`, a
//!   tenth of the claim TTL before the claim can lapse in ClickHouse. Another
//!   gateway wins the claim only once this one's candidate has lapsed or been
//!   withdrawn.
//! - No lease dead on arrival: a grant needs at least half the claim TTL of
//!   validity left; a claim with less is renewed first.
//! - Fencing tokens strictly increase per state_id: a new claim holder starts
//!   above the last recorded token, and every token is recorded (with its
//!   lease) before it is handed out; a token whose recording failed is burnt.
//! - A lapse drops the claim and the lease under it at once; a later claim
//!   holder adopts a lease still live in ClickHouse.
//! - An acquire abandoned at any await point (its client hung up) leaves the
//!   line, clears its claim attempt, withdraws its candidate and records the
//!   release of a grant it never answered: guards in [`slot`] and [`claim`].

mod claim;
mod maintain;
mod slot;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use uuid::Uuid;

use self::claim::ClaimOutcome;
use self::slot::{ClaimAttempt, InLine, Slot, SlotState, millis};
pub use crate::config::LockSettings;
pub use crate::domain::Lease;
use crate::domain::StateId;
use crate::metrics::{LockEvent, Metrics};
use crate::store::{LeaseStore, LeaseVersion, StoreError, now_ms};

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

/// The lock handle every request shares.
pub struct LockManager {
    settings: LockSettings,
    leases: LeaseStore,
    metrics: Arc<Metrics>,
    /// One slot per state_id this gateway has business with; the map's lock
    /// is held only to find or drop a slot, never across an `.await`.
    slots: Mutex<HashMap<StateId, Arc<Slot>>>,
}

/// What a waiter does next, decided under the slot's lock and done outside it.
enum Step {
    /// Record this grant, then answer it.
    Grant {
        lease: Lease,
        version: LeaseVersion,
        claim_id: Uuid,
    },
    /// The claim has too little validity left to grant under: renew it first.
    RenewClaim(Uuid),
    /// Run a claim attempt.
    Claim,
    /// Give up: the wait ran out.
    GiveUp(Option<Lease>),
    /// Sleep until woken or until this instant.
    Wait(Instant),
}

/// A grant whose row may be landing in ClickHouse; if its acquire is dropped
/// before the lease is answered, its release is recorded so that no view
/// shows a lease nobody holds.
struct UnansweredGrant<'a> {
    manager: &'a LockManager,
    lease: Option<(Lease, LeaseVersion)>,
}

impl UnansweredGrant<'_> {
    fn answered(mut self) -> Lease {
        let (lease, _) = self.lease.take().expect("answered once");
        lease
    }
}

impl Drop for UnansweredGrant<'_> {
    fn drop(&mut self) {
        if let Some((lease, version)) = self.lease.take() {
            self.manager.record_release(lease, version);
        }
    }
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

    /// The slots as they are now, to visit without holding the map's lock.
    fn snapshot(&self) -> Vec<(StateId, Arc<Slot>)> {
        self.slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(id, slot)| (id.clone(), slot.clone()))
            .collect()
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
        let deadline = Instant::now() + wait;
        let in_line = InLine::join(self.slot(id));
        let result = self
            .wait_for_grant(id, &in_line, owner, ttl, deadline)
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
        in_line: &InLine,
        owner: &str,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<Lease, LockError> {
        let slot = in_line.slot();
        let mut attempted_claim = false;
        let mut counted_wait = false;
        loop {
            let notified = slot.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();

            let mut attempt = None;
            let step = {
                let mut st = slot.lock();
                let step = self.next_step(
                    id,
                    &mut st,
                    in_line.ticket,
                    owner,
                    ttl,
                    deadline,
                    attempted_claim,
                );
                if matches!(step, Step::Claim) {
                    attempt = Some(ClaimAttempt::begin(&mut st, slot));
                }
                step
            };
            match step {
                Step::Grant {
                    lease,
                    version,
                    claim_id,
                } => {
                    if let Some(lease) = self
                        .record_grant(slot, lease, version, claim_id, ttl)
                        .await?
                    {
                        return Ok(lease);
                    }
                }
                Step::RenewClaim(claim_id) => {
                    let started = Instant::now();
                    self.leases
                        .renew_claims(
                            self.settings.gateway_id,
                            &[claim_id],
                            self.settings.claim_ttl,
                        )
                        .await?;
                    let mut st = slot.lock();
                    if let Some(claim) = st
                        .claim
                        .as_mut()
                        .filter(|c| c.candidate.claim_id == claim_id)
                    {
                        claim.valid_until = started + self.claim_margin();
                    }
                }
                Step::Claim => {
                    let outcome = self.try_claim(id, deadline).await;
                    // Cleared before the outcome is applied: the guard takes the lock.
                    drop(attempt);
                    attempted_claim = true;
                    match outcome? {
                        ClaimOutcome::Won(won) => {
                            let grant = {
                                let mut st = slot.lock();
                                st.claim = Some(won.claim);
                                st.next_token = st.next_token.max(won.next_token);
                                st.lease = won.adopted;
                                slot.changed.notify_waiters();
                                // The winner gets a lease before any hand-over,
                                // unless a lease from before is still running.
                                st.lease.is_none().then(|| {
                                    let claim_id = st
                                        .claim
                                        .as_ref()
                                        .map(|c| c.candidate.claim_id)
                                        .expect("just installed");
                                    let (lease, version) = st.next_grant(
                                        id,
                                        owner,
                                        ttl,
                                        self.settings.gateway_id,
                                        now_ms(),
                                    );
                                    (lease, version, claim_id)
                                })
                            };
                            if let Some((lease, version, claim_id)) = grant
                                && let Some(lease) = self
                                    .record_grant(slot, lease, version, claim_id, ttl)
                                    .await?
                            {
                                return Ok(lease);
                            }
                        }
                        ClaimOutcome::Lost if Instant::now() >= deadline => {
                            let holder = self.leases.latest_lease(id).await?;
                            return Err(LockError::Held {
                                state_id: id.clone(),
                                holder: holder.filter(|s| s.live).map(|s| Box::new(s.lease)),
                            });
                        }
                        // Our candidate lapsed in line: stand in line again.
                        ClaimOutcome::Lost => {}
                    }
                }
                Step::GiveUp(holder) => {
                    return Err(LockError::Held {
                        state_id: id.clone(),
                        holder: holder.map(Box::new),
                    });
                }
                Step::Wait(wake_at) => {
                    if !counted_wait {
                        counted_wait = true;
                        self.metrics.lock_event(LockEvent::Wait);
                    }
                    tokio::select! {
                        () = &mut notified => {}
                        () = tokio::time::sleep_until(wake_at.into()) => {}
                    }
                }
            }
        }
    }

    /// Decides, under the slot's lock, what the waiter holding `ticket` does next.
    #[allow(clippy::too_many_arguments)]
    fn next_step(
        &self,
        id: &StateId,
        st: &mut SlotState,
        ticket: u64,
        owner: &str,
        ttl: Duration,
        deadline: Instant,
        attempted_claim: bool,
    ) -> Step {
        let now = Instant::now();
        st.expire(id, now, &self.metrics);
        let my_turn = st.queue.front() == Some(&ticket) && st.lease.is_none() && !st.claiming;
        if my_turn {
            if st.claim.as_ref().is_some_and(|c| c.handover) {
                // Another gateway is waiting: let it go first.
                let claim = st.claim.take().expect("checked above");
                self.withdraw_in_background(id.clone(), claim.candidate);
            }
            match &st.claim {
                Some(claim)
                    if claim.valid_until.saturating_duration_since(now) < self.grant_margin() =>
                {
                    return Step::RenewClaim(claim.candidate.claim_id);
                }
                Some(claim) => {
                    let claim_id = claim.candidate.claim_id;
                    let (lease, version) =
                        st.next_grant(id, owner, ttl, self.settings.gateway_id, now_ms());
                    return Step::Grant {
                        lease,
                        version,
                        claim_id,
                    };
                }
                None if attempted_claim && now >= deadline => {}
                None => return Step::Claim,
            }
        }
        if now >= deadline && (attempted_claim || st.claim.is_some() || !my_turn) {
            return Step::GiveUp(st.lease.as_ref().map(|l| l.lease.clone()));
        }
        Step::Wait(
            st.lease
                .as_ref()
                .map_or(deadline, |l| l.deadline.min(deadline)),
        )
    }

    /// Records a grant, then installs it if its claim still stands; answers
    /// None when the claim went meanwhile (the waiter goes on waiting).
    async fn record_grant(
        &self,
        slot: &Slot,
        lease: Lease,
        version: LeaseVersion,
        claim_id: Uuid,
        ttl: Duration,
    ) -> Result<Option<Lease>, LockError> {
        let pending = UnansweredGrant {
            manager: self,
            lease: Some((lease.clone(), version)),
        };
        self.leases.write_lease(&lease, version, false).await?;
        let installed = slot
            .lock()
            .install(&lease, version, claim_id, ttl, Instant::now());
        Ok(installed.then(|| pending.answered()))
    }

    /// Extends the current lease by `ttl` from now.
    pub async fn renew(
        &self,
        id: &StateId,
        lease_id: Uuid,
        ttl: Duration,
    ) -> Result<Lease, LockError> {
        if let Some(slot) = self.existing_slot(id) {
            let current = {
                let mut st = slot.lock();
                st.expire(id, Instant::now(), &self.metrics);
                st.lease
                    .as_ref()
                    .filter(|l| l.lease.lease_id == lease_id)
                    .map(|l| (l.lease.clone(), l.version))
            };
            if let Some((mut renewed, version)) = current {
                renewed.expires_ms = now_ms().saturating_add(millis(ttl));
                let version = version.renewed();
                self.leases.write_lease(&renewed, version, false).await?;
                let mut st = slot.lock();
                if let Some(local) = st.lease.as_mut().filter(|l| l.lease.lease_id == lease_id) {
                    local.lease = renewed.clone();
                    local.version = version;
                    local.deadline = Instant::now() + ttl;
                    st.last_used = Some(Instant::now());
                    self.metrics.lock_event(LockEvent::Renewal);
                    return Ok(renewed);
                }
                // Released or expired while the renewal was being recorded.
                drop(st);
                self.record_release(renewed, version);
                return Err(LockError::NotCurrent(lease_id));
            }
        }
        Err(self.not_here(id, lease_id).await)
    }

    /// Releases the lease if it is the current one.
    pub async fn release(&self, id: &StateId, lease_id: Uuid) -> Result<(), LockError> {
        if let Some(slot) = self.existing_slot(id) {
            let released = {
                let mut st = slot.lock();
                st.expire(id, Instant::now(), &self.metrics);
                if st
                    .lease
                    .as_ref()
                    .is_some_and(|l| l.lease.lease_id == lease_id)
                {
                    let local = st.lease.take().expect("checked above");
                    st.last_used = Some(Instant::now());
                    let handover =
                        st.claim.as_ref().is_some_and(|c| c.handover) && st.queue.is_empty();
                    let claim = if handover { st.claim.take() } else { None };
                    Some((local, claim))
                } else {
                    None
                }
            };
            if let Some((local, claim)) = released {
                slot.changed.notify_waiters();
                self.metrics.lock_event(LockEvent::Release);
                self.record_release(local.lease, local.version);
                if let Some(claim) = claim {
                    self.withdraw_in_background(id.clone(), claim.candidate);
                }
                return Ok(());
            }
        }
        Err(self.not_here(id, lease_id).await)
    }

    /// Why `lease_id` is not a lease this gateway can act on.
    async fn not_here(&self, id: &StateId, lease_id: Uuid) -> LockError {
        match self.leases.latest_lease(id).await {
            Ok(Some(stored))
                if stored.live
                    && stored.lease.lease_id == lease_id
                    && stored.lease.gateway_id != self.settings.gateway_id =>
            {
                LockError::HeldElsewhere {
                    lease_id,
                    gateway_id: stored.lease.gateway_id,
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
    fn record_release(&self, lease: Lease, version: LeaseVersion) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let leases = self.leases.clone();
        runtime.spawn(async move {
            let mut pause = Duration::from_millis(200);
            let version = version.released();
            while let Err(err) = leases.write_lease(&lease, version, true).await {
                if now_ms() >= lease.expires_ms {
                    return;
                }
                tracing::warn!(state_id = %lease.state_id, error = %err, retry_in = ?pause, "could not record a lease release yet");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
            }
        });
    }

    /// Ends whatever lease `id` has, through any gateway. Answers whether there was one.
    pub async fn force_unlock(&self, id: &StateId) -> Result<bool, LockError> {
        if let Some(slot) = self.existing_slot(id) {
            let current = {
                let mut st = slot.lock();
                st.expire(id, Instant::now(), &self.metrics);
                st.lease.as_ref().map(|l| (l.lease.clone(), l.version))
            };
            if let Some((lease, version)) = current {
                // Recorded first: a force-unlock that fails leaves the lease as it was.
                self.leases
                    .write_lease(&lease, version.released(), true)
                    .await?;
                let mut st = slot.lock();
                if st
                    .lease
                    .as_ref()
                    .is_some_and(|l| l.lease.lease_id == lease.lease_id)
                {
                    st.lease = None;
                }
                drop(st);
                slot.changed.notify_waiters();
                self.metrics.lock_event(LockEvent::ForcedRelease);
                return Ok(true);
            }
        }
        // Held through another gateway: mark it released; that gateway sees it
        // at its next maintenance tick and stops honouring the lease.
        match self.leases.latest_lease(id).await? {
            Some(stored) if stored.live => {
                self.leases
                    .write_lease(&stored.lease, stored.version.released(), true)
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
            let mut st = slot.lock();
            st.expire(id, Instant::now(), &self.metrics);
            if st.claim.is_some() {
                return Ok(st.lease.as_ref().map(|l| l.lease.clone()));
            }
        }
        let latest = self.leases.latest_lease(id).await?;
        Ok(latest.filter(|s| s.live).map(|s| s.lease))
    }

    /// Every current lease, through any gateway.
    pub async fn all(&self) -> Result<Vec<Lease>, LockError> {
        Ok(self.leases.live_leases().await?)
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
}
