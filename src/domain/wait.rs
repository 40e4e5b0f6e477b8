//! How long a request may wait for a change (`?wait=D`): parsed at the edge,
//! so the rest of the gateway only ever sees a bounded duration.

use std::time::Duration;

/// The longest wait a request may ask for: a proxy or load balancer between
/// client and gateway would cut a longer idle request anyway, and the
/// client learns of the deadline instead of a dropped connection.
pub const MAX_WAIT: Duration = Duration::from_secs(120);

/// A wait of at most [`MAX_WAIT`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wait(Duration);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InvalidWait {
    #[error("wait {0:?} is not a duration; give seconds (30) or a unit (500ms, 30s, 2m)")]
    NotADuration(String),
    #[error("wait {0:?} is longer than the most a request may wait, 120s")]
    TooLong(String),
}

impl Wait {
    /// `500ms`, `30s`, `2m` or plain seconds (`30`).
    pub fn parse(raw: &str) -> Result<Self, InvalidWait> {
        let Some(duration) = parse_duration(raw) else {
            return Err(InvalidWait::NotADuration(raw.to_owned()));
        };
        if duration > MAX_WAIT {
            return Err(InvalidWait::TooLong(raw.to_owned()));
        }
        Ok(Self(duration))
    }

    pub fn get(self) -> Duration {
        self.0
    }

    /// The wait plus a random part of up to a sixteenth of it (the
    /// contract's jitter): many waiters that asked for the same wait at the
    /// same time do not all come back, and ask again, in the same instant.
    pub fn jittered(self) -> Duration {
        use std::hash::{BuildHasher, Hasher};
        // A fresh RandomState is randomly keyed: a random number from std.
        let random = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        let most = self.0 / 16;
        let nanos = u64::try_from(most.as_nanos()).unwrap_or(u64::MAX);
        self.0 + Duration::from_nanos(random.checked_rem(nanos).unwrap_or(0))
    }
}

/// A duration as `wait=` writes it, `500ms`, `30s`, `2m` or plain seconds
/// (`30`), of any length: `statehouse wait --timeout` takes the same.
pub fn parse_duration(raw: &str) -> Option<Duration> {
    let text = raw.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        text.parse::<u64>().ok().map(Duration::from_secs)
    } else {
        humantime::parse_duration(text).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_contracts_forms_parse() {
        assert_eq!(
            Wait::parse("500ms").unwrap().get(),
            Duration::from_millis(500)
        );
        assert_eq!(Wait::parse("30s").unwrap().get(), Duration::from_secs(30));
        assert_eq!(Wait::parse("2m").unwrap().get(), Duration::from_secs(120));
        assert_eq!(Wait::parse("7").unwrap().get(), Duration::from_secs(7));
        assert_eq!(Wait::parse("0").unwrap().get(), Duration::ZERO);
    }

    #[test]
    fn a_jittered_wait_is_at_most_a_sixteenth_longer() {
        let wait = Wait::parse("16s").unwrap();
        let waits: Vec<Duration> = (0..64).map(|_| wait.jittered()).collect();
        assert!(
            waits
                .iter()
                .all(|w| *w >= wait.get() && *w < Duration::from_secs(17))
        );
        assert!(waits.iter().any(|w| *w != waits[0]), "spread");
        assert_eq!(Wait::parse("0").unwrap().jittered(), Duration::ZERO);
    }

    #[test]
    fn more_than_two_minutes_or_not_a_duration_is_refused() {
        assert!(matches!(Wait::parse("121"), Err(InvalidWait::TooLong(_))));
        assert!(matches!(Wait::parse("2m1s"), Err(InvalidWait::TooLong(_))));
        assert!(matches!(
            Wait::parse("99999999999999999999"),
            Err(InvalidWait::NotADuration(_))
        ));
        for bad in ["", "soon", "-1", "1.5x", "5 parsecs"] {
            assert!(
                matches!(Wait::parse(bad), Err(InvalidWait::NotADuration(_))),
                "{bad}"
            );
        }
    }
}
