//! What the slot's unit tests start from: this gateway, a waiter, a claim
//! held until a given instant, and the gateway's rules.

use super::*;

/// This gateway's id in every slot test.
pub const GATEWAY: Uuid = Uuid::from_u128(7);

pub fn state_id(name: &str) -> StateId {
    StateId::parse(name.to_owned()).unwrap()
}

pub fn rules() -> Rules {
    Rules {
        gateway_id: GATEWAY,
        grant_margin: Duration::from_secs(5),
        holder_grace: Duration::from_secs(2),
    }
}

/// One slot of `limit`, at the default priority.
pub fn one_of(limit: usize) -> Asking {
    Asking {
        limit,
        slots: 1,
        priority: 0,
    }
}

/// A line of waiters for one slot each at the default priority, in this order.
pub fn line(tickets: &[u64]) -> VecDeque<Queued> {
    tickets
        .iter()
        .map(|&ticket| Queued {
            ticket,
            priority: 0,
            slots: 1,
        })
        .collect()
}

/// A waiter for a lease of one slot for 30 s with no lock-delay, giving up
/// at `deadline`.
pub fn waiter(ticket: u64, deadline: Instant) -> Waiter<'static> {
    Waiter {
        ticket,
        slots: 1,
        owner: "worker",
        ttl: Duration::from_secs(30),
        deadline,
        attempted_claim: false,
        lock_delay: Duration::ZERO,
        info: LeaseInfo::default(),
    }
}

/// This gateway's claim `claim_id`, valid until `valid_until`, uncontested.
pub fn claim(claim_id: Uuid, valid_until: Instant) -> HeldClaim {
    HeldClaim {
        candidate: Candidate {
            claim_id,
            gateway_id: GATEWAY,
            created_ms: 0,
            advertise_url: String::new(),
            expires_ms: 0,
        },
        valid_until,
        handover: false,
    }
}

/// The gateway an orphaned lease was granted by: an earlier authority.
pub const DEAD: Uuid = Uuid::from_u128(9);

/// A lease of `slots` on `id` that the earlier authority [`DEAD`] granted
/// with token `token` and `lock_delay`, as a claim won inherits it when
/// that authority lost its claim: it would expire in `secs`, at `now_ms`
/// + `secs` by the wall clock.
pub fn orphan(
    id: &StateId,
    token: u64,
    slots: usize,
    secs: u64,
    now: Instant,
    now_ms: i64,
) -> LocalLease {
    let expires_ms = now_ms + i64::try_from(secs * 1_000).unwrap();
    LocalLease {
        lease: Lease {
            state_id: id.clone(),
            lease_id: Uuid::new_v4(),
            owner: "gone-worker".to_owned(),
            fencing_token: token,
            gateway_id: DEAD,
            acquired_ms: now_ms - 1_000,
            expires_ms,
            lock_delay: Duration::ZERO,
            info: LeaseInfo::default(),
            limit: slots,
            slots,
        },
        version: LeaseVersion::granted(token),
        deadline: now + Duration::from_secs(secs),
    }
}
