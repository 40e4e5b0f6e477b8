//! Lease-style locks, on two levels (see design.md):
//!
//! 1. The gateway claim, in ClickHouse ([`claim`]): before this gateway
//!    grants the first lease on a state_id it proposes a candidate row, waits
//!    the settle time, and holds the claim only if its candidate is the
//!    earliest live one. The claim holder is the id's authority: other
//!    gateways forward the id's lock operations and lock-checked writes to it
//!    ([`forward`]). Held claims are renewed in the background
//!    ([`maintain`]), dropped when idle, and handed back at shutdown; a
//!    crashed gateway's claims lapse.
//! 2. Worker leases, in memory ([`slot`]): the authority grants, renews and
//!    releases leases first come, first served with no ClickHouse round trip;
//!    their rows, for other gateways' views, are written behind ([`record`]).
//!
//! Invariants, for checking the code against:
//! - One authority per state_id: a gateway grants, renews and releases leases
//!   on an id only while it holds the claim, and stops at `valid_until`, a
//!   tenth of the claim TTL before the claim can lapse in ClickHouse. Another
//!   gateway wins the claim only once this one's candidate has lapsed or been
//!   withdrawn.
//! - No lease dead on arrival: a grant needs at least half the claim TTL of
//!   validity left; a claim with less is renewed first. These fractions of
//!   the TTL, and every other wait they imply, are kept in [`timing`].
//! - Fencing tokens strictly increase per state_id: a new authority reserves
//!   a block of tokens above every token reserved or recorded before, and the
//!   reservation is written before any token from it is handed out.
//! - A lease lives as long as its authority's claim: a lapse (a crash, or
//!   ClickHouse out of reach for most of the claim TTL) ends it, and the next
//!   authority does not adopt it. A gateway that shuts down hands its leases
//!   on (their rows marked handed over, written before its claims are
//!   withdrawn) and the next authority adopts them.
//! - A lease's end waits for its admitted writes: a write is checked again
//!   as it goes out, and refused (409) if its lease ended meanwhile; one
//!   that went out in time keeps the next grant here, and the hand-over of
//!   the claim, waiting until it has landed or failed, within the query
//!   timeout and the claim's validity ([`write`]). So the next holder reads
//!   every acknowledged write.
//! - A grant to a forwarded acquire lasts a few seconds until the forwarding
//!   gateway confirms it reached its client: an answer lost on the way does
//!   not hold the id for the whole TTL (`http::forward`).
//! - An acquire abandoned at any await point (its client hung up) leaves the
//!   line, clears its claim attempt and withdraws its candidate: guards in
//!   [`slot`] and [`claim`]. A write abandoned in flight keeps its id from
//!   the next grant until its time budget is spent, since it may still land.
//! - What a waiter does next is decided by a pure function of the slot's
//!   state and the time (`SlotState::next_step`); its effects (grants' rows,
//!   withdrawals) are carried out by the caller, outside the slot's lock.

mod claim;
mod forward;
mod maintain;
mod record;
mod slot;
mod timing;
mod write;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use uuid::Uuid;

use self::claim::{ClaimOutcome, Claims};
use self::forward::{Authorities, PeerClient};
pub use self::forward::{FORWARDED_BY, ForwardError, Peer, Route, SeenLease};
use self::record::Recorder;
use self::slot::{ClaimAttempt, InLine, Rules, Slot, Step, Waiter, millis};
use self::timing::ClaimTiming;
pub use self::timing::UNCONFIRMED_GRANT;
pub use self::write::{Admitted, Sending};
pub use crate::config::LockSettings;
use crate::domain::Coordination;
pub use crate::domain::Lease;
use crate::domain::StateId;
use crate::metrics::{LockEvent, Metrics};
use crate::store::{
    KeeperClaimStore, LeaseRecord, LeaseState, LeaseStore, LeaseVersion, StoreError, now_ms,
};

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
    /// The claim a write was admitted under went before the write went out
    /// (a hand-over or a lapse): the id's authority is moving.
    #[error("the claim on {0} moved while the write was on its way; retry shortly")]
    Moving(StateId),
    /// Another gateway won the claim: the request belongs there.
    #[error("gateway {} is the authority for this state_id", .0.gateway_id)]
    Elsewhere(Peer),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// How often a 409 looks again for a holder that another gateway granted a
/// moment ago (see [`LockManager::held_elsewhere`]).
const HOLDER_POLL: Duration = Duration::from_millis(25);

/// The lock handle every request shares.
pub struct LockManager {
    settings: LockSettings,
    /// The longest one ClickHouse round trip may take: what a write under a
    /// lease that just ended may keep the next grant waiting.
    query_timeout: Duration,
    /// Every wait and margin derived from the claim TTL, the settle time and
    /// the query timeout.
    timing: ClaimTiming,
    /// Where claims are kept: the lease table or Keeper (`--coordination`).
    claims: Claims,
    leases: LeaseStore,
    metrics: Arc<Metrics>,
    /// One slot per state_id this gateway has business with; the map's lock
    /// is held only to find or drop a slot, never across an `.await`.
    slots: Mutex<HashMap<StateId, Arc<Slot>>>,
    /// Lease rows on their way to ClickHouse.
    recorder: Recorder,
    /// Who the authority for an id is, as looked up lately.
    authorities: Authorities,
    peers: PeerClient,
}

impl LockManager {
    pub fn new(
        settings: LockSettings,
        query_timeout: Duration,
        leases: LeaseStore,
        keeper: KeeperClaimStore,
        metrics: Arc<Metrics>,
    ) -> Self {
        let claims = match settings.coordination {
            Coordination::Table => Claims::Table,
            Coordination::Keeper => Claims::Keeper(Box::new(keeper)),
        };
        let peers = PeerClient::new(settings.peer_tls.clone());
        Self {
            timing: ClaimTiming::new(&settings, query_timeout),
            settings,
            query_timeout,
            claims,
            recorder: Recorder::new(leases.clone()),
            leases,
            metrics,
            slots: Mutex::new(HashMap::new()),
            authorities: Authorities::default(),
            peers,
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

    fn holds_claim(&self, id: &StateId) -> bool {
        self.authority_claim(id).is_some()
    }

    /// The claim this gateway holds on `id`, if it is the id's authority: as
    /// long as it holds that claim, every write to the id comes through it.
    pub fn authority_claim(&self, id: &StateId) -> Option<Uuid> {
        let slot = self.existing_slot(id)?;
        let mut st = slot.lock();
        st.expire(id, Instant::now(), &self.metrics);
        st.claim.as_ref().map(|c| c.candidate.claim_id)
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
        let rules = self.rules();
        let mut waiter = Waiter {
            ticket: in_line.ticket,
            owner,
            ttl,
            deadline,
            attempted_claim: false,
        };
        let mut counted_wait = false;
        loop {
            let notified = slot.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();

            let mut attempt = None;
            let decision = {
                let mut st = slot.lock();
                let now = Instant::now();
                st.expire(id, now, &self.metrics);
                let decision = st.next_step(id, &waiter, &rules, now, now_ms());
                if decision.step == Step::Claim {
                    attempt = Some(ClaimAttempt::begin(&mut st, slot));
                }
                decision
            };
            if let Some(candidate) = decision.withdraw {
                self.withdraw_in_background(id.clone(), candidate);
            }
            match decision.step {
                Step::Granted(lease, version) => {
                    self.record_held(&lease, version);
                    return Ok(lease);
                }
                Step::RenewClaim(claim_id) => {
                    let started = Instant::now();
                    let lost = self.renew_claims(&[(id.clone(), claim_id)]).await?;
                    let mut st = slot.lock();
                    if st.claim.as_ref().map(|c| c.candidate.claim_id) == Some(claim_id) {
                        if lost.contains(&claim_id) {
                            st.lose_claim(id, &self.metrics);
                        } else if let Some(claim) = st.claim.as_mut() {
                            claim.valid_until = self.timing.valid_until(started);
                        }
                    }
                }
                Step::ReserveTokens { claim_id, first } => {
                    let block = self.reserve_tokens(id, claim_id, first).await?;
                    let mut st = slot.lock();
                    match block {
                        Some(block) => st.add_tokens(claim_id, block),
                        None if st.claim.as_ref().map(|c| c.candidate.claim_id)
                            == Some(claim_id) =>
                        {
                            st.lose_claim(id, &self.metrics);
                        }
                        None => {}
                    }
                }
                Step::Claim => {
                    let outcome = self.try_claim(id, deadline).await;
                    // Cleared before the outcome is applied: the guard takes the lock.
                    drop(attempt);
                    waiter.attempted_claim = true;
                    match outcome? {
                        ClaimOutcome::Won(won) => {
                            let (adopted, granted) = {
                                let mut st = slot.lock();
                                st.claim = Some(won.claim);
                                st.tokens = won.tokens;
                                let adopted = won.adopted.map(|adopted| {
                                    let row = (adopted.lease.clone(), adopted.version);
                                    st.lease = Some(adopted);
                                    // Gateways without the claim admitted writes
                                    // under the handed-over lease, by its row: the
                                    // next grant waits out their budget too.
                                    let number = st.next_send;
                                    st.next_send += 1;
                                    st.sending.insert(
                                        number,
                                        Instant::now() + self.timing.write_budget(),
                                    );
                                    row
                                });
                                // The winner gets a lease before any hand-over,
                                // unless a lease from before is still running.
                                let granted = if st.lease.is_none() {
                                    st.grant(
                                        id,
                                        &waiter,
                                        self.settings.gateway_id,
                                        now_ms(),
                                        Instant::now(),
                                    )
                                } else {
                                    None
                                };
                                (adopted, granted)
                            };
                            slot.changed.notify_waiters();
                            if let Some((lease, version)) = adopted {
                                self.record_held(&lease, version);
                            }
                            if let Some((lease, version)) = granted {
                                self.record_held(&lease, version);
                                return Ok(lease);
                            }
                        }
                        ClaimOutcome::Elsewhere(peer) => return Err(LockError::Elsewhere(peer)),
                        ClaimOutcome::Lost if Instant::now() >= deadline => {
                            return Err(self.held_elsewhere(id).await);
                        }
                        // Our candidate lapsed in line: stand in line again.
                        ClaimOutcome::Lost => {}
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

    fn rules(&self) -> Rules {
        Rules {
            gateway_id: self.settings.gateway_id,
            grant_margin: self.timing.grant_margin(),
            holder_grace: self.timing.holder_grace(),
        }
    }

    /// The 409 for an id that another gateway holds the claim on. Its lease
    /// row is written behind its grant, so a lease granted a moment ago may
    /// not be recorded yet: the record is read again for a while (a gateway
    /// that just won a claim grants at once).
    async fn held_elsewhere(&self, id: &StateId) -> LockError {
        let started = Instant::now();
        loop {
            match self.recorded_lease(id, None).await {
                Ok(Some(holder)) => {
                    return LockError::Held {
                        state_id: id.clone(),
                        holder: Some(Box::new(holder)),
                    };
                }
                Ok(None) if started.elapsed() < self.timing.holder_wait() => {
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

    fn record_held(&self, lease: &Lease, version: LeaseVersion) {
        self.recorder.record(LeaseRecord {
            lease: lease.clone(),
            version,
            state: LeaseState::Held,
        });
    }

    /// Extends the current lease by `ttl` from now.
    pub async fn renew(
        &self,
        id: &StateId,
        lease_id: Uuid,
        ttl: Duration,
    ) -> Result<Lease, LockError> {
        if let Some(slot) = self.existing_slot(id) {
            let renewed = {
                let mut st = slot.lock();
                st.expire(id, Instant::now(), &self.metrics);
                let renewed = st
                    .claim
                    .is_some()
                    .then(|| st.lease.as_mut().filter(|l| l.lease.lease_id == lease_id))
                    .flatten()
                    .map(|local| {
                        local.lease.expires_ms = now_ms().saturating_add(millis(ttl));
                        local.version = local.version.renewed();
                        local.deadline = Instant::now() + ttl;
                        (local.lease.clone(), local.version)
                    });
                if renewed.is_some() {
                    st.last_used = Some(Instant::now());
                }
                renewed
            };
            if let Some((renewed, version)) = renewed {
                self.record_held(&renewed, version);
                self.metrics.lock_event(LockEvent::Renewal);
                return Ok(renewed);
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
                if st.claim.is_some()
                    && st
                        .lease
                        .as_ref()
                        .is_some_and(|l| l.lease.lease_id == lease_id)
                {
                    let local = st.lease.take().expect("checked above");
                    st.last_used = Some(Instant::now());
                    // Writes sent under the lease may still land: until they
                    // have, the claim stays (maintenance hands it over then).
                    let handover = st.claim.as_ref().is_some_and(|c| c.handover)
                        && st.queue.is_empty()
                        && st.claim_can_go();
                    let claim = if handover { st.claim.take() } else { None };
                    Some((local, claim))
                } else {
                    None
                }
            };
            if let Some((local, claim)) = released {
                slot.changed.notify_waiters();
                self.metrics.lock_event(LockEvent::Release);
                self.record_released(local.lease, local.version);
                if let Some(claim) = claim {
                    self.withdraw_in_background(id.clone(), claim.candidate);
                }
                return Ok(());
            }
        }
        Err(self.not_here(id, lease_id).await)
    }

    fn record_released(&self, lease: Lease, version: LeaseVersion) {
        self.recorder.record(LeaseRecord {
            lease,
            version: version.released(),
            state: LeaseState::Released,
        });
    }

    /// Why `lease_id` is not a lease this gateway can act on.
    async fn not_here(&self, id: &StateId, lease_id: Uuid) -> LockError {
        match self.authority(id).await {
            Ok(authority) => match authority.lease_in_force() {
                Some(lease)
                    if lease.lease_id == lease_id
                        && lease.gateway_id != self.settings.gateway_id =>
                {
                    LockError::HeldElsewhere {
                        lease_id,
                        gateway_id: lease.gateway_id,
                    }
                }
                _ => LockError::NotCurrent(lease_id),
            },
            Err(err) => LockError::Store(err),
        }
    }

    /// Ends whatever lease `id` has. Answers whether there was one.
    pub async fn force_unlock(&self, id: &StateId) -> Result<bool, LockError> {
        if let Some(slot) = self.existing_slot(id) {
            let ended = {
                let mut st = slot.lock();
                st.expire(id, Instant::now(), &self.metrics);
                if st.claim.is_some() {
                    Some(st.lease.take())
                } else {
                    None
                }
            };
            if let Some(ended) = ended {
                let had_lease = ended.is_some();
                if let Some(local) = ended {
                    slot.changed.notify_waiters();
                    self.metrics.lock_event(LockEvent::ForcedRelease);
                    self.record_released(local.lease, local.version);
                }
                return Ok(had_lease);
            }
        }
        // No claim here: a lease handed on at a shutdown, or one held through
        // a gateway that cannot be forwarded to, which sees the mark at its
        // next maintenance tick and stops honouring the lease.
        match self.authority(id).await?.in_force() {
            Some(stored) => {
                let record = stored.record.clone();
                self.leases
                    .write_leases(&[LeaseRecord {
                        version: record.version.released(),
                        state: LeaseState::Released,
                        lease: record.lease,
                    }])
                    .await?;
                self.metrics.lock_event(LockEvent::ForcedRelease);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The current lease of `id`: this gateway's own when it is the
    /// authority, else what ClickHouse records (as `seen` while routing the
    /// request, if that is fresh).
    pub async fn current(
        &self,
        id: &StateId,
        seen: Option<&SeenLease>,
    ) -> Result<Option<Lease>, LockError> {
        if let Some(slot) = self.existing_slot(id) {
            let mut st = slot.lock();
            st.expire(id, Instant::now(), &self.metrics);
            if st.claim.is_some() {
                return Ok(st.lease.as_ref().map(|l| l.lease.clone()));
            }
        }
        Ok(self.recorded_lease(id, seen).await?)
    }

    /// The lease in force on `id` by ClickHouse's record: `seen`'s while it
    /// is fresh, else read now. A lease that a routing read did not see
    /// needs a claim it did not see either (a gateway hands its leases on
    /// before it withdraws its claims), and a new claim grants nothing for
    /// the settle time; half of that is the freshness kept.
    async fn recorded_lease(
        &self,
        id: &StateId,
        seen: Option<&SeenLease>,
    ) -> Result<Option<Lease>, StoreError> {
        if let Some(seen) = seen.filter(|s| s.at.elapsed() < self.timing.seen_lease_fresh()) {
            return Ok(seen.lease.clone());
        }
        Ok(self.authority(id).await?.lease_in_force().cloned())
    }

    /// Every current lease: ClickHouse's record, with this gateway's own
    /// leases as they are now (their rows may still be on their way).
    pub async fn all(&self) -> Result<Vec<Lease>, LockError> {
        let mut by_id: std::collections::BTreeMap<String, Lease> = self
            .recorded_leases()
            .await?
            .into_iter()
            .map(|lease| (lease.state_id.as_str().to_owned(), lease))
            .collect();
        let now = Instant::now();
        for (id, slot) in self.snapshot() {
            let mut st = slot.lock();
            st.expire(&id, now, &self.metrics);
            if st.claim.is_none() {
                continue;
            }
            match &st.lease {
                Some(local) => {
                    by_id.insert(id.as_str().to_owned(), local.lease.clone());
                }
                None => {
                    by_id.remove(id.as_str());
                }
            }
        }
        Ok(by_id.into_values().collect())
    }

    /// Admits a write to `id` carrying `lease_id` (or none) if the lock rule
    /// lets it go ahead now; it is checked again as it goes out
    /// ([`Admitted::sending`]).
    pub async fn check_write(
        &self,
        id: &StateId,
        lease_id: Option<Uuid>,
        seen: Option<&SeenLease>,
    ) -> Result<Admitted, LockError> {
        if let Some(admitted) = self.admit_here(id, lease_id) {
            return admitted;
        }
        let current = self.recorded_lease(id, seen).await?;
        let lease = lease_rule(id, current.as_ref(), lease_id)?;
        Ok(Admitted::recorded(id.clone(), lease, self.query_timeout))
    }

    /// The lock rule applied by this gateway as the id's authority; None
    /// when it is not the authority.
    fn admit_here(
        &self,
        id: &StateId,
        lease_id: Option<Uuid>,
    ) -> Option<Result<Admitted, LockError>> {
        let slot = self.existing_slot(id)?;
        let mut st = slot.lock();
        st.expire(id, Instant::now(), &self.metrics);
        let claim_id = st.claim.as_ref()?.candidate.claim_id;
        let current = st.lease.as_ref().map(|l| l.lease.clone());
        drop(st);
        Some(
            lease_rule(id, current.as_ref(), lease_id).map(|lease| {
                Admitted::local(id.clone(), lease, slot, claim_id, self.query_timeout)
            }),
        )
    }

    /// [`LockManager::check_write`] for a batch: against this gateway's own
    /// leases where it is the authority, and the ones ClickHouse records
    /// for the others, read once. Answers each entry's admission, or the
    /// first entry refused.
    pub async fn check_writes(
        &self,
        writes: &[(&StateId, Option<Uuid>)],
    ) -> Result<Vec<Admitted>, (usize, LockError)> {
        let recorded: HashMap<String, Lease> = self
            .recorded_leases()
            .await
            .map_err(|err| (0, err.into()))?
            .into_iter()
            .map(|lease| (lease.state_id.as_str().to_owned(), lease))
            .collect();
        writes
            .iter()
            .enumerate()
            .map(|(index, (id, lease_id))| {
                let admitted = self.admit_here(id, *lease_id).unwrap_or_else(|| {
                    lease_rule(id, recorded.get(id.as_str()), *lease_id)
                        .map(|lease| Admitted::recorded((*id).clone(), lease, self.query_timeout))
                });
                admitted.map_err(|err| (index, err))
            })
            .collect()
    }
}

/// The lock rule of a write: while `id` is locked it needs the holder's
/// lease, and a lease it carries must be the current one.
fn lease_rule(
    id: &StateId,
    current: Option<&Lease>,
    lease_id: Option<Uuid>,
) -> Result<Option<Lease>, LockError> {
    match (current, lease_id) {
        (None, None) => Ok(None),
        (Some(lease), Some(given)) if lease.lease_id == given => Ok(Some(lease.clone())),
        (Some(holder), None) => Err(LockError::Locked {
            state_id: id.clone(),
            holder: Box::new(holder.clone()),
        }),
        (_, Some(given)) => Err(LockError::NotCurrent(given)),
    }
}
