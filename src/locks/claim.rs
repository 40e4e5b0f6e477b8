//! The claim protocol in ClickHouse: a gateway proposes a candidate row
//! stamped with the server's clock, lets it settle, and holds the claim once
//! its candidate is the earliest live one.

use std::time::{Duration, Instant};

use uuid::Uuid;

use super::LockManager;
use super::slot::{HeldClaim, LocalLease};
use crate::domain::StateId;
use crate::metrics::LockEvent;
use crate::store::{Candidate, StoreError, now_ms};

/// How often a candidate waiting in line looks whether its turn has come.
const CLAIM_POLL: Duration = Duration::from_millis(100);

/// What one claim attempt came to.
pub(super) enum ClaimOutcome {
    Won(Box<WonClaim>),
    Lost,
}

pub(super) struct WonClaim {
    pub claim: HeldClaim,
    pub next_token: u64,
    /// A lease granted through a gateway that held the claim before, still running.
    pub adopted: Option<LocalLease>,
}

/// A candidate row this attempt proposed. Dropped before the attempt settles
/// it (its future abandoned), it is withdrawn in the background: a live
/// candidate nobody acts on would make every later attempt wait out its TTL.
struct Proposed<'a> {
    manager: &'a LockManager,
    id: StateId,
    candidate: Candidate,
    settled: bool,
}

impl Proposed<'_> {
    /// The attempt decided the candidate's fate itself.
    fn settle(mut self) {
        self.settled = true;
    }
}

impl Drop for Proposed<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.manager
                .withdraw_in_background(self.id.clone(), self.candidate.clone());
        }
    }
}

impl LockManager {
    /// Claims `id`: proposes a candidate, lets it settle, then keeps it in
    /// line (renewed) until it is the earliest live candidate or `deadline`
    /// passes. Staying in line is what makes gateways take turns: the holder
    /// sees the waiting candidate and hands over, and the waiter wins by its
    /// place, not by a race against fresh candidates.
    pub(super) async fn try_claim(
        &self,
        id: &StateId,
        deadline: Instant,
    ) -> Result<ClaimOutcome, StoreError> {
        let gateway_id = self.settings.gateway_id;
        let claim_ttl = self.settings.claim_ttl;
        // Until the proposal is known to have landed its place in line is
        // unknown; a withdrawal (highest version) covers it either way.
        let mut proposed = Proposed {
            manager: self,
            id: id.clone(),
            candidate: Candidate {
                claim_id: Uuid::new_v4(),
                gateway_id,
                created_ms: 0,
            },
            settled: false,
        };
        let mut written_at = Instant::now();
        self.leases
            .propose_claim(id, proposed.candidate.claim_id, gateway_id, claim_ttl)
            .await?;
        tokio::time::sleep(self.settings.settle).await;
        loop {
            let candidates = self.leases.candidates(id).await?;
            let Some(mine) = candidates
                .iter()
                .find(|c| c.claim_id == proposed.candidate.claim_id)
                .cloned()
            else {
                // Our candidate lapsed (a stall longer than the claim TTL).
                proposed.settle();
                self.metrics.lock_event(LockEvent::ClaimLoss);
                return Ok(ClaimOutcome::Lost);
            };
            proposed.candidate = mine;
            let others_waiting = candidates.len() > 1;
            if candidates.first().map(|c| c.claim_id) == Some(proposed.candidate.claim_id) {
                let mut won = self
                    .won(id, proposed.candidate.clone(), written_at, others_waiting)
                    .await?;
                // Won late (a slow ClickHouse, a long line): renew before the
                // winner's grant, so that its lease is not dead on arrival.
                if won
                    .claim
                    .valid_until
                    .saturating_duration_since(Instant::now())
                    < self.grant_margin()
                {
                    let started = Instant::now();
                    self.leases
                        .renew_claims(gateway_id, &[proposed.candidate.claim_id], claim_ttl)
                        .await?;
                    won.claim.valid_until = started + self.claim_margin();
                }
                proposed.settle();
                return Ok(ClaimOutcome::Won(Box::new(won)));
            }
            let now = Instant::now();
            if now >= deadline {
                self.metrics.lock_event(LockEvent::ClaimLoss);
                return Ok(ClaimOutcome::Lost);
            }
            if now.duration_since(written_at) >= claim_ttl / 3 {
                self.leases
                    .renew_claims(gateway_id, &[proposed.candidate.claim_id], claim_ttl)
                    .await?;
                written_at = now;
            }
            tokio::time::sleep(CLAIM_POLL.min(deadline - now)).await;
        }
    }

    /// Takes over a claim just won: the next fencing token, and any lease
    /// still running from a gateway that held the claim before.
    async fn won(
        &self,
        id: &StateId,
        candidate: Candidate,
        written_at: Instant,
        others_waiting: bool,
    ) -> Result<WonClaim, StoreError> {
        let latest = self.leases.latest_lease(id).await?;
        self.metrics.lock_event(LockEvent::ClaimWin);
        let next_token = latest.as_ref().map_or(1, |s| s.lease.fencing_token + 1);
        // A lease granted through a gateway that went away is still the
        // current one until it ends: adopt it rather than break it.
        let adopted = latest.filter(|s| s.live).map(|stored| {
            let remaining = u64::try_from(stored.lease.expires_ms - now_ms()).unwrap_or(0);
            LocalLease {
                version: stored.version,
                deadline: Instant::now() + Duration::from_millis(remaining),
                lease: stored.lease,
            }
        });
        Ok(WonClaim {
            claim: HeldClaim {
                candidate,
                valid_until: written_at + self.claim_margin(),
                handover: others_waiting,
            },
            next_token,
            adopted,
        })
    }

    /// How long a claim written at some instant is surely still live: its TTL
    /// less a tenth for clock rate and scheduling slack.
    pub(super) fn claim_margin(&self) -> Duration {
        self.settings.claim_ttl - self.settings.claim_ttl / 10
    }

    /// The least validity a claim must have left for a grant under it: a
    /// claim won late (a slow ClickHouse, a long line) is renewed before it
    /// grants, so that no lease is dead on arrival. Background renewals keep
    /// a held claim above this.
    pub(super) fn grant_margin(&self) -> Duration {
        self.settings.claim_ttl / 2
    }

    /// Withdraws a claim without making anyone wait for it (a drop guard, a
    /// hand-over): nothing here depends on its landing before the caller goes on.
    pub(super) fn withdraw_in_background(&self, id: StateId, candidate: Candidate) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let leases = self.leases.clone();
        runtime.spawn(async move {
            if let Err(err) = leases.withdraw_claim(&id, &candidate).await {
                tracing::warn!(state_id = %id, error = %err, "could not withdraw a claim");
            }
        });
    }
}
