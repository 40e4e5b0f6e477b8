//! The claim timing, in one place: every fraction of the claim TTL and every
//! wait derived from the settle time or the query timeout that the lock core
//! applies. The invariants at the top of `locks` are stated in these terms,
//! so a change of one rule is a change here, checked by the tests below.

use std::time::{Duration, Instant};

use crate::config::LockSettings;

/// How long a lease granted to a forwarded acquire lasts until the
/// forwarding gateway confirms it, by renewing it to the TTL its client
/// asked for (see `http::forward`): a grant whose answer never reaches its
/// client then frees the id after this, not after the whole TTL.
pub const UNCONFIRMED_GRANT: Duration = Duration::from_secs(3);

/// The least time a 409 spends looking again for a holder that another
/// gateway granted a moment ago: its lease row follows the grant within one
/// flush of the recorder (at most a second apart).
const HOLDER_WAIT: Duration = Duration::from_secs(3);

/// How long a table-mode member's row lives without a heartbeat: what it is
/// written with (see `claim::membership`).
const MEMBER_TTL: Duration = Duration::from_secs(15);

/// How long a gateway that joins (or joins again after its row may have
/// lapsed) waits before it writes any claim row: twice the alone window,
/// whatever the settle, so that gateways with different settles still
/// keep the margin (see `claim::membership`).
const JOIN_WAIT: Duration = Duration::from_millis(500);

/// The claim TTL, the settle time and the query timeout, and what follows
/// from them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ClaimTiming {
    ttl: Duration,
    settle: Duration,
    idle: Duration,
    query_timeout: Duration,
}

impl ClaimTiming {
    pub fn new(settings: &LockSettings, query_timeout: Duration) -> Self {
        Self {
            ttl: settings.claim_ttl,
            settle: settings.settle,
            idle: settings.claim_idle,
            query_timeout,
        }
    }

    /// A 10 s claim TTL, a 1 s settle, a 10 s query timeout: for tests of
    /// what uses the timing.
    #[cfg(test)]
    pub fn for_tests() -> Self {
        Self {
            ttl: Duration::from_secs(10),
            settle: Duration::from_secs(1),
            idle: Duration::from_secs(60),
            query_timeout: Duration::from_secs(10),
        }
    }

    /// How long a claim lives without renewal: what it is written with.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// How long a table-mode candidate waits before it looks whether it is
    /// the earliest.
    pub fn settle(&self) -> Duration {
        self.settle
    }

    /// How often held claims (and candidates in line) are renewed: a third
    /// of the TTL, so that two renewals in a row may fail before one lapses.
    /// The same period bounds how long a looked-up authority is trusted.
    pub fn renew_interval(&self) -> Duration {
        self.ttl / 3
    }

    /// How long a claim written at some instant is surely still live: its
    /// TTL less a tenth for clock rate and scheduling slack.
    pub fn claim_margin(&self) -> Duration {
        self.ttl - self.ttl / 10
    }

    /// Until when a claim written (or renewed) at `written_at` may be acted
    /// on: a grant, a renewal, a write's admission.
    pub fn valid_until(&self, written_at: Instant) -> Instant {
        written_at + self.claim_margin()
    }

    /// The least validity a claim must have left for a grant under it, so
    /// that no lease is dead on arrival: half the TTL. A claim won late (a
    /// slow ClickHouse or Keeper, a long line) is renewed first; background
    /// renewals keep a held claim above it.
    pub fn grant_margin(&self) -> Duration {
        self.ttl / 2
    }

    /// Whether a claim valid until `valid_until` must be renewed before a
    /// grant at `now`.
    pub fn renew_before_grant(&self, valid_until: Instant, now: Instant) -> bool {
        valid_until.saturating_duration_since(now) < self.grant_margin()
    }

    /// A claim with no lease and no waiter for this long is given up.
    pub fn idle_release(&self) -> Duration {
        self.idle
    }

    /// How long past its deadline a waiter stays for a lease about to exist,
    /// so that its 409 can name the holder: a claim attempt takes the settle
    /// and a few round trips, a write under way one.
    pub fn holder_grace(&self) -> Duration {
        self.settle + 2 * self.query_timeout
    }

    /// How long a 409 looks again for a holder granted elsewhere a moment
    /// ago: a new claim grants nothing for the settle time, and the lease
    /// row follows a grant within a recorder flush.
    pub fn holder_wait(&self) -> Duration {
        HOLDER_WAIT.max(self.settle)
    }

    /// How long a lease seen by a routing read stands in for a fresh read:
    /// a lease the read did not see needs a claim it did not see either, and
    /// a new claim grants nothing for the settle time; half of it is kept.
    pub fn seen_lease_fresh(&self) -> Duration {
        self.settle / 2
    }

    /// How long a member's row lives without a heartbeat: what each beat writes.
    pub fn member_ttl(&self) -> Duration {
        MEMBER_TTL
    }

    /// How often a member beats: a fifth of its row's TTL.
    pub fn member_beat(&self) -> Duration {
        MEMBER_TTL / 5
    }

    /// Until when claim rows this member writes count, after a beat sent at
    /// `sent` was answered: its row's TTL less a tenth (clock rate and
    /// scheduling). A claim row answered by then was visible before the
    /// row could lapse, so a gateway that reads the row lapsed sees it.
    /// Whatever the settle: a member stays valid across four missed beats.
    pub fn member_valid_until(&self, sent: Instant) -> Instant {
        sent + (MEMBER_TTL - MEMBER_TTL / 10)
    }

    /// From when a gateway whose join was answered at `answered` may write
    /// claim rows: [`JOIN_WAIT`] on.
    pub fn member_settled_at(&self, answered: Instant) -> Instant {
        answered + JOIN_WAIT
    }

    /// How long after a read that found no other gateway began, a lone
    /// member's read of the id's rows must be answered to decide its claim
    /// without settling: half of [`JOIN_WAIT`]. A gateway the read missed
    /// joined after it began and writes no claim row for [`JOIN_WAIT`]
    /// after that, so the decision read saw every claim row that could
    /// matter, with half of it to spare for clock rates.
    pub fn alone_window(&self) -> Duration {
        JOIN_WAIT / 2
    }

    /// How long a write sent under a lease may keep the next grant waiting:
    /// one ClickHouse round trip at most.
    pub fn write_budget(&self) -> Duration {
        self.query_timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(ttl_s: u64, settle_ms: u64, query_timeout_s: u64) -> ClaimTiming {
        ClaimTiming {
            ttl: Duration::from_secs(ttl_s),
            settle: Duration::from_millis(settle_ms),
            idle: Duration::from_secs(60),
            query_timeout: Duration::from_secs(query_timeout_s),
        }
    }

    #[test]
    fn the_ttl_fractions_nest_renewal_inside_grant_margin_inside_claim_margin() {
        let t = timing(30, 500, 10);
        assert_eq!(t.renew_interval(), Duration::from_secs(10));
        assert_eq!(t.grant_margin(), Duration::from_secs(15));
        assert_eq!(t.claim_margin(), Duration::from_secs(27));
        // A held claim renewed every interval stays above the grant margin
        // between two renewals.
        assert!(t.claim_margin() - t.renew_interval() > t.grant_margin());
        assert!(t.claim_margin() < t.ttl());
    }

    #[test]
    fn a_claim_is_acted_on_until_a_tenth_of_its_ttl_before_it_can_lapse() {
        let t = timing(10, 200, 10);
        let written = Instant::now();
        assert_eq!(t.valid_until(written), written + Duration::from_secs(9));
    }

    #[test]
    fn a_claim_won_late_is_renewed_before_it_grants() {
        let t = timing(10, 200, 10);
        let written = Instant::now();
        let valid_until = t.valid_until(written);
        assert!(!t.renew_before_grant(valid_until, written));
        assert!(!t.renew_before_grant(valid_until, written + Duration::from_secs(4)));
        assert!(t.renew_before_grant(valid_until, written + Duration::from_millis(4001)));
        assert!(t.renew_before_grant(valid_until, written + Duration::from_secs(20)));
    }

    #[test]
    fn waits_for_a_coming_holder_follow_the_settle_and_the_query_timeout() {
        let t = timing(30, 500, 4);
        assert_eq!(t.holder_grace(), Duration::from_millis(8500));
        assert_eq!(t.holder_wait(), HOLDER_WAIT);
        assert_eq!(t.seen_lease_fresh(), Duration::from_millis(250));
        assert_eq!(timing(30, 5000, 4).holder_wait(), Duration::from_secs(5));
        assert_eq!(t.write_budget(), Duration::from_secs(4));
    }

    #[test]
    fn a_lone_member_decides_inside_what_a_newcomer_waits_whatever_the_settle() {
        for settle_ms in [100, 1000, 60_000] {
            let t = timing(10, settle_ms, 10);
            let now = Instant::now();
            assert_eq!(t.member_settled_at(now), now + JOIN_WAIT);
            assert_eq!(t.alone_window() * 2, JOIN_WAIT);
            // Valid across four missed beats.
            assert!(t.member_valid_until(now) > now + 4 * t.member_beat());
            assert!(t.member_valid_until(now) < now + t.member_ttl());
        }
    }

    #[test]
    fn an_unconfirmed_grant_ends_long_before_a_default_claim() {
        let t = timing(30, 500, 10);
        assert!(UNCONFIRMED_GRANT < t.grant_margin());
        assert_eq!(t.idle_release(), Duration::from_secs(60));
    }
}
