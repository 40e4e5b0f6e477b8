//! How the API shows a pool: its limit, who holds it (never with lease ids,
//! which would let a reader act as a holder) and how many wait, in
//! `/v1/pools` and in the 409 of a full pool.

use serde::Serialize;

use super::lock_view::HolderView;
use crate::domain::StateId;
use crate::locks::Occupancy;

#[derive(Debug, Serialize)]
pub struct PoolView {
    pool: String,
    limit: usize,
    holders: Vec<HolderView>,
    waiting: usize,
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
            holders: occupancy.holders.iter().map(HolderView::from).collect(),
            waiting: occupancy.waiting,
        }
    }
}
