//! `--coordination keeper`: a state_id's claim is its key in the KeeperMap
//! table `<table>_claims` (see `store::keeper_claims`). Keeper's writes are
//! linearizable on any ClickHouse topology, so winning is one conditional
//! write (a create-if-absent, or a takeover of a released or lapsed key),
//! with no settle: a first acquire costs the routing read of its key and a
//! write to Keeper (the claim goes by the routing read, see [`super::key_reads`]).
//!
//! Fencing tokens are reserved in the same key, which outlives every
//! claim, so they strictly increase across hand-overs, crashes and
//! restarts. A gateway that waits for a claim it cannot be forwarded to
//! marks the key; the holder sees the mark at its next maintenance tick and
//! hands the claim over once its lease ends.
//!
//! Every Keeper call runs under the query timeout: with Keeper out of reach
//! no claim is made, renewed or taken over, and an acquire that needs one
//! answers 503. A claim write whose answer never came may still have
//! landed; it is released in the background, and a later attempt of this
//! gateway takes a leftover of its own over at once.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use futures_util::{StreamExt, stream};
use uuid::Uuid;

use super::claimant::{Claimant, TOKENS_PER_BLOCK};
use super::guard::Withdrawing;
use super::key_reads::KeyReads;
use super::protocol::{Authority, ClaimOutcome, ClaimProtocol, Step, leases_in_force};
use crate::domain::{Lease, StateId};
use crate::locks::peer::Peer;
use crate::locks::slot::{HeldClaim, Lapsed, TokenBlock, WonClaim};
use crate::metrics::LockEvent;
use crate::retry::{ATTEMPTS, retried};
use crate::store::{Candidate, KeeperClaim, KeeperClaimStore, NewClaim, Outcome, StoreError};

/// Claim renewals in flight at once: each is a Keeper write of its own
/// (a KeeperMap key takes no batch with a guard per key), and Keeper and
/// ClickHouse take many at once.
const RENEWALS_AT_ONCE: usize = 16;

/// What one attempt to reserve a block of tokens in a key found.
enum Reserved {
    Block(TokenBlock),
    /// The mark was not where the attempt expected: the next goes on above
    /// this one.
    Again(u64),
    /// The claim is not this gateway's any more.
    Lost,
}

/// The claim protocol of KeeperMap keys.
pub(super) struct KeeperClaims {
    /// This gateway, and the lease table the lease rows are kept in.
    pub claimant: Claimant,
    /// The claim keys.
    pub store: KeeperClaimStore,
    /// Routing reads of keys, for the claims that follow them.
    pub routed: KeyReads,
}

impl KeeperClaims {
    /// Claims `id`: reads its key and wins by one conditional write when the
    /// key is free, released, lapsed or a leftover of ours. When a gateway
    /// with an advertised URL holds it, the request is forwarded there; when
    /// the holder cannot be forwarded to, the key is marked waiting and read
    /// again each poll until it is won or `deadline` passes.
    /// With `lapsed` still in the key, the win re-adopts its kept leases.
    async fn claim(
        &self,
        id: &StateId,
        deadline: Instant,
        lapsed: Option<&Lapsed>,
    ) -> Result<ClaimOutcome, StoreError> {
        let (claimant, store) = (&self.claimant, &self.store);
        let me = claimant.gateway_id();
        let url = claimant.advertise_url();
        let ttl = claimant.timing.ttl();
        let mut marked = None;
        let mut raced = 0;
        // The first attempt goes by the routing read of the key, if one was
        // just made: its write is conditional on the key as read.
        let mut routed = self.routed.take(id);
        loop {
            let started = Instant::now();
            let (read, routed_locks) = match routed.take() {
                Some((read, locks)) => (read, Some(locks)),
                None => (store.read(id).await?, None),
            };
            let readopting = lapsed.filter(|l| unclaimed_since(read.claim.as_ref(), l));
            // The lease rows are read after the key: a gateway that shuts
            // down writes its hand-over before it releases the key, so a read
            // that saw the release sees the lease handed on. With them, the
            // tokens of table mode, if the id was locked in it before. With
            // no key at all, the rows read beside the key's routing read do:
            // a key is never deleted, so while it is missing no gateway has
            // claimed the id in this mode, and none grants on it, or writes
            // its rows, without the key this claim's strict INSERT then finds.
            let locks = match routed_locks.filter(|_| read.claim.is_none()) {
                Some(locks) => locks,
                None => claimant.leases.id_locks(id).await?,
            };
            let key_token = read.claim.as_ref().map_or(0, |key| key.last_token);
            // Tokens go on above both; the key holds the mark from now on.
            let base = key_token.max(locks.last_token);
            let new = NewClaim {
                claim_id: Uuid::new_v4(),
                gateway_id: me,
                advertise_url: url,
                ttl,
                tokens: base - key_token + TOKENS_PER_BLOCK,
            };
            let mut making = Withdrawing::new(
                self,
                id,
                Candidate {
                    claim_id: new.claim_id,
                    gateway_id: me,
                    created_ms: 0,
                    advertise_url: url.to_owned(),
                    expires_ms: read.now_ms + i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX),
                },
            );
            // The key holds the reservation; the lease table gets one too,
            // so that tokens keep rising if the gateways go back to table mode.
            let reserved_in_table = claimant.leases.reserve_tokens(id, base + TOKENS_PER_BLOCK);
            let written = match &read.claim {
                None => {
                    let (written, reserved) =
                        tokio::join!(store.create(id, &new), reserved_in_table);
                    reserved?;
                    written
                }
                // A leftover of this gateway's (a claim write whose answer
                // was lost) is taken over like a lapsed one.
                Some(key)
                    if key.takeable(read.now_ms)
                        || key.holder.as_ref().is_some_and(|h| h.gateway_id == me) =>
                {
                    let (written, reserved) = tokio::join!(
                        store.take_over(id, key.holder_claim_id(), key.last_token, &new),
                        reserved_in_table
                    );
                    reserved?;
                    written
                }
                Some(key) => {
                    making.settle();
                    let holder = key.holder.as_ref().expect("a key not takeable is held");
                    if !holder.advertise_url.is_empty() {
                        return Ok(ClaimOutcome::Elsewhere(Peer {
                            gateway_id: holder.gateway_id,
                            url: holder.advertise_url.trim_end_matches('/').to_owned(),
                            lapses_at_ms: holder.expires_ms,
                        }));
                    }
                    let Some(poll) = claimant.next_poll(deadline) else {
                        return Ok(claimant.lost());
                    };
                    // The holder hands over when it sees that someone waits.
                    if key.waiting_gateway.is_none() && marked != Some(holder.claim_id) {
                        store.mark_waiting(id, holder.claim_id, me).await?;
                        marked = Some(holder.claim_id);
                    }
                    tokio::time::sleep(poll).await;
                    continue;
                }
            };
            match written? {
                // Won: `making` stays unsettled until the claim is handed
                // over, so that a failed renewal or lease read, or a drop
                // at either await, withdraws it.
                Outcome::Done => {
                    claimant.metrics.lock_event(LockEvent::ClaimWin);
                    let mut claim = HeldClaim {
                        candidate: making.candidate.clone(),
                        valid_until: claimant.timing.valid_until(started),
                        handover: false,
                    };
                    // A renewal refused leaves the claim valid as won: the
                    // key was ours a moment ago.
                    claimant
                        .renew_if_late(&mut claim, || async {
                            Ok(store.renew(id, new.claim_id, ttl).await? == Outcome::Done)
                        })
                        .await?;
                    let inherited = claimant.inherit(locks.leases, readopting);
                    making.settle();
                    return Ok(ClaimOutcome::Won(Box::new(WonClaim {
                        claim,
                        tokens: TokenBlock {
                            next: base + 1,
                            last: base + TOKENS_PER_BLOCK,
                        },
                        inherited,
                        readopted: readopting.is_some(),
                    })));
                }
                // Another gateway wrote the key between the read and the
                // write: read again and decide again.
                Outcome::Refused | Outcome::Raced => {
                    making.settle();
                    // Races beyond the retry rule's attempts are paced by
                    // the poll, as a wait for a held key is.
                    raced += 1;
                    if raced >= ATTEMPTS {
                        let Some(poll) = claimant.next_poll(deadline) else {
                            return Ok(claimant.lost());
                        };
                        tokio::time::sleep(poll).await;
                    }
                }
            }
        }
    }

    /// Raises the key's token mark by a block, while the claim is ours.
    async fn reserve(
        &self,
        id: &StateId,
        claim_id: Uuid,
        first: u64,
    ) -> Result<Option<TokenBlock>, StoreError> {
        // Shared by the attempts and the rule that readies the next; atomic
        // so that the claim's future may move between threads.
        let seen = AtomicU64::new(first.saturating_sub(1));
        let reserved = retried(
            || self.reserve_above(id, claim_id, seen.load(Ordering::Relaxed)),
            |outcome| match outcome {
                Ok(Reserved::Again(mark)) => {
                    seen.store(*mark, Ordering::Relaxed);
                    true
                }
                _ => false,
            },
        )
        .await?;
        Ok(match reserved {
            Reserved::Block(block) => Some(block),
            Reserved::Again(_) | Reserved::Lost => None,
        })
    }

    /// One attempt of [`KeeperClaims::reserve`]: the block above `seen`, if
    /// the key's mark is still there.
    async fn reserve_above(
        &self,
        id: &StateId,
        claim_id: Uuid,
        seen: u64,
    ) -> Result<Reserved, StoreError> {
        let last = seen + TOKENS_PER_BLOCK;
        let (reserved, in_table) = tokio::join!(
            self.store.reserve_tokens(id, claim_id, seen, last),
            self.claimant.leases.reserve_tokens(id, last)
        );
        in_table?;
        Ok(match reserved? {
            Outcome::Done => Reserved::Block(TokenBlock {
                next: seen + 1,
                last,
            }),
            Outcome::Raced => Reserved::Again(seen),
            // The mark is not where this gateway left it: an earlier
            // reservation landed after its request gave up. Go on above it
            // while the claim is still ours.
            Outcome::Refused => {
                let read = self.store.read(id).await?;
                match read.claim.filter(|key| key.holder_claim_id() == claim_id) {
                    Some(key) => Reserved::Again(key.last_token),
                    None => Reserved::Lost,
                }
            }
        })
    }

    /// Renews each held claim in its key, up to [`RENEWALS_AT_ONCE`] at a
    /// time; answers those found lost. A key is a write of its own, and a
    /// round's renewals count from its start: one after the other, a
    /// hundred claims at 100 ms a round trip took longer than the claim
    /// TTL, and every claim lapsed while its gateway was alive.
    async fn renew(&self, held: &[(StateId, Uuid)]) -> Result<Vec<Uuid>, StoreError> {
        // Made before they run (a lazy map here is a closure over a borrow
        // that the boxed, `Send` future cannot name).
        let renewals: Vec<_> = held
            .iter()
            .map(|(id, claim_id)| self.renew_one(id, *claim_id))
            .collect();
        let outcomes: Vec<_> = stream::iter(renewals)
            .buffer_unordered(RENEWALS_AT_ONCE)
            .collect()
            .await;
        let mut lost = Vec::new();
        for outcome in outcomes {
            lost.extend(outcome?);
        }
        Ok(lost)
    }

    /// Renews one held claim; answers its id if it was found lost.
    async fn renew_one(&self, id: &StateId, claim_id: Uuid) -> Result<Option<Uuid>, StoreError> {
        let outcome = retried(
            || self.store.renew(id, claim_id, self.claimant.timing.ttl()),
            |outcome| matches!(outcome, Ok(Outcome::Raced)),
        )
        .await?;
        Ok((outcome != Outcome::Done).then_some(claim_id))
    }

    /// The gateway holding each of `ids`' keys with a live claim, if one does.
    async fn holders(&self, ids: &[StateId]) -> Result<HashMap<StateId, Uuid>, StoreError> {
        Ok(self
            .store
            .read_many(ids)
            .await?
            .into_iter()
            .filter_map(|(id, read)| {
                let holder = read.claim?.holder?;
                (holder.expires_ms > read.now_ms).then_some((id, holder.gateway_id))
            })
            .collect())
    }
}

impl ClaimProtocol for KeeperClaims {
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
        claim_id: Uuid,
        first: u64,
    ) -> Step<'a, Option<TokenBlock>> {
        Box::pin(self.reserve(id, claim_id, first))
    }

    fn renew_claims<'a>(&'a self, held: &'a [(StateId, Uuid)]) -> Step<'a, Vec<Uuid>> {
        Box::pin(self.renew(held))
    }

    fn withdraw_claims<'a>(&'a self, claims: &'a [(StateId, Uuid)]) -> Step<'a, ()> {
        Box::pin(async move {
            for (id, claim_id) in claims {
                self.store.release(id, *claim_id).await?;
            }
            Ok(())
        })
    }

    fn withdraw_in_background(&self, id: StateId, candidate: Candidate) {
        let store = self.store.clone();
        let released = id.clone();
        self.claimant.in_background(id, async move {
            store.release(&released, candidate.claim_id).await.map(drop)
        });
    }

    fn contested<'a>(&'a self, ids: &'a [StateId]) -> Step<'a, HashSet<StateId>> {
        let me = self.claimant.gateway_id();
        Box::pin(async move {
            Ok(self
                .store
                .read_many(ids)
                .await?
                .into_iter()
                .filter(|(_, read)| {
                    read.claim
                        .as_ref()
                        .is_some_and(|c| c.waiting_gateway.is_some_and(|w| w != me))
                })
                .map(|(id, _)| id)
                .collect())
        })
    }

    fn authority<'a>(&'a self, id: &'a StateId, with_row: bool) -> Step<'a, Authority> {
        Box::pin(async move {
            let asked = Instant::now();
            let (read, locks) = tokio::join!(
                self.store.read(id),
                self.claimant.leases.id_locks_or_with_row(id, with_row)
            );
            let (read, locks) = (read?, locks?);
            self.routed.keep(id, asked, read.clone(), locks.clone());
            let holder = read.claim.and_then(|c| c.holder).map(|h| Candidate {
                claim_id: h.claim_id,
                gateway_id: h.gateway_id,
                created_ms: 0,
                advertise_url: h.advertise_url,
                expires_ms: h.expires_ms,
            });
            // A holder lapsed in the key: nobody claimed the id since (a
            // claim replaces it, a release clears it).
            let (live, lapsed) = match holder {
                Some(h) if h.expires_ms > read.now_ms => (Some(h), None),
                lapsed => (None, lapsed.filter(|h| !h.advertise_url.is_empty())),
            };
            Ok(Authority {
                claims: live.into_iter().collect(),
                leases: locks.leases,
                lapsed,
            })
        })
    }

    fn recorded_leases(&self) -> Step<'_, Vec<Lease>> {
        Box::pin(async move {
            let unexpired = self.claimant.leases.unexpired_leases().await?;
            let ids: Vec<StateId> = unexpired
                .iter()
                .filter_map(|l| l.latest())
                .map(|l| l.record.lease.state_id.clone())
                .collect();
            let holders = self.holders(&ids).await?;
            Ok(leases_in_force(unexpired, |_, id, gateway| {
                holders.get(id) == Some(&gateway)
            }))
        })
    }

    fn claim_holders(&self) -> Step<'_, Vec<(Uuid, String)>> {
        Box::pin(self.store.holders(self.claimant.gateway_id()))
    }
}

/// Whether the key shows no claim made since `lapsed`: every claim writes
/// a key of its own id and a release the nil one, so the lapsed claim's id
/// still in the key (lapsed or not) means nobody claimed the id meanwhile.
fn unclaimed_since(key: Option<&KeeperClaim>, lapsed: &Lapsed) -> bool {
    key.is_some_and(|key| key.holder_claim_id() == lapsed.claim.claim_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::ClaimHolder;

    const MINE: Uuid = Uuid::from_u128(1);

    fn lapsed() -> Lapsed {
        Lapsed {
            claim: Candidate {
                claim_id: MINE,
                gateway_id: Uuid::from_u128(7),
                created_ms: 0,
                advertise_url: String::new(),
                expires_ms: 1_000,
            },
            leases: vec![Uuid::from_u128(9)],
        }
    }

    fn key(holder: Option<Uuid>, expires_ms: i64) -> KeeperClaim {
        KeeperClaim {
            holder: holder.map(|claim_id| ClaimHolder {
                claim_id,
                gateway_id: Uuid::from_u128(7),
                advertise_url: String::new(),
                expires_ms,
            }),
            last_token: 1_024,
            waiting_gateway: None,
        }
    }

    #[test]
    fn the_lapsed_claim_still_in_the_key_is_re_won_with_its_leases() {
        assert!(unclaimed_since(Some(&key(Some(MINE), 1_000)), &lapsed()));
        assert!(
            unclaimed_since(Some(&key(Some(MINE), 99_000)), &lapsed()),
            "a renewal that landed after all leaves it ours"
        );
    }

    #[test]
    fn another_claim_or_a_release_since_the_lapse_ends_the_leases() {
        let other = Uuid::from_u128(2);
        assert!(!unclaimed_since(Some(&key(Some(other), 1_000)), &lapsed()));
        assert!(
            !unclaimed_since(Some(&key(None, 0)), &lapsed()),
            "released: another may have claimed and let go"
        );
        assert!(!unclaimed_since(None, &lapsed()));
    }
}
