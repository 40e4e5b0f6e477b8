//! The lock handle every request shares: a short surface over the parts of
//! the lock core (see the invariants in `locks`). It owns the slots, the
//! claim protocol, the lease recorder, the router to peers and the tickets
//! it issued; the acquire loop (`acquire`), the write rule (`write`) and
//! the background task (`maintain`) work on those parts, never on the handle.
//! Its side of writes, admissions and tickets, is `manager::admission`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderMap, Request, Response};
use uuid::Uuid;

use super::acquire::{Acquirer, Ask};
use super::claim::Coordinator;
use super::error::LockError;
use super::forward::{ForwardError, Router};
use super::issued::Issued;
use super::maintain::Maintenance;
use super::occupancy::Occupancy;
use super::peer::{FORWARDED_BY, FORWARDED_TO, Peer, Route, SeenLease};
use super::record::{Recorder, ended_row, withdraw_after_rows};
use super::slot::{LeaseAct, Released, SlotState};
use super::slots::Slots;
use super::timing::ClaimTiming;
use super::write_claim::RecentWrites;
use crate::config::LockSettings;
use crate::domain::{Forced, Lease, StateId};
use crate::metrics::{LockEvent, Metrics};
use crate::store::{KeeperClaimStore, LeaseStore, now_ms};

pub struct LockManager {
    settings: LockSettings,
    /// The longest one ClickHouse round trip may take: what a write under a
    /// lease that just ended may keep the next grant waiting.
    query_timeout: Duration,
    /// The slot of every state_id this gateway has business with.
    slots: Arc<Slots>,
    /// The claim protocol (`--coordination`).
    coordinator: Arc<Coordinator>,
    /// Lease rows on their way to ClickHouse.
    recorder: Arc<Recorder>,
    leases: LeaseStore,
    metrics: Arc<Metrics>,
    /// Where requests about an id go, and the client to peers.
    router: Router,
    /// Admissions this gateway, as authority, gave writes another gateway sends.
    issued: Issued,
    /// Ids written here lately with no claim anywhere: a repeat claims them.
    recent_writes: Arc<RecentWrites>,
}

impl LockManager {
    pub fn new(
        settings: LockSettings,
        query_timeout: Duration,
        leases: LeaseStore,
        keeper: KeeperClaimStore,
        metrics: Arc<Metrics>,
    ) -> Self {
        let leases = leases.advertised_at(settings.advertise_url.as_deref());
        let coordinator = Arc::new(Coordinator::new(
            settings.clone(),
            ClaimTiming::new(&settings, query_timeout),
            leases.clone(),
            keeper,
            metrics.clone(),
        ));
        // A repeat within the idle time of a claim is worth one.
        let recent_writes = Arc::new(RecentWrites::new(coordinator.timing().idle_release()));
        Self {
            router: Router::new(&settings),
            settings,
            query_timeout,
            slots: Arc::new(Slots::new(metrics.clone())),
            coordinator,
            recorder: Arc::new(Recorder::new(leases.clone())),
            leases,
            metrics,
            issued: Issued::default(),
            recent_writes,
        }
    }

    fn maintenance(&self) -> Maintenance {
        Maintenance {
            slots: self.slots.clone(),
            coordinator: self.coordinator.clone(),
            recorder: self.recorder.clone(),
            leases: self.leases.clone(),
        }
    }

    /// The background task: renews claims, lets idle ones go, writes lease
    /// rows. Runs until dropped.
    pub async fn maintain(self: Arc<Self>) {
        self.maintenance().run().await;
    }

    /// Hands every claim and lease back at shutdown (see `maintain`).
    pub async fn hand_back(&self) {
        self.maintenance().hand_back().await;
    }

    /// The claim this gateway holds on `id`, if it is the id's authority: as
    /// long as it holds that claim, every write to the id comes through it.
    pub fn authority_claim(&self, id: &StateId) -> Option<Uuid> {
        self.slots.authority_claim(id)
    }

    /// The claim this gateway holds on `id` while a lease runs under it.
    pub fn leased_claim(&self, id: &StateId) -> Option<Uuid> {
        self.slots.leased_claim(id)
    }

    /// Whether no write under this gateway's claim on `id` may still land.
    pub fn nothing_landing(&self, id: &StateId) -> bool {
        self.slots.nothing_landing(id)
    }

    /// Grants a lease on `id`, one of `ask.limit` at a time, waiting up to
    /// `ask.wait` behind earlier waiters; a first acquire still runs one
    /// claim attempt (settle included) even with no wait at all. The lease
    /// carries the ask's lock-delay, cut to `--max-lock-delay`, and its info.
    pub async fn acquire(&self, id: &StateId, ask: Ask) -> Result<Lease, LockError> {
        Acquirer {
            slots: &self.slots,
            coordinator: &self.coordinator,
            recorder: &self.recorder,
            settings: &self.settings,
        }
        .acquire(
            id,
            Ask {
                lock_delay: ask.lock_delay.min(self.settings.max_lock_delay),
                ..ask
            },
        )
        .await
    }

    /// Extends the current lease by `ttl` from now.
    pub async fn renew(
        &self,
        id: &StateId,
        lease_id: Uuid,
        ttl: Duration,
    ) -> Result<Lease, LockError> {
        if let Some(slot) = self.slots.existing(id) {
            let renewed = slot.apply_current(id, &self.metrics, |st, now| {
                st.renew(lease_id, ttl, now, now_ms())
            });
            match renewed {
                LeaseAct::Done((renewed, version)) => {
                    self.recorder.held(&renewed, version);
                    self.recorder.landed().await?;
                    self.metrics.lock_event(LockEvent::Renewal);
                    return Ok(renewed);
                }
                LeaseAct::Lapsed => return Err(LockError::Lapsed(id.clone())),
                LeaseAct::Unknown => {}
            }
        }
        Err(self.not_here(id, lease_id).await)
    }

    /// Releases the lease if it is the current one.
    pub async fn release(&self, id: &StateId, lease_id: Uuid) -> Result<(), LockError> {
        if let Some(slot) = self.slots.existing(id) {
            let released = slot.apply_current_recording(
                id,
                &self.metrics,
                |st, now| st.release(lease_id, now),
                |released| {
                    if let Some(Released { lease, .. }) = released {
                        self.recorder.released(lease.lease.clone(), lease.version);
                    }
                },
            );
            if let Some(Released { withdraw, .. }) = released {
                self.metrics.lock_event(LockEvent::Release);
                if let Some(candidate) = withdraw {
                    withdraw_after_rows(&self.recorder, &self.coordinator, id.clone(), candidate);
                }
                return Ok(());
            }
        }
        Err(self.not_here(id, lease_id).await)
    }

    /// Why `lease_id` is not a lease this gateway can act on.
    async fn not_here(&self, id: &StateId, lease_id: Uuid) -> LockError {
        match self.coordinator.authority(id, false).await {
            Ok(authority) => match authority
                .in_force()
                .map(|stored| &stored.record.lease)
                .find(|lease| lease.lease_id == lease_id)
            {
                Some(lease) if lease.gateway_id != self.settings.gateway_id => {
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

    /// Ends every lease `id` has, recording who did it and why (`forced`).
    /// Answers whether there was one.
    pub async fn force_unlock(&self, id: &StateId, forced: Forced) -> Result<bool, LockError> {
        if let Some(slot) = self.slots.existing(id) {
            let at_ms = now_ms();
            let ended = slot.apply_current_recording(
                id,
                &self.metrics,
                |st, now| st.force_unlock(now, at_ms),
                |ended| {
                    for local in ended.iter().flatten() {
                        self.recorder.forced(
                            local.lease.clone(),
                            local.version,
                            at_ms,
                            forced.clone(),
                        );
                    }
                },
            );
            if let Some(ended) = ended {
                let had_lease = !ended.is_empty();
                for _ in &ended {
                    self.metrics.lock_event(LockEvent::ForcedRelease);
                }
                self.recorder.landed().await?;
                return Ok(had_lease);
            }
        }
        // No claim here: a lease handed on at a shutdown, or one held through
        // a gateway that cannot be forwarded to, which sees the mark at its
        // next maintenance tick and stops honouring the lease.
        let at_ms = now_ms();
        let ended: Vec<_> = self
            .coordinator
            .authority(id, false)
            .await?
            .in_force()
            .map(|stored| {
                let record = stored.record.clone();
                ended_row(record.lease, record.version, at_ms, Some(forced.clone()))
            })
            .collect();
        if ended.is_empty() {
            return Ok(false);
        }
        self.leases.write_leases(&ended).await?;
        for _ in &ended {
            self.metrics.lock_event(LockEvent::ForcedRelease);
        }
        Ok(true)
    }

    /// The current lease of `id`: this gateway's own when it is the
    /// authority (or keeps it under a lapsed claim: it still holds the id),
    /// else what ClickHouse records (as `seen` while routing the request, if
    /// that is fresh).
    pub async fn current(
        &self,
        id: &StateId,
        seen: Option<&SeenLease>,
    ) -> Result<Option<Lease>, LockError> {
        self.lease_by(id, seen, |st| st.lease().cloned()).await
    }

    /// Who holds `id`, as `GET /v1/locks/{state_id}` shows it: as
    /// [`LockManager::current`], and where this gateway is the authority and
    /// no lease of its own holds the id, an earlier authority's lease that
    /// keeps its place here, the holder a refused acquire is told of.
    pub async fn holder(
        &self,
        id: &StateId,
        seen: Option<&SeenLease>,
    ) -> Result<Option<Lease>, LockError> {
        self.lease_by(id, seen, |st| st.holder().cloned()).await
    }

    async fn lease_by(
        &self,
        id: &StateId,
        seen: Option<&SeenLease>,
        of: fn(&SlotState) -> Option<Lease>,
    ) -> Result<Option<Lease>, LockError> {
        if let Some(slot) = self.slots.existing(id)
            && let Some(lease) =
                slot.current(id, &self.metrics, |st| st.answers_for().then(|| of(st)))
        {
            return Ok(lease);
        }
        Ok(self.coordinator.recorded_lease(id, seen).await?)
    }

    /// Every current lease: ClickHouse's record, with this gateway's own
    /// leases as they are now (their rows may still be on their way).
    pub async fn all(&self) -> Result<Vec<Lease>, LockError> {
        Ok(self
            .occupancies()
            .await?
            .into_iter()
            .flat_map(|o| o.holders)
            .collect())
    }

    /// Who holds `id` and how many wait: this gateway's slot when it is the
    /// id's authority, else ClickHouse's record. None when none holds or waits.
    pub async fn occupancy(&self, id: &StateId) -> Result<Option<Occupancy>, LockError> {
        if let Some(slot) = self.slots.existing(id)
            && let Some(here) = slot.current(id, &self.metrics, |st| {
                st.answers_for().then(|| Occupancy::of(id, st))
            })
        {
            return Ok(here);
        }
        let holders: Vec<Lease> = self
            .coordinator
            .recorded_leases()
            .await?
            .into_iter()
            .filter(|lease| &lease.state_id == id)
            .collect();
        Ok(Occupancy::recorded(id.clone(), holders))
    }

    /// Every id held or waited on, by id: ClickHouse's record, with this
    /// gateway's own slots as they are now (their rows may still be on
    /// their way, and only the authority knows who waits).
    pub async fn occupancies(&self) -> Result<Vec<Occupancy>, LockError> {
        let mut recorded: BTreeMap<StateId, Vec<Lease>> = BTreeMap::new();
        for lease in self.coordinator.recorded_leases().await? {
            recorded
                .entry(lease.state_id.clone())
                .or_default()
                .push(lease);
        }
        let mut by_id: BTreeMap<StateId, Option<Occupancy>> = recorded
            .into_iter()
            .map(|(id, holders)| (id.clone(), Occupancy::recorded(id, holders)))
            .collect();
        for (id, slot) in self.slots.snapshot() {
            if let Some(here) = slot.current(&id, &self.metrics, |st| {
                st.claim_id().map(|_| Occupancy::of(&id, st))
            }) {
                by_id.insert(id, here);
            }
        }
        Ok(by_id.into_values().flatten().collect())
    }

    /// The ids this gateway is the authority for that someone holds or
    /// waits on, by id.
    pub fn local_occupancies(&self) -> Vec<Occupancy> {
        let mut here: Vec<Occupancy> = self
            .slots
            .snapshot()
            .into_iter()
            .filter_map(|(id, slot)| {
                slot.current(&id, &self.metrics, |st| {
                    st.answers_for().then(|| Occupancy::of(&id, st)).flatten()
                })
            })
            .collect();
        here.sort_by(|a, b| a.id.cmp(&b.id));
        here
    }

    /// Where requests about `id` go (see `forward`). `remembered` allows an
    /// authority looked up lately instead of asking ClickHouse; `with_row`
    /// reads the id's current row in the same statement, for a write that
    /// may be served here (see [`LockManager::seen_at`]).
    pub async fn route(
        &self,
        id: &StateId,
        remembered: bool,
        with_row: bool,
    ) -> Result<Route, LockError> {
        self.router
            .route(id, remembered, with_row, &self.slots, &self.coordinator)
            .await
    }

    /// When the routing read that saw `seen` was asked for, while what it
    /// found stands in for a fresh read (see [`LockManager::check_write`]):
    /// a write may then take the current row that read found, which the
    /// store keeps (`StateStore::take_read_ahead`).
    pub fn seen_at(&self, seen: Option<&SeenLease>) -> Option<Instant> {
        seen.map(|s| s.at)
            .filter(|&at| self.coordinator.seen_fresh(at))
    }

    /// How long a routing read's findings stand in for a fresh read.
    pub fn seen_fresh(&self) -> Duration {
        self.coordinator.timing().seen_lease_fresh()
    }

    /// The gateway a forwarded request was sent to (`FORWARDED_TO`), if it
    /// is not this one: the request is refused, acting on nothing.
    pub fn meant_for_another(&self, headers: &HeaderMap) -> Option<Uuid> {
        if !headers.contains_key(FORWARDED_BY) {
            return None;
        }
        let asked = headers.get(FORWARDED_TO)?.to_str().ok()?;
        Uuid::parse_str(asked)
            .ok()
            .filter(|asked| *asked != self.settings.gateway_id)
    }

    /// This gateway's id.
    pub fn gateway_id(&self) -> Uuid {
        self.settings.gateway_id
    }

    /// The peer looked up for `id` turned out not to be its authority.
    pub fn forget_authority(&self, id: &StateId) {
        self.router.forget_authority(id);
    }

    /// Sends `request` to `peer` (see `forward::Router::forward`).
    pub async fn forward(
        &self,
        peer: &Peer,
        request: Request<Body>,
        answer_within: Duration,
        patience: Duration,
    ) -> Result<Response<Body>, ForwardError> {
        self.router
            .forward(peer, request, answer_within, patience)
            .await
    }
}

mod admission;
