//! How the API shows a lease to anyone but its holder: in `/v1/locks`,
//! `/v1/pools` and the problems that name who holds an id.

use serde::Serialize;

use super::wire::rfc3339_millis;
use crate::domain::{Lease, LeaseInfo};

/// A lock as everyone else sees it: who holds it and until when, but never
/// the lease_id, which would let a reader write as the holder.
#[derive(Serialize)]
pub struct LockView {
    state_id: String,
    #[serde(flatten)]
    holder: HolderView,
}

/// A lease as anyone but its holder sees it, on a state_id or in a pool.
#[derive(Debug, Serialize)]
pub struct HolderView {
    owner: String,
    fencing_token: u64,
    acquired_at: String,
    expires_at: String,
    gateway_id: String,
    lock_delay_seconds: u64,
    info: LeaseInfo,
}

impl From<&Lease> for HolderView {
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

impl From<&Lease> for LockView {
    fn from(lease: &Lease) -> Self {
        Self {
            state_id: lease.state_id.as_str().to_owned(),
            holder: HolderView::from(lease),
        }
    }
}
