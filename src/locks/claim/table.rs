//! `--coordination table`: a gateway proposes a candidate row in the lease
//! table, stamped with the server's clock, lets it settle, and holds the
//! claim once its candidate is the earliest live one. Correct only while
//! every gateway's queries reach one ClickHouse node.

use std::time::Instant;

use uuid::Uuid;

use super::Coordinator;
use super::{CLAIM_POLL, ClaimOutcome, TOKENS_PER_BLOCK, WonClaim};
use crate::domain::StateId;
use crate::locks::peer::Peer;
use crate::locks::slot::{HeldClaim, Lapsed, TokenBlock};
use crate::metrics::LockEvent;
use crate::store::{Candidate, IdLocks, StoreError, StoredLease};

/// A candidate row this attempt proposed. Dropped before the attempt settles
/// it (its future abandoned), it is withdrawn in the background: a live
/// candidate nobody acts on would make every later attempt wait out its TTL.
struct Proposed<'a> {
    coordinator: &'a Coordinator,
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
            self.coordinator
                .withdraw_in_background(self.id.clone(), self.candidate.clone());
        }
    }
}

impl Coordinator {
    /// Claims `id`: proposes a candidate, lets it settle, and wins if it is
    /// the earliest live candidate. When a gateway with an advertised URL is
    /// earlier, the attempt withdraws and the request is forwarded there.
    /// When the earlier one cannot be forwarded to, the candidate stays in
    /// line (renewed) until it is the earliest or `deadline` passes: the
    /// holder sees it waiting and hands over, and the waiter wins by its
    /// place, not by a race against fresh candidates.
    pub(super) async fn claim_in_table(
        &self,
        id: &StateId,
        deadline: Instant,
        lapsed: Option<&Lapsed>,
    ) -> Result<ClaimOutcome, StoreError> {
        let gateway_id = self.settings.gateway_id;
        let claim_ttl = self.timing.ttl();
        // Until the proposal is known to have landed its place in line is
        // unknown; a withdrawal (highest version) covers it either way.
        let mut proposed = Proposed {
            coordinator: self,
            id: id.clone(),
            candidate: Candidate {
                claim_id: Uuid::new_v4(),
                gateway_id,
                created_ms: 0,
                advertise_url: String::new(),
                expires_ms: 0,
            },
            settled: false,
        };
        let mut written_at = Instant::now();
        self.leases
            .propose_claim(
                id,
                proposed.candidate.claim_id,
                gateway_id,
                self.settings.advertise_url.as_deref().unwrap_or(""),
                claim_ttl,
            )
            .await?;
        tokio::time::sleep(self.timing.settle()).await;
        loop {
            let IdLocks { candidates, leases } = self.leases.id_locks(id).await?;
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
            if let Some(first) = candidates
                .first()
                .filter(|c| c.gateway_id != gateway_id && !c.advertise_url.is_empty())
            {
                // Dropping `proposed` withdraws our candidate.
                return Ok(ClaimOutcome::Elsewhere(Peer::of(first)));
            }
            // Gateways peers can reach forward to the winner instead of waiting.
            let others_waiting = candidates
                .iter()
                .any(|c| c.claim_id != proposed.candidate.claim_id && c.advertise_url.is_empty());
            if candidates.first().map(|c| c.claim_id) == Some(proposed.candidate.claim_id) {
                let mut won = self
                    .won(
                        id,
                        proposed.candidate.clone(),
                        written_at,
                        others_waiting,
                        leases,
                        lapsed,
                    )
                    .await?;
                // Won late (a slow ClickHouse, a long line): renew before the
                // winner's grant, so that its lease is not dead on arrival.
                if self
                    .timing
                    .renew_before_grant(won.claim.valid_until, Instant::now())
                {
                    let started = Instant::now();
                    let renewed = self
                        .leases
                        .renew_claims(gateway_id, &[proposed.candidate.claim_id], claim_ttl)
                        .await?;
                    if renewed.is_empty() {
                        // Lapsed before the renewal landed: won too late.
                        proposed.settle();
                        self.metrics.lock_event(LockEvent::ClaimLoss);
                        return Ok(ClaimOutcome::Lost);
                    }
                    won.claim.valid_until = self.timing.valid_until(started);
                }
                proposed.settle();
                return Ok(ClaimOutcome::Won(Box::new(won)));
            }
            let now = Instant::now();
            if now >= deadline {
                self.metrics.lock_event(LockEvent::ClaimLoss);
                return Ok(ClaimOutcome::Lost);
            }
            if now.duration_since(written_at) >= self.timing.renew_interval() {
                // One that lapsed meanwhile is missing from the next read.
                self.leases
                    .renew_claims(gateway_id, &[proposed.candidate.claim_id], claim_ttl)
                    .await?;
                written_at = now;
            }
            tokio::time::sleep(CLAIM_POLL.min(deadline - now)).await;
        }
    }

    /// Takes over a claim just won: a block of fencing tokens above every
    /// token before, and what the id's lease rows leave to it. `rows` were
    /// read with the candidates that showed the win: a gateway hands its
    /// leases on before it withdraws its claims, so a read that sees the
    /// withdrawal sees the hand-over too. With `lapsed`, the win re-adopts
    /// its kept leases if nothing shows another claim or grant since.
    async fn won(
        &self,
        id: &StateId,
        candidate: Candidate,
        written_at: Instant,
        others_waiting: bool,
        rows: Vec<StoredLease>,
        lapsed: Option<&Lapsed>,
    ) -> Result<WonClaim, StoreError> {
        let readopting = match lapsed {
            Some(lapsed) if self.nothing_since(id, lapsed, &rows).await? => Some(lapsed),
            _ => None,
        };
        let tokens = self.reserve_in_table(id, 0).await?;
        self.metrics.lock_event(LockEvent::ClaimWin);
        Ok(WonClaim {
            claim: HeldClaim {
                candidate,
                valid_until: self.timing.valid_until(written_at),
                handover: others_waiting,
            },
            tokens,
            inherited: self.inherit(rows, readopting),
            readopted: readopting.is_some(),
        })
    }

    /// Whether nothing shows another claim or grant on `id` since `lapsed`
    /// was made: no other gateway's candidate row (in line, won, withdrawn
    /// or lapsed: any may have won while ours had lapsed), and no lease row
    /// of another gateway's granted since.
    async fn nothing_since(
        &self,
        id: &StateId,
        lapsed: &Lapsed,
        rows: &[StoredLease],
    ) -> Result<bool, StoreError> {
        let me = self.settings.gateway_id;
        let since_ms = lapsed.claim.created_ms;
        if !granted_only_by(rows, me, since_ms) {
            return Ok(false);
        }
        Ok(!self.leases.claimed_since(id, me, since_ms).await?)
    }

    /// Reserves the next block of fencing tokens for `id`, above every token
    /// reserved or recorded so far (and at least `first`); the reservation is
    /// written before any of them is handed out.
    pub(super) async fn reserve_in_table(
        &self,
        id: &StateId,
        first: u64,
    ) -> Result<TokenBlock, StoreError> {
        let next = (self.leases.last_token(id).await? + 1).max(first);
        let last = next + TOKENS_PER_BLOCK - 1;
        self.leases.reserve_tokens(id, last).await?;
        Ok(TokenBlock { next, last })
    }
}

/// Whether every lease row granted at or after `since_ms` is `me`'s.
fn granted_only_by(rows: &[StoredLease], me: Uuid, since_ms: i64) -> bool {
    rows.iter().all(|stored| {
        stored.record.lease.gateway_id == me || stored.record.lease.acquired_ms < since_ms
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Lease, LeaseInfo, LeaseState, LeaseVersion};
    use crate::store::LeaseRecord;

    const ME: Uuid = Uuid::from_u128(7);

    fn row(gateway_id: Uuid, acquired_ms: i64) -> StoredLease {
        StoredLease {
            record: LeaseRecord {
                lease: Lease {
                    state_id: StateId::parse("id".to_owned()).unwrap(),
                    lease_id: Uuid::new_v4(),
                    owner: "worker".to_owned(),
                    fencing_token: 3,
                    gateway_id,
                    acquired_ms,
                    expires_ms: acquired_ms + 60_000,
                    lock_delay: std::time::Duration::ZERO,
                    info: LeaseInfo::default(),
                    limit: 1,
                },
                version: LeaseVersion::granted(3),
                state: LeaseState::Held,
                ended_ms: None,
                forced: None,
            },
            unexpired: true,
            authority_url: String::new(),
        }
    }

    #[test]
    fn only_this_gateways_grants_since_the_lapsed_claim_allow_re_adoption() {
        assert!(granted_only_by(&[row(ME, 6_000)], ME, 5_000));
        assert!(granted_only_by(&[], ME, 5_000));
        assert!(
            granted_only_by(&[row(Uuid::from_u128(2), 4_000)], ME, 5_000),
            "a grant before the lapsed claim was made is history"
        );
        assert!(
            !granted_only_by(&[row(Uuid::from_u128(2), 5_000)], ME, 5_000),
            "another gateway granted since: it held the claim"
        );
    }
}
