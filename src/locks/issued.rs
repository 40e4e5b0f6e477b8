//! The tickets this gateway issued as an authority (see `ticket`), until
//! their senders settle them: each holds its writes' permit, so no lease
//! on their ids is granted meanwhile.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use uuid::Uuid;

use super::error::LockError;
use super::ticket::{TicketGrant, TicketLease};
use super::write::{Admitted, Sending};
use crate::domain::StateId;

#[derive(Default)]
pub(super) struct Issued {
    tickets: Mutex<HashMap<Uuid, Ticket>>,
}

struct Ticket {
    ids: Vec<StateId>,
    permit: Sending,
}

impl Issued {
    fn tickets(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Ticket>> {
        self.tickets.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `admitted`, the writes to `ids` this gateway admitted as
    /// their authority, as sending under a new ticket. Answers the index of
    /// the first write refused as it is registered.
    pub fn issue(
        &self,
        ids: Vec<StateId>,
        admitted: &[Admitted],
    ) -> Result<TicketGrant, (usize, LockError)> {
        let permit = Sending::all(admitted)?;
        let leases = admitted
            .iter()
            .map(|write| {
                write.lease().map(|lease| TicketLease {
                    owner: lease.owner.clone(),
                    fencing_token: lease.fencing_token,
                })
            })
            .collect();
        let ticket = Uuid::new_v4();
        let budget_ms = u64::try_from(permit.budget().as_millis()).unwrap_or(u64::MAX);
        let mut tickets = self.tickets();
        // A ticket its sender never settled is dropped once its budget is
        // spent: its ids stay ungrantable while the write may still land.
        let now = Instant::now();
        tickets.retain(|_, ticket| ticket.permit.until() > now);
        tickets.insert(ticket, Ticket { ids, permit });
        Ok(TicketGrant {
            ticket,
            budget_ms,
            leases,
        })
    }

    /// Settles a ticket: with the outcome `known`, its ids are free for the
    /// next grant at once; else once the write can no longer land.
    /// `before_release` sees the ids first. False for an unknown ticket.
    pub fn settle(
        &self,
        ticket: Uuid,
        known: bool,
        before_release: impl FnOnce(&[StateId]),
    ) -> bool {
        let Some(ticket) = self.tickets().remove(&ticket) else {
            return false;
        };
        before_release(&ticket.ids);
        ticket.permit.settle(known);
        true
    }
}
