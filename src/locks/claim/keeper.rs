//! `--coordination keeper`: a state_id's claim is its key in the KeeperMap
//! table `<table>_claims` (see `store::keeper_claims`). Keeper's writes are
//! linearizable on any ClickHouse topology, so winning is one conditional
//! write (a create-if-absent, or a takeover of a released or lapsed key),
//! with no settle: a first acquire costs a read and a write to Keeper.
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

use std::time::Instant;

use uuid::Uuid;

use super::Coordinator;
use super::{CLAIM_POLL, ClaimOutcome, TOKENS_PER_BLOCK, WonClaim};
use crate::domain::StateId;
use crate::locks::peer::Peer;
use crate::locks::slot::{HeldClaim, Lapsed, TokenBlock};
use crate::metrics::LockEvent;
use crate::store::{Candidate, KeeperClaim, KeeperClaimStore, NewClaim, Outcome, StoreError};

/// How many times a conditional write that raced another is tried again
/// before the attempt gives up for now.
const RACES: usize = 3;

/// A claim write on its way, or won and not yet handed to the caller.
/// Dropped before it is settled (its future abandoned, its request failed,
/// or the renewal or read after a win failed), the claim may be ours all
/// the same: it is released in the background, so that no claim is left
/// that nobody renews or uses and other gateways wait out its whole TTL.
struct Making<'a> {
    coordinator: &'a Coordinator,
    id: &'a StateId,
    candidate: Candidate,
    settled: bool,
}

impl Making<'_> {
    /// The claim is surely not ours, or it is handed to the caller, which
    /// holds it from now on.
    fn settle(&mut self) {
        self.settled = true;
    }
}

impl Drop for Making<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.coordinator
                .withdraw_in_background(self.id.clone(), self.candidate.clone());
        }
    }
}

impl Coordinator {
    pub(super) async fn claim_in_keeper(
        &self,
        store: &KeeperClaimStore,
        id: &StateId,
        deadline: Instant,
        lapsed: Option<&Lapsed>,
    ) -> Result<ClaimOutcome, StoreError> {
        let me = self.settings.gateway_id;
        let url = self.settings.advertise_url.as_deref().unwrap_or("");
        let ttl = self.timing.ttl();
        let mut marked = None;
        let mut raced = 0;
        loop {
            let started = Instant::now();
            let read = store.read(id).await?;
            // Every claim writes a key of its own id and a release the nil
            // one: with the lapsed claim's id still in the key, nobody
            // claimed the id since, and its kept leases may run on.
            let readopting = lapsed.filter(|l| unclaimed_since(read.claim.as_ref(), l));
            // The lease rows are read after the key: a gateway that shuts
            // down writes its hand-over before it releases the key, so a read
            // that saw the release sees the lease handed on. With them, the
            // tokens of table mode, if the id was locked in it before.
            let (locks, recorded_token) =
                tokio::join!(self.leases.id_locks(id), self.leases.last_token(id));
            let key_token = read.claim.as_ref().map_or(0, |key| key.last_token);
            // Tokens go on above both; the key holds the mark from now on.
            let base = key_token.max(recorded_token?);
            let new = NewClaim {
                claim_id: Uuid::new_v4(),
                gateway_id: me,
                advertise_url: url,
                ttl,
                tokens: base - key_token + TOKENS_PER_BLOCK,
            };
            let mut making = Making {
                coordinator: self,
                id,
                candidate: Candidate {
                    claim_id: new.claim_id,
                    gateway_id: me,
                    created_ms: 0,
                    advertise_url: url.to_owned(),
                    expires_ms: read.now_ms + i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX),
                },
                settled: false,
            };
            // The key holds the reservation; the lease table gets one too,
            // so that tokens keep rising if the gateways go back to table mode.
            let reserved_in_table = self.leases.reserve_tokens(id, base + TOKENS_PER_BLOCK);
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
                    let now = Instant::now();
                    if now >= deadline {
                        self.metrics.lock_event(LockEvent::ClaimLoss);
                        return Ok(ClaimOutcome::Lost);
                    }
                    // The holder hands over when it sees that someone waits.
                    if key.waiting_gateway.is_none() && marked != Some(holder.claim_id) {
                        store.mark_waiting(id, holder.claim_id, me).await?;
                        marked = Some(holder.claim_id);
                    }
                    tokio::time::sleep(CLAIM_POLL.min(deadline - now)).await;
                    continue;
                }
            };
            match written? {
                // Won: `making` stays unsettled until the claim is handed
                // over, so that a failed renewal or lease read, or a drop
                // at either await, withdraws it.
                Outcome::Done => {
                    self.metrics.lock_event(LockEvent::ClaimWin);
                    let mut claim = HeldClaim {
                        candidate: making.candidate.clone(),
                        valid_until: self.timing.valid_until(started),
                        handover: false,
                    };
                    // Won late (a slow Keeper): renewed before the winner's
                    // grant, so that its lease is not dead on arrival.
                    if self
                        .timing
                        .renew_before_grant(claim.valid_until, Instant::now())
                    {
                        let renewing = Instant::now();
                        if store.renew(id, new.claim_id, ttl).await? == Outcome::Done {
                            claim.valid_until = self.timing.valid_until(renewing);
                        }
                    }
                    let inherited = self.inherit(locks?.leases, readopting);
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
                    raced += 1;
                    let now = Instant::now();
                    if raced >= RACES && now >= deadline {
                        self.metrics.lock_event(LockEvent::ClaimLoss);
                        return Ok(ClaimOutcome::Lost);
                    }
                    if raced >= RACES {
                        tokio::time::sleep(CLAIM_POLL.min(deadline - now)).await;
                    }
                }
            }
        }
    }

    /// Raises the key's token mark by a block, while the claim is ours.
    pub(super) async fn reserve_in_keeper(
        &self,
        store: &KeeperClaimStore,
        id: &StateId,
        claim_id: Uuid,
        first: u64,
    ) -> Result<Option<TokenBlock>, StoreError> {
        let mut seen = first.saturating_sub(1);
        for _ in 0..RACES {
            let last = seen + TOKENS_PER_BLOCK;
            let (reserved, in_table) = tokio::join!(
                store.reserve_tokens(id, claim_id, seen, last),
                self.leases.reserve_tokens(id, last)
            );
            in_table?;
            match reserved? {
                Outcome::Done => {
                    return Ok(Some(TokenBlock {
                        next: seen + 1,
                        last,
                    }));
                }
                Outcome::Raced => {}
                // The mark is not where this gateway left it: an earlier
                // reservation landed after its request gave up. Go on above
                // it while the claim is still ours.
                Outcome::Refused => {
                    let read = store.read(id).await?;
                    match read.claim.filter(|key| key.holder_claim_id() == claim_id) {
                        Some(key) => seen = key.last_token,
                        None => return Ok(None),
                    }
                }
            }
        }
        Ok(None)
    }

    /// Renews each held claim in its key; answers those found lost.
    pub(super) async fn renew_in_keeper(
        &self,
        store: &KeeperClaimStore,
        held: &[(StateId, Uuid)],
    ) -> Result<Vec<Uuid>, StoreError> {
        let mut lost = Vec::new();
        for (id, claim_id) in held {
            let mut outcome = Outcome::Raced;
            for _ in 0..RACES {
                outcome = store.renew(id, *claim_id, self.timing.ttl()).await?;
                if outcome != Outcome::Raced {
                    break;
                }
            }
            if outcome != Outcome::Done {
                lost.push(*claim_id);
            }
        }
        Ok(lost)
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
