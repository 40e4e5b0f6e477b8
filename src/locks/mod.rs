//! Lease-style locks, on two levels (see docs/locks.md):
//!
//! 1. The gateway claim, in ClickHouse ([`claim`]): before this gateway
//!    grants the first lease on a state_id it wins the id's claim, by one of
//!    two protocols chosen with `--coordination`. In table mode it proposes
//!    a candidate row in the lease table, waits the settle time, and holds
//!    the claim only if its candidate is the earliest live one. In keeper
//!    mode the claim is the id's key in a KeeperMap table, won by one
//!    conditional write (created, or taken over once released or lapsed),
//!    with no settle. The claim holder is the id's authority: other
//!    gateways forward the id's lock operations and lock-checked writes to it
//!    ([`forward`]). Held claims are renewed in the background
//!    ([`maintain`]), dropped when idle, and handed back at shutdown; a
//!    crashed gateway's claims lapse.
//! 2. Worker leases, in memory ([`slot`]): the authority grants, renews and
//!    releases leases first come, first served with no ClickHouse round trip;
//!    their rows, for other gateways' views, are written behind ([`record`]).
//!    A slot holds one lease on a state_id, up to its limit on a pool: pools
//!    are this same core over tables of their own, one `LockManager` each.
//!
//! Invariants, for checking the code against:
//! - One authority per state_id: a gateway grants, renews and releases leases
//!   on an id only while it holds the claim, and stops at `valid_until`, a
//!   tenth of the claim TTL before the claim can lapse in ClickHouse. Another
//!   gateway wins the claim only once this one's has lapsed or been given up:
//!   its candidate row withdrawn (table mode), or its key released (keeper
//!   mode).
//! - No lease dead on arrival: a grant needs at least half the claim TTL of
//!   validity left; a claim with less is renewed first. These fractions of
//!   the TTL, and every other wait they imply, are kept in [`timing`].
//! - Fencing tokens strictly increase per state_id: a new authority reserves
//!   a block of tokens above every token reserved or recorded before (in the
//!   lease table, and in keeper mode in the id's key as well), and the
//!   reservation is written before any token from it is handed out.
//! - A lease lives as long as its authority's claim: a lapse (a crash, a
//!   freeze, or ClickHouse out of reach for most of the claim TTL) ends it
//!   for writes, and the next authority does not adopt it, but its recorded
//!   place is kept until it would have expired (`claim::claimant::place_end`).
//!   A gateway that shuts down hands its leases on (their rows marked handed
//!   over, written before its claims are withdrawn) and the next authority
//!   adopts them.
//! - A peer that answers nothing is treated as a dead one: a forward to it
//!   fails once its claim has lapsed and it answers no probe, and every
//!   client request is answered within its wait and 5 s ([`forward`]).
//! - A lease's end waits for its admitted writes: a write is checked again
//!   as it goes out, and refused (409) if its lease ended meanwhile; one
//!   that went out in time keeps the next grant here, and the hand-over of
//!   the claim, waiting until it has landed or failed, within the query
//!   timeout and the claim's validity ([`write`]). So the next holder reads
//!   every acknowledged write.
//! - A grant to a forwarded acquire lasts a few seconds until the forwarding
//!   gateway confirms it reached its client: an answer lost on the way does
//!   not hold the id for the whole TTL (`http::forward`).
//! - An acquire abandoned at any await point (its client hung up) leaves the
//!   line, clears its claim attempt and withdraws the claim it was making
//!   (its candidate row, or its key): guards in [`slot`] and [`claim`]. A
//!   pool's grant is answered only once its row has landed; one dropped
//!   before that is taken back ([`acquire`]). A write abandoned in flight
//!   keeps its id from the next grant until its time budget is spent, since
//!   it may still land.
//! - What a waiter does next is decided by a pure function of the slot's
//!   state and the time (`SlotState::next_step`); its effects (grants' rows,
//!   withdrawals) are carried out by the caller, outside the slot's lock.
//! - Every other change to a slot is a transition of `SlotState` that
//!   answers its effects the same way; `Slot::apply` runs it under the lock
//!   and is the one place that wakes waiters, after the lock is released.
//!   Whether a claim and a lease are still live for a write is decided by
//!   the slot too (`SlotState::standing`).

mod acquire;
mod claim;
mod error;
mod forward;
mod issued;
mod maintain;
mod manager;
mod occupancy;
mod peer;
mod record;
mod slot;
mod slots;
mod ticket;
mod timing;
mod write;
mod write_claim;

pub use self::acquire::Ask;
pub use self::error::LockError;
pub use self::forward::ForwardError;
pub use self::manager::LockManager;
pub use self::occupancy::{Occupancy, Waiting};
pub use self::peer::{FORWARDED_BY, FORWARDED_TO, GATEWAY_ID, Peer, Route, SeenLease, uuid_header};
pub use self::ticket::{TICKETS_PATH, TicketGrant, TicketRequest};
pub use self::timing::UNCONFIRMED_GRANT;
pub use self::write::{Admitted, Sending};
pub use crate::config::LockSettings;
pub use crate::domain::Lease;
