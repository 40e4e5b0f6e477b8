//! The background side of locks: recording lease rows, renewing claims,
//! handing them over, letting idle ones go, noticing leases force-unlocked
//! through a gateway that could not forward to this one, and handing
//! everything back at shutdown. Each tick takes a few batched ClickHouse
//! round trips for all slots, and no slot's lock is held across any of them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::claim::{ClaimOutcome, Coordinator};
use super::record::Recorder;
use super::slot::{ClaimAttempt, Lapsed, Slot, SlotState, Tick};
use super::slots::Slots;
use crate::domain::{Lease, LeaseState, StateId};
use crate::metrics::LockEvent;
use crate::store::{LeaseRecord, LeaseStore, now_ms};

/// The background task of the locks, apart from the handle requests use:
/// it shares the handle's slots, claim protocol and lease recorder.
pub(super) struct Maintenance {
    pub slots: Arc<Slots>,
    pub coordinator: Arc<Coordinator>,
    pub recorder: Arc<Recorder>,
    pub leases: LeaseStore,
}

impl Maintenance {
    /// Runs until dropped.
    pub async fn run(self) {
        let claims = async {
            let mut tick = tokio::time::interval(self.coordinator.timing().renew_interval());
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                self.maintain_once().await;
            }
        };
        tokio::join!(
            claims,
            self.recorder.run(),
            self.coordinator.keep_membership()
        );
    }

    async fn maintain_once(&self) {
        let mut withdrawn = Vec::new();
        let mut held: Vec<(StateId, Uuid)> = Vec::new();
        let mut leases: Vec<Lease> = Vec::new();
        let idle_release = self.coordinator.timing().idle_release();
        for (id, slot) in self.slots.snapshot() {
            let metrics = self.slots.metrics();
            let tick = slot.apply_current(&id, metrics, |st, now| st.tick(now, idle_release));
            match tick {
                Tick::Gone(claim_id) => withdrawn.push((id, claim_id)),
                Tick::Held(claim_id, holders) => {
                    held.push((id, claim_id));
                    leases.extend(holders);
                }
                // Its own task: a table-mode attempt waits out the settle.
                Tick::Lapsed(lapsed) => {
                    tokio::spawn(self.reclaim(id, slot, lapsed));
                }
                Tick::Unclaimed => {}
            }
        }
        // Handed over or idle: the gateway that claims an id next must read
        // how its leases ended (see `record::withdraw_after_rows`), where a
        // release just queued would keep its place until it would expire.
        if !withdrawn.is_empty()
            && let Err(err) = self.recorder.flush().await
        {
            tracing::warn!(error = %err, claims = withdrawn.len(), "lease rows not written before claims were given up");
        }
        if !withdrawn.is_empty()
            && let Err(err) = self.coordinator.withdraw_claims(&withdrawn).await
        {
            // They expire by themselves; until then they only delay other gateways.
            tracing::warn!(error = %err, claims = withdrawn.len(), "could not withdraw idle claims");
        }
        if !held.is_empty() {
            self.renew_held(&held).await;
            self.notice_contested(&held).await;
            self.notice_force_unlocks(&leases).await;
        }
        self.slots.forget_idle();
    }

    async fn renew_held(&self, held: &[(StateId, Uuid)]) {
        let started = Instant::now();
        let lost = match self.coordinator.renew_claims(held).await {
            Ok(lost) => lost,
            Err(err) => {
                tracing::warn!(error = %err, claims = held.len(), "could not renew claims; they lapse if this goes on");
                return;
            }
        };
        let valid_until = self.coordinator.timing().valid_until(started);
        let metrics = self.slots.metrics();
        for (id, claim_id) in held {
            if let Some(slot) = self.slots.existing(id) {
                if lost.contains(claim_id) {
                    slot.apply(|st, _| st.claim_refused(id, *claim_id, metrics));
                } else {
                    slot.apply(|st, now| st.claim_renewed(*claim_id, valid_until, now));
                }
            }
        }
    }

    /// Tries to re-win `lapsed`, a claim of this gateway's that lapsed with
    /// leases kept (the tick marked the attempt under way). Re-won with
    /// nothing in between, they run on; the id found claimed elsewhere, they
    /// end; Keeper or ClickHouse still out of reach, they stay kept for the
    /// next tick.
    fn reclaim(
        &self,
        id: StateId,
        slot: Arc<Slot>,
        lapsed: Lapsed,
    ) -> impl Future<Output = ()> + Send + 'static {
        let (coordinator, recorder) = (self.coordinator.clone(), self.recorder.clone());
        let slots = self.slots.clone();
        async move {
            let attempt = ClaimAttempt::under_way(&slot);
            let outcome = coordinator
                .try_claim(&id, Instant::now(), Some(&lapsed))
                .await;
            drop(attempt);
            match outcome {
                Ok(ClaimOutcome::Won(won)) => {
                    let readopted = won.readopted;
                    let budget = coordinator.timing().write_budget();
                    let adopted = slot.apply(|st, now| st.claim_rewon(*won, now, budget));
                    for (lease, version) in adopted {
                        recorder.held(&lease, version);
                    }
                    if readopted {
                        slots.metrics().lock_event(LockEvent::ClaimReadopted);
                        tracing::info!(state_id = %id, leases = lapsed.leases.len(), "lapsed claim re-won with nothing in between: its leases run on");
                    } else {
                        tracing::warn!(state_id = %id, "the id was claimed elsewhere while its claim had lapsed: its kept leases end");
                    }
                }
                Ok(ClaimOutcome::Elsewhere(_) | ClaimOutcome::Lost) => {
                    slot.apply(|st, _| st.lapse_refused(lapsed.claim.claim_id));
                    tracing::warn!(state_id = %id, "the id is claimed elsewhere since its claim lapsed: its kept leases end");
                }
                // Too slow to win, with no other gateway's claim seen: the
                // next tick tries again.
                Ok(ClaimOutcome::Unsettled) => {
                    tracing::warn!(state_id = %id, "could not re-win a lapsed claim in time; its leases stay kept, answering 503");
                }
                Err(err) => {
                    tracing::warn!(state_id = %id, error = %err, "could not re-win a lapsed claim yet; its leases stay kept, answering 503");
                }
            }
        }
    }

    /// Marks the claims another gateway waits for, to hand them over.
    async fn notice_contested(&self, held: &[(StateId, Uuid)]) {
        let ids: Vec<StateId> = held.iter().map(|(id, _)| id.clone()).collect();
        let Ok(contested) = self.coordinator.contested(&ids).await else {
            return;
        };
        for (id, claim_id) in held {
            if let Some(slot) = self.slots.existing(id) {
                slot.apply(|st, _| st.contested(*claim_id, contested.contains(id)));
            }
        }
    }

    async fn notice_force_unlocks(&self, leases: &[Lease]) {
        if leases.is_empty() {
            return;
        }
        let refs: Vec<&Lease> = leases.iter().collect();
        let Ok(released) = self.leases.released_among(&refs).await else {
            return;
        };
        for lease in leases.iter().filter(|l| released.contains(&l.lease_id)) {
            if let Some(slot) = self.slots.existing(&lease.state_id) {
                slot.apply(|st, now| st.forced_elsewhere(lease.lease_id, now, now_ms()));
            }
        }
    }

    /// Hands everything back at shutdown: each current lease is recorded as
    /// handed over (the next authority adopts it), writes on their way land,
    /// every pending row is written, and only then are the claims withdrawn,
    /// so that no other gateway waits for them to lapse. The caller bounds
    /// how long this takes.
    pub async fn hand_back(&self) {
        let mut claims = Vec::new();
        for (id, slot) in self.slots.snapshot() {
            let Some((claim_id, handed)) = slot.apply(|st, _| st.hand_back()) else {
                continue;
            };
            claims.push((id, claim_id));
            for local in handed {
                self.recorder.record(LeaseRecord {
                    lease: local.lease,
                    version: local.version.renewed(),
                    state: LeaseState::HandedOver,
                    ended_ms: None,
                    forced: None,
                });
            }
        }
        // The claims are taken first, so a write not yet sent is refused; one
        // sent may still land, and the next authority must read it.
        self.writes_landed().await;
        let mut pause = Duration::from_millis(100);
        while let Err(err) = self.recorder.flush().await {
            tracing::warn!(error = %err, retry_in = ?pause, "could not record leases before handing them back");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
        }
        if claims.is_empty() {
            return;
        }
        if let Err(err) = self.coordinator.withdraw_claims(&claims).await {
            tracing::warn!(error = %err, claims = claims.len(), "could not withdraw claims; they lapse by themselves");
        }
    }

    /// Waits until no write sent under a claim here may still land: each has
    /// an end of its own, within the query timeout.
    async fn writes_landed(&self) {
        loop {
            let landing = self
                .slots
                .snapshot()
                .into_iter()
                .filter_map(|(id, slot)| {
                    slot.current(&id, self.slots.metrics(), SlotState::landing_until)
                })
                .max();
            let Some(until) = landing else { return };
            tokio::time::sleep_until(until.into()).await;
        }
    }
}
