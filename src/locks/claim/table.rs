//! `--coordination table`: a gateway proposes a candidate row in the lease
//! table, stamped with the server's clock, lets it settle, and holds the
//! claim once its candidate is the earliest live one; a lone member skips
//! the settle (see [`super::membership`]). Correct only while every
//! gateway's queries reach one ClickHouse node.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use uuid::Uuid;

use super::claimant::{Claimant, TOKENS_PER_BLOCK};
use super::guard::Withdrawing;
use super::membership::{Membership, Pass};
use super::protocol::{Authority, ClaimOutcome, ClaimProtocol, Step, leases_in_force};
use crate::domain::{Lease, LeaseState, StateId};
use crate::locks::peer::Peer;
use crate::locks::slot::{HeldClaim, Lapsed, TokenBlock, WonClaim};
use crate::metrics::LockEvent;
use crate::store::{Candidate, IdLocks, StoreError, StoredLease};

/// The claim protocol of candidate rows in the lease table.
pub(super) struct TableClaims {
    /// This gateway, and the lease table the candidates are kept in.
    pub claimant: Claimant,
    /// Whether this gateway may claim now and skip the settle; None where
    /// no membership is kept, and every claim settles.
    pub membership: Option<Arc<Membership>>,
}

impl TableClaims {
    /// Claims `id`: proposes a candidate, lets it settle, and wins if it is
    /// the earliest live candidate. When a gateway with an advertised URL is
    /// earlier, the attempt withdraws and the request is forwarded there.
    /// When the earlier one cannot be forwarded to, the candidate stays in
    /// line (renewed) until it is the earliest or `deadline` passes: the
    /// holder sees it waiting and hands over, and the waiter wins by its
    /// place, not by a race against fresh candidates.
    /// With `lapsed`, a win re-adopts its kept leases if nothing shows
    /// another claim or grant since.
    async fn claim(
        &self,
        id: &StateId,
        deadline: Instant,
        lapsed: Option<&Lapsed>,
    ) -> Result<ClaimOutcome, StoreError> {
        let claimant = &self.claimant;
        let gateway_id = claimant.gateway_id();
        let claim_ttl = claimant.timing.ttl();
        // Until the proposal is known to have landed its place in line is
        // unknown; a withdrawal (highest version) covers it either way.
        let mut proposed = Withdrawing::new(
            self,
            id,
            Candidate {
                claim_id: Uuid::new_v4(),
                gateway_id,
                created_ms: 0,
                advertise_url: String::new(),
                expires_ms: 0,
            },
        );
        let pass = self.ready().await?;
        let mut written_at = Instant::now();
        claimant
            .leases
            .propose_claim(
                id,
                proposed.candidate.claim_id,
                gateway_id,
                claimant.advertise_url(),
                claim_ttl,
            )
            .await?;
        let landed = Instant::now();
        if !self.counts(pass) {
            // Answered after this gateway's membership may have lapsed:
            // another may have read it gone and claimed without settling.
            return Ok(claimant.unsettled());
        }
        let mut decided = self.decided_alone(id).await;
        if decided.is_none() {
            tokio::time::sleep_until((landed + claimant.timing.settle()).into()).await;
        }
        loop {
            let IdLocks {
                candidates,
                leases,
                last_token,
                ..
            } = match decided.take() {
                Some(read) => read,
                None => claimant.leases.id_locks(id).await?,
            };
            let Some(mine) = candidates
                .iter()
                .find(|c| c.claim_id == proposed.candidate.claim_id)
                .cloned()
            else {
                // Our candidate lapsed (a stall longer than the claim TTL).
                proposed.settle();
                return Ok(claimant.unsettled());
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
                        (leases, last_token),
                        lapsed,
                    )
                    .await?;
                let renewed = claimant
                    .renew_if_late(&mut won.claim, || async {
                        let pass = self.ready().await?;
                        let renewed = claimant
                            .leases
                            .renew_claims(gateway_id, &[proposed.candidate.claim_id], claim_ttl)
                            .await?;
                        Ok(!renewed.is_empty() && self.counts(pass))
                    })
                    .await?;
                proposed.settle();
                if !renewed {
                    // Lapsed before the renewal landed: won too late.
                    return Ok(claimant.unsettled());
                }
                return Ok(ClaimOutcome::Won(Box::new(won)));
            }
            let Some(poll) = claimant.next_poll(deadline) else {
                // Behind a claim of this gateway's (one whose renewal landed
                // unanswered, or an attempt's not yet withdrawn), no other's.
                let ours_first = candidates
                    .first()
                    .is_some_and(|c| c.gateway_id == gateway_id);
                return Ok(if ours_first {
                    claimant.unsettled()
                } else {
                    claimant.lost()
                });
            };
            let now = Instant::now();
            if now.duration_since(written_at) >= claimant.timing.renew_interval() {
                // One that lapsed meanwhile is missing from the next read.
                let pass = self.ready().await?;
                written_at = Instant::now();
                claimant
                    .leases
                    .renew_claims(gateway_id, &[proposed.candidate.claim_id], claim_ttl)
                    .await?;
                if !self.counts(pass) {
                    return Ok(claimant.unsettled());
                }
            }
            tokio::time::sleep(poll).await;
        }
    }

    /// Waits until this gateway may write a claim row (see
    /// [`Membership::ready`]); None where no membership is kept.
    async fn ready(&self) -> Result<Option<Pass>, StoreError> {
        match &self.membership {
            Some(membership) => Ok(Some(membership.ready().await?)),
            None => Ok(None),
        }
    }

    /// Whether a claim row written under `pass`, answered just now, counts.
    fn counts(&self, pass: Option<Pass>) -> bool {
        match (&self.membership, pass) {
            (Some(membership), Some(pass)) => membership.counts(pass),
            _ => true,
        }
    }

    /// The read of `id`'s rows that decides a claim whose candidate just
    /// landed without settling, if this gateway may skip the settle: the
    /// same statement found no other gateway that may claim, and was
    /// answered within the alone window of its send (see
    /// [`Membership::alone`]). None: the claim settles, as every claim did
    /// before.
    async fn decided_alone(&self, id: &StateId) -> Option<IdLocks> {
        let membership = self.membership.as_ref()?;
        match membership.alone(&self.claimant.leases, id).await {
            Ok(Some(read)) => {
                self.claimant.metrics.lock_event(LockEvent::ClaimAlone);
                Some(read)
            }
            Ok(None) => None,
            // The settle needs no such read: the claim goes on without it.
            Err(err) => {
                tracing::debug!(state_id = %id, error = %err, "members not read; the claim settles");
                None
            }
        }
    }

    /// Takes over a claim just won: a block of fencing tokens above every
    /// token before, and what the id's lease rows leave to it. `rows` and
    /// the last token were read with the candidates that showed the win: a
    /// gateway hands its leases on (and writes their rows) before it
    /// withdraws its claims, and reserves tokens only under a claim it
    /// holds, so a read that sees the withdrawal or the lapse sees both
    /// too. With `lapsed`, the win re-adopts its kept leases if nothing
    /// shows another claim or grant since.
    async fn won(
        &self,
        id: &StateId,
        candidate: Candidate,
        written_at: Instant,
        others_waiting: bool,
        (rows, last_token): (Vec<StoredLease>, u64),
        lapsed: Option<&Lapsed>,
    ) -> Result<WonClaim, StoreError> {
        let readopting = match lapsed {
            Some(lapsed) if self.nothing_since(id, lapsed, &rows).await? => Some(lapsed),
            _ => None,
        };
        let tokens = self.reserve_above(id, last_token, 0).await?;
        self.claimant.metrics.lock_event(LockEvent::ClaimWin);
        Ok(WonClaim {
            claim: HeldClaim {
                candidate,
                valid_until: self.claimant.timing.valid_until(written_at),
                handover: others_waiting,
            },
            tokens,
            inherited: self.claimant.inherit(rows, readopting),
            readopted: readopting.is_some(),
        })
    }

    /// Whether nothing shows another claim or grant on `id` since `lapsed`
    /// was made: no other gateway's candidate row made since that was still
    /// in line when ours ran out (in line, won, withdrawn or lapsed later:
    /// any such may have won while ours had lapsed), and no lease row of
    /// another gateway's granted since.
    async fn nothing_since(
        &self,
        id: &StateId,
        lapsed: &Lapsed,
        rows: &[StoredLease],
    ) -> Result<bool, StoreError> {
        let me = self.claimant.gateway_id();
        let since_ms = lapsed.claim.created_ms;
        if !granted_only_by(rows, me, since_ms) {
            return Ok(false);
        }
        Ok(!self
            .claimant
            .leases
            .claimed_since(id, me, &lapsed.claim)
            .await?)
    }

    /// Reserves the next block of fencing tokens for `id`, above every token
    /// reserved or recorded so far (and at least `first`), read afresh.
    async fn reserve(&self, id: &StateId, first: u64) -> Result<TokenBlock, StoreError> {
        let last_token = self.claimant.leases.id_locks(id).await?.last_token;
        self.reserve_above(id, last_token, first).await
    }

    /// Reserves the block of fencing tokens for `id` above `last_token`, the
    /// highest reserved or recorded as read (and at least `first`); the
    /// reservation is written before any of them is handed out.
    async fn reserve_above(
        &self,
        id: &StateId,
        last_token: u64,
        first: u64,
    ) -> Result<TokenBlock, StoreError> {
        let next = (last_token + 1).max(first);
        let last = next + TOKENS_PER_BLOCK - 1;
        self.claimant.leases.reserve_tokens(id, last).await?;
        Ok(TokenBlock { next, last })
    }
}

impl ClaimProtocol for TableClaims {
    fn try_claim<'a>(
        &'a self,
        id: &'a StateId,
        deadline: Instant,
        lapsed: Option<&'a Lapsed>,
    ) -> Step<'a, ClaimOutcome> {
        Box::pin(self.claim(id, deadline, lapsed))
    }

    fn reserve_tokens<'a>(
        &'a self,
        id: &'a StateId,
        _claim_id: Uuid,
        first: u64,
    ) -> Step<'a, Option<TokenBlock>> {
        Box::pin(async move { self.reserve(id, first).await.map(Some) })
    }

    fn renew_claims<'a>(&'a self, held: &'a [(StateId, Uuid)]) -> Step<'a, Vec<Uuid>> {
        Box::pin(async move {
            let ids: Vec<Uuid> = held.iter().map(|(_, claim)| *claim).collect();
            let pass = self.ready().await?;
            let renewed = self
                .claimant
                .leases
                .renew_claims(self.claimant.gateway_id(), &ids, self.claimant.timing.ttl())
                .await?;
            if !self.counts(pass) {
                return Err(StoreError::MembershipLapsed);
            }
            Ok(ids.into_iter().filter(|id| !renewed.contains(id)).collect())
        })
    }

    fn withdraw_claims<'a>(&'a self, claims: &'a [(StateId, Uuid)]) -> Step<'a, ()> {
        Box::pin(async move {
            let ids: Vec<Uuid> = claims.iter().map(|(_, claim)| *claim).collect();
            self.claimant
                .leases
                .withdraw_claims(self.claimant.gateway_id(), &ids)
                .await
        })
    }

    fn withdraw_in_background(&self, id: StateId, candidate: Candidate) {
        let leases = self.claimant.leases.clone();
        let withdrawn = id.clone();
        self.claimant.in_background(id, async move {
            leases.withdraw_claim(&withdrawn, &candidate).await
        });
    }

    fn contested<'a>(&'a self, ids: &'a [StateId]) -> Step<'a, HashSet<StateId>> {
        Box::pin(async move {
            Ok(self
                .claimant
                .leases
                .contested(self.claimant.gateway_id(), ids)
                .await?
                .into_iter()
                .collect())
        })
    }

    fn authority<'a>(&'a self, id: &'a StateId, with_row: bool) -> Step<'a, Authority> {
        Box::pin(async move {
            let locks = self
                .claimant
                .leases
                .id_locks_or_with_row(id, with_row)
                .await?;
            // With no live claim at all: the latest candidate that lapsed
            // unwithdrawn (its grants' rows may not have landed), or the
            // gateway of a lease row that still runs. No other claim was made
            // since either: a winner's candidate stays live while it holds.
            let running = locks
                .leases
                .iter()
                .filter(|l| l.unexpired && l.record.state == LeaseState::Held)
                .map(|l| Candidate {
                    claim_id: Uuid::nil(),
                    gateway_id: l.record.lease.gateway_id,
                    created_ms: 0,
                    advertise_url: l.authority_url.clone(),
                    expires_ms: 0,
                })
                .next_back();
            let lapsed = locks
                .lapsed
                .clone()
                .or(running)
                .filter(|c| locks.candidates.is_empty() && !c.advertise_url.is_empty());
            Ok(Authority {
                claims: locks.candidates,
                leases: locks.leases,
                lapsed,
            })
        })
    }

    fn recorded_leases(&self) -> Step<'_, Vec<Lease>> {
        Box::pin(async move {
            let unexpired = self.claimant.leases.unexpired_leases().await?;
            // A gateway's claim is live while it has a candidate in line.
            Ok(leases_in_force(unexpired, |candidates, _, gateway| {
                candidates.iter().any(|c| c.gateway_id == gateway)
            }))
        })
    }

    fn claim_holders(&self) -> Step<'_, Vec<(Uuid, String)>> {
        Box::pin(self.claimant.leases.peers(self.claimant.gateway_id()))
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

    const ME: Uuid = Uuid::from_u128(7);

    fn row(gateway_id: Uuid, acquired_ms: i64) -> StoredLease {
        StoredLease::for_tests(LeaseState::Held, true, gateway_id, acquired_ms)
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
