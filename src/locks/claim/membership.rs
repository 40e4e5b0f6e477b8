//! Table mode's members: the gateways that take part in claims, each with a
//! row in `<table>_members` that its heartbeat keeps live (see
//! docs/gateways.md, "A lone gateway claims without settling"). The rule:
//!
//! - Every table-mode gateway is a member, whatever its settle. It writes no
//!   claim row (a candidate or a renewal) until `JOIN_WAIT` after its join
//!   was answered, nor after a beat answered too late to be sure its row
//!   never lapsed: that beat is a join again.
//! - A claim row counts only if its write was answered while the membership
//!   it was sent under still held: answered in time, it was visible before
//!   the member's row could lapse.
//! - A member whose candidate has landed may decide its claim without
//!   settling if one read sent after that found no other live member and no
//!   gateway of an earlier version beside the id's rows, and was answered
//!   within the alone window of its send.
//!
//! Every fraction this takes is in `timing`.

use std::sync::Mutex;
use std::time::Instant;

use uuid::Uuid;

use crate::domain::StateId;
use crate::locks::timing::ClaimTiming;
use crate::store::{IdLocks, LeaseStore, MemberStore, StoreError};

/// This gateway's membership, for one lock core's claims.
pub(super) struct Membership {
    store: MemberStore,
    gateway_id: Uuid,
    timing: ClaimTiming,
    standing: Mutex<Standing>,
    /// Held across each beat, so that claims that find the membership
    /// lapsed share one join.
    beating: tokio::sync::Mutex<()>,
}

/// What this gateway knows of its own membership.
#[derive(Default)]
struct Standing {
    /// Counts joins: a claim row sent under one counts only in it.
    epoch: u64,
    /// Until when claim rows answered count: from the last beat's send.
    valid_until: Option<Instant>,
    /// When this join was answered: the row has been live since.
    joined_at: Option<Instant>,
    /// From when claim rows may be written: `JOIN_WAIT` after the join.
    settled_at: Option<Instant>,
}

impl Standing {
    fn valid(&self, at: Instant) -> bool {
        self.valid_until.is_some_and(|until| at < until)
    }

    /// A beat sent at `sent` was answered at `answered`. Answered while the
    /// membership held, it landed before the row could lapse and carries
    /// the join on; else the row may have lapsed meanwhile and other
    /// gateways may have read this one gone: it is a join.
    fn beaten(&mut self, sent: Instant, answered: Instant, timing: &ClaimTiming) {
        if !self.valid(answered) {
            self.epoch += 1;
            self.joined_at = Some(answered);
            self.settled_at = Some(timing.member_settled_at(answered));
        }
        self.valid_until = Some(timing.member_valid_until(sent));
    }
}

/// Leave to write claim rows, in one join.
#[derive(Clone, Copy)]
pub(super) struct Pass {
    epoch: u64,
}

impl Membership {
    pub fn new(store: MemberStore, gateway_id: Uuid, timing: ClaimTiming) -> Self {
        Self {
            store,
            gateway_id,
            timing,
            standing: Mutex::new(Standing::default()),
            beating: tokio::sync::Mutex::new(()),
        }
    }

    fn standing(&self) -> std::sync::MutexGuard<'_, Standing> {
        self.standing.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes one heartbeat (a join, when the last one's validity ran out):
    /// the maintenance task calls it every `member_beat`.
    pub async fn beat(&self) -> Result<(), StoreError> {
        let _one = self.beating.lock().await;
        self.beat_once().await
    }

    async fn beat_once(&self) -> Result<(), StoreError> {
        let sent = Instant::now();
        self.store
            .beat(self.gateway_id, self.timing.member_ttl())
            .await?;
        self.standing().beaten(sent, Instant::now(), &self.timing);
        Ok(())
    }

    /// Waits until this gateway may write a claim row, joining first if its
    /// membership lapsed.
    pub async fn ready(&self) -> Result<Pass, StoreError> {
        loop {
            let now = Instant::now();
            let (valid, settled_at, epoch) = {
                let standing = self.standing();
                (standing.valid(now), standing.settled_at, standing.epoch)
            };
            if !valid {
                let _one = self.beating.lock().await;
                if !self.standing().valid(Instant::now()) {
                    self.beat_once().await?;
                }
                continue;
            }
            if let Some(at) = settled_at.filter(|&at| now < at) {
                tokio::time::sleep_until(at.into()).await;
                continue;
            }
            return Ok(Pass { epoch });
        }
    }

    /// Whether a claim row written under `pass` and answered just now
    /// counts: the join it was sent in still holds.
    pub fn counts(&self, pass: Pass) -> bool {
        let standing = self.standing();
        standing.epoch == pass.epoch && standing.valid(Instant::now())
    }

    /// Whether this gateway has been a member without a break since `at`
    /// and still is: a gateway that read no other member live while this
    /// one was did not skip its settle.
    pub fn member_since(&self, at: Instant) -> bool {
        let standing = self.standing();
        standing.joined_at.is_some_and(|joined| joined <= at) && standing.valid(Instant::now())
    }

    /// Reads `id`'s rows in `leases` and, in the same statement, whether
    /// any other gateway may claim (a live member, or a table-mode gateway
    /// of an earlier version, which keeps no members row). Answers the rows
    /// if this gateway may decide its claim by them without settling: no
    /// other gateway may claim, and the answer came within the alone window
    /// of the moment the read was sent. Call it only after the candidate
    /// landed.
    pub async fn alone(
        &self,
        leases: &LeaseStore,
        id: &StateId,
    ) -> Result<Option<IdLocks>, StoreError> {
        let began = Instant::now();
        let (locks, others) = leases
            .id_locks_and_others(id, &self.store, self.gateway_id)
            .await?;
        let in_time = Instant::now() < began + self.timing.alone_window();
        Ok((!others && in_time).then_some(locks))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_beat_answered_in_time_carries_the_join_on_and_a_late_one_joins_again() {
        let t = ClaimTiming::for_tests();
        let mut standing = Standing::default();
        let start = Instant::now();
        standing.beaten(start, start + Duration::from_millis(10), &t);
        assert_eq!(standing.epoch, 1, "the first beat is a join");
        let settled = standing.settled_at.unwrap();
        let next = start + t.member_beat();
        standing.beaten(next, next + Duration::from_millis(10), &t);
        assert_eq!(standing.epoch, 1);
        assert_eq!(standing.settled_at, Some(settled));
        assert_eq!(standing.valid_until, Some(t.member_valid_until(next)));
        // Sent in time, answered after the validity ran out: its row may
        // have lapsed before it landed.
        let late = next + t.member_ttl();
        standing.beaten(next + t.member_beat(), late, &t);
        assert_eq!(standing.epoch, 2);
        assert_eq!(standing.joined_at, Some(late));
        assert_eq!(standing.settled_at, Some(t.member_settled_at(late)));
    }
}
