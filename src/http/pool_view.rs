//! How the API shows a pool: its limit, who holds it (never with lease ids,
//! which would let a reader act as a holder) and how many wait, in
//! `/v1/pools` and in the 409 of a full pool.

use serde::Serialize;

use super::wire::rfc3339_millis;
use crate::domain::{Lease, LeaseInfo, StateId};
use crate::locks::Occupancy;

#[derive(Debug, Serialize)]
pub struct PoolView {
    pool: String,
    limit: usize,
    holders: Vec<PoolHolder>,
    waiting: usize,
}

/// One lease of a pool, as everyone but its holder sees it.
#[derive(Debug, Serialize)]
struct PoolHolder {
    owner: String,
    fencing_token: u64,
    acquired_at: String,
    expires_at: String,
    gateway_id: String,
    lock_delay_seconds: u64,
    info: LeaseInfo,
}

impl From<&Lease> for PoolHolder {
    fn from(lease: &Lease) -> Self {
        Self {
            owner: lease.owner.clone(),
            fencing_token: lease.fencing_token,
            acquired_at: rfc3339_millis(lease.acquired_ms),
            expires_at: rfc3339_millis(lease.expires_ms),
            gateway_id: lease.gateway_id.to_string(),
            lock_delay_seconds: lease.lock_delay.as_secs(),
            info: lease.info.clone(),
        }
    }
}

impl PoolView {
    /// A pool of `limit` that no lease holds: its places are kept by
    /// lock-delays, or came free a moment ago.
    pub fn empty(name: &StateId, limit: usize) -> Self {
        Self {
            pool: name.as_str().to_owned(),
            limit,
            holders: Vec::new(),
            waiting: 0,
        }
    }

    pub fn holders_len(&self) -> usize {
        self.holders.len()
    }

    pub fn limit(&self) -> usize {
        self.limit
    }
}

impl From<&Occupancy> for PoolView {
    fn from(occupancy: &Occupancy) -> Self {
        Self {
            pool: occupancy.id.as_str().to_owned(),
            limit: occupancy.limit,
            holders: occupancy.holders.iter().map(PoolHolder::from).collect(),
            waiting: occupancy.waiting,
        }
    }
}
