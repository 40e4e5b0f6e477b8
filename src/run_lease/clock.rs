//! The lease's life as the runner sees it: when to renew, and when a lease
//! that could not be renewed must be taken for lost.

use std::time::Duration;

use tokio::time::Instant;

/// Longest one renewal or release may take, within the lease's life.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// When to renew a lease and when it ends, seen from this side: a renewal
/// counts from the moment it was sent, before the gateway stamped it, so
/// the lease here never outlives the lease there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseClock {
    ttl: Duration,
    expires: Instant,
    next: Instant,
}

impl LeaseClock {
    /// A lease granted (or renewed) at `at`.
    pub fn new(ttl: Duration, at: Instant) -> Self {
        Self {
            ttl,
            expires: at + ttl,
            next: at + ttl / 3,
        }
    }

    /// A renewal sent at `sent` succeeded.
    pub fn renewed(&mut self, sent: Instant) {
        *self = Self::new(self.ttl, sent);
    }

    /// A renewal failed at `now` without a verdict (no answer, or not one
    /// about the lease): try again soon, until the lease would have expired.
    /// False when it has.
    pub fn failed(&mut self, now: Instant) -> bool {
        if now >= self.expires {
            return false;
        }
        self.next = (now + self.retry_delay()).min(self.expires);
        true
    }

    /// Between failed renewals: a tenth of the TTL, from 100 ms to 1 s.
    fn retry_delay(&self) -> Duration {
        (self.ttl / 10).clamp(Duration::from_millis(100), Duration::from_secs(1))
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    pub fn next_attempt(&self) -> Instant {
        self.next
    }

    /// How long a renewal starting at `now` may take: until the lease would
    /// expire, at most `REQUEST_TIMEOUT`; None when it has expired.
    pub fn time_left(&self, now: Instant) -> Option<Duration> {
        let left = self.expires.checked_duration_since(now)?;
        (!left.is_zero()).then(|| left.min(REQUEST_TIMEOUT))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renews_every_third_of_the_ttl_counted_from_each_send() {
        let start = Instant::now();
        let ttl = Duration::from_secs(30);
        let mut clock = LeaseClock::new(ttl, start);
        assert_eq!(clock.next_attempt(), start + Duration::from_secs(10));
        let sent = start + Duration::from_secs(10);
        clock.renewed(sent);
        assert_eq!(clock.next_attempt(), sent + Duration::from_secs(10));
        assert_eq!(
            clock.time_left(sent + Duration::from_secs(29)),
            Some(Duration::from_secs(1))
        );
        assert_eq!(
            clock.time_left(sent),
            Some(REQUEST_TIMEOUT),
            "one request never takes longer than REQUEST_TIMEOUT"
        );
    }

    #[test]
    fn failed_renewals_retry_soon_until_the_lease_would_expire() {
        let start = Instant::now();
        let mut clock = LeaseClock::new(Duration::from_secs(3), start);
        let now = start + Duration::from_secs(1);
        assert!(clock.failed(now));
        assert_eq!(clock.next_attempt(), now + Duration::from_millis(300));
        // Never scheduled past the expiry, and lost once it is reached.
        let late = start + Duration::from_millis(2900);
        assert!(clock.failed(late));
        assert_eq!(clock.next_attempt(), start + Duration::from_secs(3));
        assert_eq!(clock.time_left(start + Duration::from_secs(3)), None);
        assert!(!clock.failed(start + Duration::from_secs(3)));
        // The delay between retries stays within 100 ms and 1 s.
        let mut long = LeaseClock::new(Duration::from_secs(3600), start);
        assert!(long.failed(start));
        assert_eq!(long.next_attempt(), start + Duration::from_secs(1));
        let mut short = LeaseClock::new(Duration::from_secs(1), start);
        assert!(short.failed(start));
        assert_eq!(short.next_attempt(), start + Duration::from_millis(100));
    }
}
