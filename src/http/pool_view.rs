//! How the API shows a pool: its limit and the slots held, who holds it
//! (never with lease ids, which would let a reader act as a holder) and who
//! waits, in `/v1/pools` and in the 409 of a full pool.

use serde::Serialize;

use super::lock_view::HolderView;
use crate::domain::{Lease, StateId};
use crate::locks::{Occupancy, Waiting};

#[derive(Debug, Serialize)]
pub struct PoolView {
    pool: String,
    limit: usize,
    /// The slots its holders hold.
    used: usize,
    holders: Vec<PoolHolderView>,
    waiting: usize,
    /// In the order they will be granted.
    waiters: Vec<WaiterView>,
}

/// A pool's holder: a lock's holder, with the slots it holds.
#[derive(Debug, Serialize)]
struct PoolHolderView {
    #[serde(flatten)]
    holder: HolderView,
    slots: usize,
}

impl From<&Lease> for PoolHolderView {
    fn from(lease: &Lease) -> Self {
        Self {
            holder: HolderView::from(lease),
            slots: lease.slots,
        }
    }
}

/// A waiter, as anyone sees it: how much it asks for, and its place in line.
#[derive(Debug, Serialize)]
struct WaiterView {
    priority: i32,
    slots: usize,
}

impl From<&Waiting> for WaiterView {
    fn from(waiting: &Waiting) -> Self {
        Self {
            priority: waiting.priority,
            slots: waiting.slots,
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
            used: 0,
            holders: Vec::new(),
            waiting: 0,
            waiters: Vec::new(),
        }
    }

    pub fn used(&self) -> usize {
        self.used
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
            used: occupancy.used,
            holders: occupancy.holders.iter().map(PoolHolderView::from).collect(),
            waiting: occupancy.waiting,
            waiters: occupancy.waiters.iter().map(WaiterView::from).collect(),
        }
    }
}
