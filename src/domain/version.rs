//! A state's version: the `updated_at` a change produced, in milliseconds
//! since the epoch. On the wire it is that `updated_at`, RFC 3339 UTC with
//! milliseconds, so that a version read from a state names its history entry.

use std::time::{Duration, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use super::StateId;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(i64);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "version {0:?} is not an updated_at of this API (RFC 3339 UTC with milliseconds, e.g. 2026-12-01T10:00:00.123Z)"
)]
pub struct InvalidVersion(pub String);

impl Version {
    pub fn from_millis(ms: i64) -> Self {
        Self(ms)
    }

    pub fn millis(self) -> i64 {
        self.0
    }

    pub fn parse(raw: &str) -> Result<Self, InvalidVersion> {
        let invalid = || InvalidVersion(raw.to_owned());
        // The one form this API writes: YYYY-MM-DDTHH:MM:SS.mmmZ.
        if raw.len() != 24 || raw.as_bytes()[19] != b'.' || !raw.ends_with('Z') {
            return Err(invalid());
        }
        let at = humantime::parse_rfc3339(raw).map_err(|_| invalid())?;
        let since = at.duration_since(UNIX_EPOCH).map_err(|_| invalid())?;
        if since.subsec_nanos() % 1_000_000 != 0 {
            return Err(invalid());
        }
        i64::try_from(since.as_millis())
            .map(Self)
            .map_err(|_| invalid())
    }

    pub fn to_rfc3339(self) -> String {
        let at = UNIX_EPOCH + Duration::from_millis(u64::try_from(self.0).unwrap_or(0));
        humantime::format_rfc3339_millis(at).to_string()
    }
}

/// Bytes of the check that binds a cursor to its state_id.
const CHECK_BYTES: usize = 8;

/// Where a history listing resumes: before this version. Opaque hex on the
/// wire, a check over the state_id then the version, so that it resumes only
/// the listing of the state it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VersionCursor(pub Version);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cursor is not a next_cursor this service handed out for this state's history")]
pub struct InvalidVersionCursor;

impl VersionCursor {
    pub fn encode(self, id: &StateId) -> String {
        check(id, self.0)
            .iter()
            .chain(&self.0.0.to_be_bytes())
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    pub fn decode(raw: &str, id: &StateId) -> Result<Self, InvalidVersionCursor> {
        if raw.len() != 2 * (CHECK_BYTES + 8) || !raw.is_ascii() {
            return Err(InvalidVersionCursor);
        }
        let bytes: Vec<u8> = (0..raw.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&raw[i..i + 2], 16))
            .collect::<Result<_, _>>()
            .map_err(|_| InvalidVersionCursor)?;
        let (sent_check, ms) = bytes.split_at(CHECK_BYTES);
        let version = Version(i64::from_be_bytes(
            ms.try_into().map_err(|_| InvalidVersionCursor)?,
        ));
        if sent_check != check(id, version) {
            return Err(InvalidVersionCursor);
        }
        Ok(Self(version))
    }
}

fn check(id: &StateId, version: Version) -> [u8; CHECK_BYTES] {
    let mut hash = Sha256::new();
    hash.update(b"history\0");
    hash.update(id.as_str());
    hash.update(version.0.to_be_bytes());
    let digest = hash.finalize();
    let mut check = [0; CHECK_BYTES];
    check.copy_from_slice(&digest[..CHECK_BYTES]);
    check
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_is_its_updated_at() {
        let v = Version::parse("2026-12-01T10:00:00.123Z").unwrap();
        assert_eq!(v.to_rfc3339(), "2026-12-01T10:00:00.123Z");
        assert_eq!(Version::from_millis(v.millis()), v);
        for bad in [
            "",
            "yesterday",
            "2026-12-01",
            "2026-12-01T10:00:00.1234Z",
            "1764583200123",
        ] {
            assert!(Version::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_cursor_resumes_only_its_own_state() {
        let (a, b) = (StateId::parse("a").unwrap(), StateId::parse("b").unwrap());
        let cursor = VersionCursor(Version::from_millis(1_764_583_200_123));
        let raw = cursor.encode(&a);
        assert_eq!(VersionCursor::decode(&raw, &a), Ok(cursor));
        assert!(VersionCursor::decode(&raw, &b).is_err());
        assert!(VersionCursor::decode(&raw[2..], &a).is_err());
        assert!(VersionCursor::decode("zz", &a).is_err());
    }
}
