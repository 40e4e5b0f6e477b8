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
