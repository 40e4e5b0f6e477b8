//! A lease, and the vocabulary of its rows: their order and what they say of it.

use std::time::Duration;

use uuid::Uuid;

use super::{LeaseInfo, StateId};

/// A granted lease: who may write a state_id, until when, under which fencing token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub state_id: StateId,
    pub lease_id: Uuid,
    pub owner: String,
    /// Strictly increases per state_id across gateways and restarts.
    pub fencing_token: u64,
    /// The gateway that granted it, and the only one that renews or releases it.
    pub gateway_id: Uuid,
    pub acquired_ms: i64,
    pub expires_ms: i64,
    /// Once this lease ends by expiry or force-unlock, no lease on its id is
    /// granted for this long: time for the holder's run to be stopped
    /// (lock-delay). A release ends it with no delay.
    pub lock_delay: Duration,
    /// What its holder said of itself on acquire (host, pid, command...).
    pub info: LeaseInfo,
    /// How many places its id has: 1 on a state_id, a pool's limit.
    pub limit: usize,
    /// How many of those places it occupies: 1 on a state_id, 1..=limit on a pool.
    pub slots: usize,
}

impl Lease {
    /// When its id may be granted again after the lease ended at `ended_ms`
    /// (ms since the epoch): its lock-delay later.
    pub fn free_at_ms(&self, ended_ms: i64) -> i64 {
        let delay = i64::try_from(self.lock_delay.as_millis()).unwrap_or(i64::MAX);
        ended_ms.saturating_add(delay)
    }
}

/// A lease row's version. ReplacingMergeTree keeps the row with the highest
/// version, so the order of a lease's rows is encoded here, in one place: the
/// fencing token in the high bits (a later lease beats an earlier one), a
/// renewal count below it, and all ones there once the lease is released (a
/// release beats every renewal of its lease, whatever order they land in).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LeaseVersion(u64);

impl LeaseVersion {
    const SEQ_BITS: u32 = 20;
    const RELEASED_SEQ: u64 = (1 << Self::SEQ_BITS) - 1;

    pub fn granted(fencing_token: u64) -> Self {
        Self(fencing_token << Self::SEQ_BITS)
    }

    /// The next renewal; past 2^20 - 2 renewals the count stays put, which
    /// only costs the tie-break between two renewals of one lease.
    pub fn renewed(self) -> Self {
        let seq = self.0 & Self::RELEASED_SEQ;
        if seq + 1 >= Self::RELEASED_SEQ {
            self
        } else {
            Self(self.0 + 1)
        }
    }

    pub fn released(self) -> Self {
        Self(self.0 | Self::RELEASED_SEQ)
    }

    /// The version as stored: the number ReplacingMergeTree compares.
    pub fn from_bits(bits: u64) -> Self {
        Self(bits)
    }

    pub fn bits(self) -> u64 {
        self.0
    }
}

/// What a lease row says of its lease (the `released` column).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseState {
    /// Granted, and in force while its gateway holds the claim.
    Held = 0,
    Released = 1,
    /// Its gateway shut down and handed it on: the next claim holder adopts it.
    HandedOver = 2,
}

impl LeaseState {
    /// The state a `released` column value stands for; an unknown value
    /// reads as released, a lease no longer in force.
    pub fn from_column(value: u8) -> Self {
        match value {
            0 => Self::Held,
            2 => Self::HandedOver,
            _ => Self::Released,
        }
    }
}
