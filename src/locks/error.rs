//! Why a lock operation, or a write under the lock rule, was refused.

use uuid::Uuid;

use super::peer::Peer;
use crate::domain::{Lease, StateId};
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("{state_id} is locked by another holder")]
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
    /// As `Locked`, told by the id's authority, another gateway.
    #[error("{0} is locked; writes need the holder's Lease-Id")]
    LockedElsewhere(StateId),
    /// The claim a write was admitted under went before the write went out
    /// (a hand-over or a lapse): the id's authority is moving.
    #[error("the claim on {0} moved while the write was on its way; retry shortly")]
    Moving(StateId),
    /// The id's claim lapsed here while its leases ran (Keeper or ClickHouse
    /// out of reach past the claim TTL): their renewals and writes are not
    /// done until the claim is re-won, or found taken (then 409).
    #[error(
        "the claim on {0} lapsed while Keeper or ClickHouse was out of reach; nothing was done or written; retry shortly"
    )]
    Lapsed(StateId),
    /// An acquire's last claim attempt could not settle before its wait ran
    /// out: its own claim ran out first (Keeper or ClickHouse slower than
    /// the claim TTL) or an earlier one of this gateway's was still ahead,
    /// and ClickHouse records no holder. Nobody is known to hold the id, so
    /// it is not a 409: nothing was granted, try again.
    #[error(
        "the claim on {0} could not be settled in time (Keeper or ClickHouse answered slower than the claim TTL); no holder is recorded and nothing was granted; retry shortly"
    )]
    Unsettled(StateId),
    /// This gateway holds no claim on the id, so it cannot admit a write
    /// to it for another gateway (a ticket asked of the wrong gateway).
    #[error("this gateway is not the authority for {0}")]
    NotAuthority(StateId),
    /// Another gateway won the claim: the request belongs there.
    #[error("gateway {} is the authority for this state_id", .0.gateway_id)]
    Elsewhere(Peer),
    /// A lease with a lock-delay ended (expiry, force-unlock): nothing is
    /// granted on the id until `free_at_ms`, past the acquire's wait.
    #[error("{state_id} is in a lock-delay after its last lease ended; retry once it is free")]
    Delayed { state_id: StateId, free_at_ms: i64 },
    /// A pool in use (held or waited on) takes acquires of its own limit only.
    #[error("pool {state_id} is in use with a limit of {limit}")]
    LimitMismatch { state_id: StateId, limit: usize },
    #[error(transparent)]
    Store(#[from] StoreError),
}
