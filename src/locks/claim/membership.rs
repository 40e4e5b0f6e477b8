//! Table mode's members: the gateways that take part in claims, each with a
//! row in `<table>_members` that its heartbeat keeps live (see
//! docs/gateways.md, "A lone gateway claims without settling"). The rule:
//!
//! - A gateway sends no candidate until one settle after its join landed,
//!   and none once its row may have lapsed: it re-joins and waits again.
//! - A member that reads that no other member is live may win a claim
//!   without settling, if its candidate's write completed within
//!   `alone_window` of the start of that read. Any gateway the read missed
//!   joined after it began, so it sends its first candidate a settle after
//!   that, later than the lone one's: it sees it ahead in line. Any member
//!   whose row had lapsed sent its last candidate a settle before, so it
//!   is in the lone one's read of the id's rows.
//!
//! Every fraction of the settle this takes is in `timing`.

use std::time::Instant;

use tokio::sync::Mutex;
use uuid::Uuid;

use crate::locks::timing::ClaimTiming;
use crate::store::{MemberStore, StoreError};

/// This gateway's membership, for one lock core's claims.
pub(super) struct Membership {
    store: MemberStore,
    gateway_id: Uuid,
    timing: ClaimTiming,
    /// Held across each beat and read, so that concurrent first acquires
    /// share one.
    standing: Mutex<Standing>,
}

/// What this gateway knows of its own membership.
#[derive(Default)]
struct Standing {
    /// Until when it may send candidates: from its last beat's send.
    valid_until: Option<Instant>,
    /// From when it may claim: a settle after its (re-)join landed.
    settled_at: Option<Instant>,
    /// The last read of the other members: when it started, and whether
    /// it found none live.
    read: Option<(Instant, bool)>,
}

impl Standing {
    fn valid(&self, at: Instant) -> bool {
        self.valid_until.is_some_and(|until| at < until)
    }
}

/// May a claim be made now, and may it skip the settle.
pub(super) enum Turn {
    /// A claim may be made; it wins without settling if its candidate's
    /// write completes by `until` and the membership held throughout
    /// ([`Membership::still_alone`]).
    Alone { since: Instant, until: Instant },
    /// A claim may be made, and settles: another member is live.
    Settle,
}

impl Membership {
    pub fn new(store: MemberStore, gateway_id: Uuid, timing: ClaimTiming) -> Self {
        Self {
            store,
            gateway_id,
            timing,
            standing: Mutex::new(Standing::default()),
        }
    }

    /// Writes one heartbeat (the join, when the last one's validity ran
    /// out): the maintenance task calls it every `member_beat`.
    pub async fn beat(&self) -> Result<(), StoreError> {
        let mut standing = self.standing.lock().await;
        self.beat_under(&mut standing).await
    }

    async fn beat_under(&self, standing: &mut Standing) -> Result<(), StoreError> {
        let sent = Instant::now();
        self.store
            .beat(self.gateway_id, self.timing.member_ttl())
            .await?;
        if !standing.valid(sent) {
            // A join, or a re-join after a lapse: other members may have
            // read that this gateway is gone, and claimed without settling.
            standing.settled_at = Some(self.timing.member_settled_at(Instant::now()));
            standing.read = None;
        }
        standing.valid_until = Some(self.timing.member_valid_until(sent));
        Ok(())
    }

    /// Waits until this gateway may claim (joining first if its row may
    /// have lapsed), and says whether it may skip the settle.
    pub async fn turn(&self) -> Result<Turn, StoreError> {
        loop {
            let mut standing = self.standing.lock().await;
            let now = Instant::now();
            if !standing.valid(now) {
                self.beat_under(&mut standing).await?;
                continue;
            }
            if let Some(settled_at) = standing.settled_at.filter(|&at| now < at) {
                drop(standing);
                tokio::time::sleep_until(settled_at.into()).await;
                continue;
            }
            let fresh = self.timing.members_read_fresh();
            let (since, alone) = match standing.read.filter(|(at, _)| now < *at + fresh) {
                Some(read) => read,
                None => {
                    let alone = !self.store.others_live(self.gateway_id).await?;
                    standing.read = Some((now, alone));
                    (now, alone)
                }
            };
            return Ok(if alone {
                Turn::Alone {
                    since,
                    until: since + self.timing.alone_window(),
                }
            } else {
                Turn::Settle
            });
        }
    }

    /// Whether a candidate whose write completed at `landed` wins without
    /// settling, after `turn` answered `Alone { since, until }`: it landed
    /// in time, and this gateway was a settled member from before the read
    /// until the candidate landed (a re-join since resets `settled_at`).
    pub async fn still_alone(&self, since: Instant, until: Instant, landed: Instant) -> bool {
        let standing = self.standing.lock().await;
        landed < until
            && standing.valid(landed)
            && standing.settled_at.is_some_and(|at| at <= since)
    }
}
