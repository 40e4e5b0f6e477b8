//! `at=`: the instant a point-in-time read or a restore is about. RFC 3339
//! with any offset (`Z`, `+02:00`, `-05:30`), so one instant written in two
//! offsets is the same instant; kept in milliseconds since the epoch, as
//! versions are, rounded down (a version is at or before it exactly when its
//! millisecond is).

use std::time::UNIX_EPOCH;

/// An instant in milliseconds since the epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct AsOf(i64);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "at {0:?} is not an RFC 3339 instant with an offset (e.g. 2026-12-01T13:59:00Z or 2026-12-01T14:59:00+01:00)"
)]
pub struct InvalidAsOf(pub String);

impl AsOf {
    pub fn from_millis(ms: i64) -> Self {
        Self(ms)
    }

    pub fn millis(self) -> i64 {
        self.0
    }

    pub fn parse(raw: &str) -> Result<Self, InvalidAsOf> {
        let invalid = || InvalidAsOf(raw.to_owned());
        let (local, offset_minutes) = split_offset(raw).ok_or_else(invalid)?;
        // humantime reads the UTC form; the offset is taken off after.
        let utc = humantime::parse_rfc3339(&format!("{local}Z")).map_err(|_| invalid())?;
        let since = utc.duration_since(UNIX_EPOCH).map_err(|_| invalid())?;
        let local_ms = i64::try_from(since.as_millis()).map_err(|_| invalid())?;
        Ok(Self(local_ms - offset_minutes * 60_000))
    }
}

/// The date and time before the offset, and the offset in minutes east of
/// UTC. None when there is no offset or it is malformed.
fn split_offset(raw: &str) -> Option<(&str, i64)> {
    if let Some(local) = raw.strip_suffix(['Z', 'z']) {
        return Some((local, 0));
    }
    let at = raw.len().checked_sub(6)?;
    let (local, offset) = (raw.get(..at)?, raw.get(at..)?);
    let bytes = offset.as_bytes();
    let sign = match bytes[0] {
        b'+' => 1,
        b'-' => -1,
        _ => return None,
    };
    if bytes[3] != b':' {
        return None;
    }
    let hours: i64 = offset.get(1..3)?.parse().ok()?;
    let minutes: i64 = offset.get(4..6)?.parse().ok()?;
    if hours > 23 || minutes > 59 || !offset[1..3].bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((local, sign * (hours * 60 + minutes)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_instant_in_any_offset() {
        let utc = AsOf::parse("2026-12-01T13:59:00Z").unwrap();
        assert_eq!(AsOf::parse("2026-12-01T14:59:00+01:00").unwrap(), utc);
        assert_eq!(AsOf::parse("2026-12-01T08:29:00-05:30").unwrap(), utc);
        assert_eq!(AsOf::parse("2026-12-01T13:59:00.000z").unwrap(), utc);
        assert_eq!(utc.millis(), 1_796_133_540_000);
    }

    #[test]
    fn fractions_round_down_to_the_millisecond() {
        let at = AsOf::parse("2026-12-01T13:59:00.1239Z").unwrap();
        assert_eq!(at.millis(), 1_796_133_540_123);
    }

    #[test]
    fn refuses_what_is_not_an_instant() {
        for bad in [
            "",
            "2h",
            "2026-12-01",
            "2026-12-01T13:59:00",
            "2026-12-01T13:59:00+0100",
            "2026-12-01T13:59:00+24:00",
            "2026-12-01T13:59:00+ab:00",
            "1764597540000",
        ] {
            assert!(AsOf::parse(bad).is_err(), "{bad}");
        }
    }
}
