//! What both claim protocols share: this gateway as a claimant (who it is,
//! where lease rows are kept, the claim timing) and the steps every claim
//! attempt takes the same way, whichever protocol it speaks: waiting in
//! line, giving up at the deadline, renewing a claim won late, and taking
//! over what the id's lease rows leave to a claim just won.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::protocol::ClaimOutcome;
use crate::config::LockSettings;
use crate::domain::{Lease, LeaseState, StateId};
use crate::locks::slot::{Delay, HeldClaim, Inherited, Lapsed, LocalLease};
use crate::locks::timing::ClaimTiming;
use crate::metrics::{LockEvent, Metrics};
use crate::store::{LeaseStore, StoreError, StoredLease, now_ms};

/// Fencing tokens reserved per ClickHouse write: a claim holder hands out
/// this many before it writes again.
pub(super) const TOKENS_PER_BLOCK: u64 = 1024;

/// How often a gateway waiting in line for a claim looks whether its turn
/// has come.
const CLAIM_POLL: Duration = Duration::from_millis(100);

/// This gateway's side of either claim protocol: where lease rows are
/// kept, and the settings its claims' timing comes from.
pub(super) struct Claimant {
    /// The lease table: lease rows, reserved tokens, and in table mode the
    /// claim candidates.
    pub leases: LeaseStore,
    /// This gateway's id and advertised URL, written with its claims.
    pub settings: LockSettings,
    /// Every wait and margin derived from the claim TTL, the settle time
    /// and the query timeout.
    pub timing: ClaimTiming,
    /// Where claim wins and losses are counted.
    pub metrics: Arc<Metrics>,
}

impl Claimant {
    /// This gateway's id, written with its claims.
    pub fn gateway_id(&self) -> Uuid {
        self.settings.gateway_id
    }

    /// How peers reach this gateway, written with its claims; empty when
    /// they cannot.
    pub fn advertise_url(&self) -> &str {
        self.settings.advertise_url.as_deref().unwrap_or("")
    }

    /// An attempt that did not win, counted.
    pub fn lost(&self) -> ClaimOutcome {
        self.metrics.lock_event(LockEvent::ClaimLoss);
        ClaimOutcome::Lost
    }

    /// An attempt that did not win but saw no other gateway's claim, counted.
    pub fn unsettled(&self) -> ClaimOutcome {
        self.metrics.lock_event(LockEvent::ClaimLoss);
        ClaimOutcome::Unsettled
    }

    /// How long an attempt waiting in line sleeps before it looks again: a
    /// poll, cut short at `deadline`. None once `deadline` has passed: the
    /// attempt gives up (see [`Claimant::lost`]).
    pub fn next_poll(&self, deadline: Instant) -> Option<Duration> {
        let now = Instant::now();
        (now < deadline).then(|| CLAIM_POLL.min(deadline - now))
    }

    /// A claim won late (a slow ClickHouse or Keeper, a long line) is
    /// renewed before the winner's grant, so that its lease is not dead on
    /// arrival. `renew` writes the renewal and answers whether it landed;
    /// false here: the claim lapsed before it did (it keeps the validity it
    /// was won with).
    pub async fn renew_if_late<F>(
        &self,
        claim: &mut HeldClaim,
        renew: impl FnOnce() -> F,
    ) -> Result<bool, StoreError>
    where
        F: Future<Output = Result<bool, StoreError>>,
    {
        if !self
            .timing
            .renew_before_grant(claim.valid_until, Instant::now())
        {
            return Ok(true);
        }
        let started = Instant::now();
        let renewed = renew().await?;
        if renewed {
            claim.valid_until = self.timing.valid_until(started);
        }
        Ok(renewed)
    }

    /// Runs a claim withdrawal without making anyone wait for it; a failure
    /// is logged, as nobody is left to answer.
    pub fn in_background(
        &self,
        id: StateId,
        withdraw: impl Future<Output = Result<(), StoreError>> + Send + 'static,
    ) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            if let Err(err) = withdraw.await {
                tracing::warn!(state_id = %id, error = %err, "could not withdraw a claim");
            }
        });
    }

    /// What this gateway takes over with a claim just won, from the id's
    /// lease rows: leases handed on at a shutdown and still running, leases
    /// whose authority is gone (see [`orphaned`]), and the lock-delays of
    /// ended ones (see [`place_end`]). The rows of the leases that
    /// `readopting` keeps are this gateway's own, running on.
    pub fn inherit(&self, rows: Vec<StoredLease>, readopting: Option<&Lapsed>) -> Inherited {
        let (now, now_ms) = (Instant::now(), now_ms());
        let mut inherited = Inherited::default();
        let kept = |stored: &StoredLease| {
            readopting.is_some_and(|l| l.leases.contains(&stored.record.lease.lease_id))
        };
        let until_expiry = |lease: &Lease| {
            let remaining = u64::try_from(lease.expires_ms - now_ms).unwrap_or(0);
            now + Duration::from_millis(remaining)
        };
        for stored in rows.into_iter().filter(|stored| !kept(stored)) {
            if stored.unexpired && stored.record.state == LeaseState::HandedOver {
                let record = stored.record;
                inherited.leases.push(LocalLease {
                    deadline: until_expiry(&record.lease),
                    version: record.version.renewed(),
                    lease: Lease {
                        gateway_id: self.settings.gateway_id,
                        ..record.lease
                    },
                });
            } else if orphaned(&stored, now_ms) {
                let record = stored.record;
                inherited.orphaned.push(LocalLease {
                    deadline: until_expiry(&record.lease),
                    version: record.version,
                    lease: record.lease,
                });
            } else if let Some(free_at) = place_end(&stored, now_ms) {
                let slots = stored.record.lease.slots;
                inherited
                    .delays
                    .push(Delay::ending(free_at, slots, now, now_ms));
            }
        }
        inherited
    }
}

/// Whether a recorded lease is held, not in force, by a gateway that lost
/// its claim (it crashed, froze, or its renewals did not land) before the
/// lease would have expired. Its holder may run on unaware until its next
/// renewal, and its authority may only be frozen: nobody else is granted
/// the place before then (design.md, "Several gateways"), and an acquire
/// refused meanwhile names it as the holder, though its holder's renewals
/// and writes are refused from the take-over on.
pub(super) fn orphaned(stored: &StoredLease, now_ms: i64) -> bool {
    let record = &stored.record;
    record.state == LeaseState::Held
        && record.ended_ms.is_none()
        && record.lease.expires_ms > now_ms
}

/// Until when a recorded lease that has ended keeps its place, if that is
/// still to come: its lock-delay after its end. A release or force-unlock
/// recorded its end; any other lease ended at its expiry.
pub(super) fn place_end(stored: &StoredLease, now_ms: i64) -> Option<i64> {
    let record = &stored.record;
    let ended = record.ended_ms.unwrap_or(record.lease.expires_ms);
    let free_at = record.lease.free_at_ms(ended);
    (free_at > now_ms).then_some(free_at)
}
