//! Who holds an id, how many of its slots they hold, and who waits: as the
//! id's authority sees it in its slot, or as ClickHouse records it.

use super::slot::SlotState;
use crate::domain::{Lease, StateId};

/// Who holds an id and who waits for it.
#[derive(Debug)]
pub struct Occupancy {
    pub id: StateId,
    /// How many slots it has: 1 on a state_id, a pool's limit.
    pub limit: usize,
    /// How many slots its leases hold.
    pub used: usize,
    /// Its leases, oldest first.
    pub holders: Vec<Lease>,
    pub waiting: usize,
    /// The waiters in the order they are granted; empty where only
    /// ClickHouse's record is known (only the authority knows who waits).
    pub waiters: Vec<Waiting>,
}

/// A waiter in line, as views show it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waiting {
    pub priority: i32,
    pub slots: usize,
}

impl Occupancy {
    /// As the id's authority sees it; None when none holds or waits. The
    /// leases of an earlier authority that keep their places here (its claim
    /// lapsed while they ran) are among the holders: they keep others out
    /// until they would have expired, and a refused acquire names them.
    pub(super) fn of(id: &StateId, st: &SlotState) -> Option<Self> {
        // Granted before any lease of this authority's: oldest first.
        let mut holders = st.orphaned();
        let waiters: Vec<Waiting> = st
            .waiters()
            .into_iter()
            .map(|q| Waiting {
                priority: q.priority,
                slots: q.slots,
            })
            .collect();
        holders.extend(st.holders());
        let used = holders.iter().map(|l| l.slots).sum();
        let occupancy = Self {
            id: id.clone(),
            limit: st.limit(),
            used,
            holders,
            waiting: waiters.len(),
            waiters,
        };
        (!occupancy.holders.is_empty() || occupancy.waiting > 0).then_some(occupancy)
    }

    /// As ClickHouse records it: holders only, with the limit they were
    /// granted under; None when there are none.
    pub(super) fn recorded(id: StateId, holders: Vec<Lease>) -> Option<Self> {
        let limit = holders.iter().map(|l| l.limit).max()?;
        Some(Self {
            id,
            limit,
            used: holders.iter().map(|l| l.slots).sum(),
            holders,
            waiting: 0,
            waiters: Vec::new(),
        })
    }
}
