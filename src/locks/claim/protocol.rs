//! The one interface both claim protocols speak ([`ClaimProtocol`]), and
//! what its answers mean: an attempt's outcome, an id's authority, and the
//! rule for when a recorded lease is in force.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::time::Instant;

use uuid::Uuid;

use crate::domain::{Lease, LeaseState, StateId};
use crate::locks::peer::Peer;
use crate::locks::slot::{Lapsed, TokenBlock, WonClaim};
use crate::store::{Candidate, IdLocks, StoreError, StoredLease};

/// A protocol operation under way: boxed, as the futures of a trait
/// object's methods must be.
pub(super) type Step<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// What a claim protocol does: everything about the claim that differs
/// between `--coordination table` and `--coordination keeper`. The
/// `Coordinator` holds one and hands every claim operation to it.
pub(super) trait ClaimProtocol: Send + Sync {
    /// Claims `id` for this gateway, waiting in line until `deadline` behind
    /// a holder that cannot be forwarded to. With `lapsed`, this gateway's
    /// own claim that lapsed with leases kept: a win re-adopts them
    /// ([`WonClaim::readopted`]) only when nothing shows another claim or
    /// grant since it was made.
    fn try_claim<'a>(
        &'a self,
        id: &'a StateId,
        deadline: Instant,
        lapsed: Option<&'a Lapsed>,
    ) -> Step<'a, ClaimOutcome>;

    /// Reserves the next block of fencing tokens under the held claim, from
    /// `first` on at least. None: the claim turned out to be lost.
    fn reserve_tokens<'a>(
        &'a self,
        id: &'a StateId,
        claim_id: Uuid,
        first: u64,
    ) -> Step<'a, Option<TokenBlock>>;

    /// Renews held claims; answers the ones found lost (another gateway's
    /// now), which the caller drops.
    fn renew_claims<'a>(&'a self, held: &'a [(StateId, Uuid)]) -> Step<'a, Vec<Uuid>>;

    /// Gives up held claims (idle, handed over, or at shutdown).
    fn withdraw_claims<'a>(&'a self, claims: &'a [(StateId, Uuid)]) -> Step<'a, ()>;

    /// Withdraws a claim without making anyone wait for it (a drop guard, a
    /// hand-over): nothing here depends on its landing before the caller goes on.
    fn withdraw_in_background(&self, id: StateId, candidate: Candidate);

    /// Which of the held ids another gateway waits for.
    fn contested<'a>(&'a self, ids: &'a [StateId]) -> Step<'a, HashSet<StateId>>;

    /// Who holds `id`'s claim, with the lease row recorded for it; `with_row`
    /// reads its current state row in the same statement, for a write (the
    /// store keeps it for the write: see `store::LeaseStore::id_locks_or_with_row`).
    fn authority<'a>(&'a self, id: &'a StateId, with_row: bool) -> Step<'a, Authority>;

    /// Every lease ClickHouse records as in force, through any gateway.
    fn recorded_leases(&self) -> Step<'_, Vec<Lease>>;

    /// The other gateways that hold claims and can be reached.
    fn claim_holders(&self) -> Step<'_, Vec<(Uuid, String)>>;
}

/// What one claim attempt came to.
pub(in crate::locks) enum ClaimOutcome {
    Won(Box<WonClaim>),
    /// A gateway peers can reach holds the claim: the request belongs there.
    Elsewhere(Peer),
    /// Another gateway's candidate stays ahead in line past the deadline.
    Lost,
    /// Not won, and nothing seen of another gateway: the attempt's own
    /// candidate ran out before it won (ClickHouse slower than the claim
    /// TTL), or an earlier claim of this gateway's is still ahead in line.
    /// A lapsed claim's kept leases stay kept for the next attempt.
    Unsettled,
}

/// Who holds an id's claim, with the leases ClickHouse records for it.
pub(in crate::locks) struct Authority {
    /// Gateways with a live claim on the id, the holder first (in table
    /// mode the others are candidates in line).
    pub claims: Vec<Candidate>,
    /// The id's lease rows: a state_id's one, a pool's that may matter.
    pub leases: Vec<StoredLease>,
    /// With no live claim: the gateway whose claim lapsed while its leases
    /// ran, if nobody claimed the id since and it advertised a URL. It may
    /// re-win the claim and keep them (see `locks::slot::Lapsed`), so it is
    /// asked first.
    pub lapsed: Option<Candidate>,
}

impl Authority {
    /// The gateway holding the claim, if any does.
    pub fn holder(&self) -> Option<&Candidate> {
        self.claims.first()
    }

    /// The recorded lease rows whose leases are in force, oldest first.
    pub fn in_force(&self) -> impl Iterator<Item = &StoredLease> {
        self.leases.iter().filter(|stored| {
            in_force(stored, |gateway| {
                self.claims.iter().any(|c| c.gateway_id == gateway)
            })
        })
    }

    /// The gateway to ask first when no claim is live: the lapsed holder,
    /// unless it is `me`.
    pub fn lapsed_holder(&self, me: Uuid) -> Option<&Candidate> {
        self.lapsed
            .as_ref()
            .filter(|c| self.claims.is_empty() && c.gateway_id != me)
    }

    /// The latest recorded lease in force: a state_id's lease.
    pub fn lease_in_force(&self) -> Option<&Lease> {
        self.in_force().last().map(|stored| &stored.record.lease)
    }
}

/// Whether a recorded lease is in force: this is the one place the rule is
/// written. Unexpired, and either handed over at a shutdown (no gateway
/// holds it; the next authority adopts it) or held by a gateway whose claim
/// on the id is live: a lease ends with its authority's claim.
pub(super) fn in_force(stored: &StoredLease, has_claim: impl Fn(Uuid) -> bool) -> bool {
    stored.unexpired
        && match stored.record.state {
            LeaseState::HandedOver => true,
            LeaseState::Held => has_claim(stored.record.lease.gateway_id),
            LeaseState::Released => false,
        }
}

/// The leases in force among every id's unexpired lease rows, by the
/// protocol's word on who holds a live claim: `has_claim(locks, id,
/// gateway)`, with the id's candidates in `locks`.
pub(super) fn leases_in_force(
    unexpired: Vec<IdLocks>,
    has_claim: impl Fn(&[Candidate], &StateId, Uuid) -> bool,
) -> Vec<Lease> {
    unexpired
        .into_iter()
        .flat_map(
            |IdLocks {
                 candidates, leases, ..
             }| {
                let has_claim = &has_claim;
                leases.into_iter().filter_map(move |stored| {
                    let id = &stored.record.lease.state_id;
                    in_force(&stored, |gateway| has_claim(&candidates, id, gateway))
                        .then(|| stored.record.lease.clone())
                })
            },
        )
        .collect()
}
