//! The change feed's cursor: where a follower stands, opaque on the wire.
//!
//! It holds the settled position P (every change inserted at or before it
//! counts as delivered), the read time R of the answer that made it, and a
//! fingerprint of the changes under the glob in (P, R]. A change can become
//! visible a little after a reader read past its insert time; the next read
//! finds (P, R] no longer matching the fingerprint and delivers those again:
//! repeats are allowed, losses are not.
//!
//! On the wire: hex of a format version, the positions, the fingerprint, a
//! hash of the glob and a checksum of all that. It holds no secret, so it
//! works on every gateway and across restarts; the checksum only tells a
//! cursor this service made from a made-up or altered one.

use sha2::{Digest, Sha256};

use crate::domain::{StateId, StatePattern};

/// The cursor format; a new layout takes the next number.
const FORMAT: u8 = 1;

/// Bytes of the glob's hash and of the checksum.
const HASH_BYTES: usize = 8;

/// version, P, R, count, sum, cut flag, cut, glob hash.
const BODY_BYTES: usize = 1 + 8 + 8 + 4 + 8 + 1 + 8 + HASH_BYTES;

/// A count and a wrapping sum of a stable hash of each change: equal for
/// equal sets of changes, whatever their order. A sum, not an XOR: a
/// change read twice does not cancel itself out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fingerprint {
    /// How many changes.
    pub count: u32,
    /// The wrapping sum of their hashes.
    pub sum: u64,
}

impl Fingerprint {
    pub fn add(&mut self, id: &StateId, version_ms: i64, deleted: bool) {
        self.count = self.count.wrapping_add(1);
        self.sum = self.sum.wrapping_add(change_hash(id, version_ms, deleted));
    }

    /// What `self` holds beyond `before`, which it includes: sums are
    /// additive, so the fingerprint of a range is a difference of two.
    pub fn minus(self, before: Self) -> Self {
        Self {
            count: self.count.wrapping_sub(before.count),
            sum: self.sum.wrapping_sub(before.sum),
        }
    }
}

/// A stable hash of an id: the order of ids whose last changes were
/// inserted in the same instant (one INSERT's rows share it), so a cursor
/// can stop between them.
pub fn id_hash(id: &StateId) -> u64 {
    fnv1a(id.as_str().bytes())
}

/// FNV-1a (64 bit) over the id, the version and the tombstone flag: stable
/// across builds and gateways, as cursors must be.
fn change_hash(id: &StateId, version_ms: i64, deleted: bool) -> u64 {
    let bytes = id
        .as_str()
        .bytes()
        .chain((id.as_str().len() as u64).to_le_bytes())
        .chain(version_ms.to_le_bytes())
        .chain([u8::from(deleted)]);
    fnv1a(bytes)
}

fn fnv1a(bytes: impl Iterator<Item = u8>) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// Where a follower of the feed stands (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FeedCursor {
    /// P: changes inserted at or before it (microseconds) are delivered.
    pub settled_us: i64,
    /// R: the read time of the answer that made it (microseconds), at or
    /// after P.
    pub read_at_us: i64,
    /// The changes under the glob in (P, R] as that answer saw them.
    pub fingerprint: Fingerprint,
    /// Set when the answer stopped among ids whose last changes were
    /// inserted at R: those whose [`id_hash`] is at most this were
    /// delivered, the others' changes at R were not.
    pub cut: Option<u64>,
}

/// Why a cursor is refused (400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CursorError {
    #[error("since is not a cursor this service handed out")]
    Invalid,
    #[error("since is a cursor of another pattern; a cursor follows only the pattern it came from")]
    OtherPattern,
}

impl FeedCursor {
    pub fn encode(&self, pattern: &StatePattern) -> String {
        let mut bytes = Vec::with_capacity(BODY_BYTES + HASH_BYTES);
        bytes.push(FORMAT);
        bytes.extend(self.settled_us.to_be_bytes());
        bytes.extend(self.read_at_us.to_be_bytes());
        bytes.extend(self.fingerprint.count.to_be_bytes());
        bytes.extend(self.fingerprint.sum.to_be_bytes());
        bytes.push(u8::from(self.cut.is_some()));
        bytes.extend(self.cut.unwrap_or(0).to_be_bytes());
        bytes.extend(pattern_hash(pattern));
        let check = checksum(&bytes);
        bytes.extend(check);
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn decode(raw: &str, pattern: &StatePattern) -> Result<Self, CursorError> {
        let bytes = hex_bytes(raw).ok_or(CursorError::Invalid)?;
        if bytes.len() != BODY_BYTES + HASH_BYTES || bytes[0] != FORMAT {
            return Err(CursorError::Invalid);
        }
        let (body, check) = bytes.split_at(BODY_BYTES);
        if check != checksum(body) {
            return Err(CursorError::Invalid);
        }
        let field = |at: usize| -> [u8; 8] { body[at..at + 8].try_into().expect("8 bytes") };
        let cursor = Self {
            settled_us: i64::from_be_bytes(field(1)),
            read_at_us: i64::from_be_bytes(field(9)),
            fingerprint: Fingerprint {
                count: u32::from_be_bytes(body[17..21].try_into().expect("4 bytes")),
                sum: u64::from_be_bytes(field(21)),
            },
            cut: match body[29] {
                0 => None,
                1 => Some(u64::from_be_bytes(field(30))),
                _ => return Err(CursorError::Invalid),
            },
        };
        if body[38..] != pattern_hash(pattern) {
            return Err(CursorError::OtherPattern);
        }
        if cursor.settled_us > cursor.read_at_us {
            return Err(CursorError::Invalid);
        }
        Ok(cursor)
    }
}

fn pattern_hash(pattern: &StatePattern) -> [u8; HASH_BYTES] {
    first_bytes(
        Sha256::new()
            .chain_update(b"glob:")
            .chain_update(pattern.as_str()),
    )
}

fn checksum(body: &[u8]) -> [u8; HASH_BYTES] {
    first_bytes(
        Sha256::new()
            .chain_update(b"statehouse feed cursor:")
            .chain_update(body),
    )
}

fn first_bytes(hash: Sha256) -> [u8; HASH_BYTES] {
    let digest = hash.finalize();
    let mut out = [0; HASH_BYTES];
    out.copy_from_slice(&digest[..HASH_BYTES]);
    out
}

fn hex_bytes(raw: &str) -> Option<Vec<u8>> {
    if !raw.len().is_multiple_of(2) || !raw.is_ascii() {
        return None;
    }
    (0..raw.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&raw[i..i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn glob(raw: &str) -> StatePattern {
        StatePattern::parse(raw).unwrap()
    }

    fn cursor() -> FeedCursor {
        let mut fingerprint = Fingerprint::default();
        fingerprint.add(&StateId::parse("a".to_owned()).unwrap(), 5, false);
        FeedCursor {
            settled_us: 1_000,
            read_at_us: 6_000,
            fingerprint,
            cut: Some(7),
        }
    }

    #[test]
    fn a_cursor_round_trips_with_its_own_glob_only() {
        let raw = cursor().encode(&glob("prod:*"));
        assert_eq!(FeedCursor::decode(&raw, &glob("prod:*")), Ok(cursor()));
        assert_eq!(
            FeedCursor::decode(&raw, &glob("dev:*")),
            Err(CursorError::OtherPattern)
        );
    }

    #[test]
    fn a_made_up_or_altered_cursor_is_refused() {
        let raw = cursor().encode(&glob("*"));
        for bad in ["", "zz", "00", &raw[..raw.len() - 2], &format!("{raw}00")] {
            assert_eq!(
                FeedCursor::decode(bad, &glob("*")),
                Err(CursorError::Invalid),
                "{bad}"
            );
        }
        let mut altered = raw.into_bytes();
        altered[5] = if altered[5] == b'0' { b'1' } else { b'0' };
        let altered = String::from_utf8(altered).unwrap();
        assert_eq!(
            FeedCursor::decode(&altered, &glob("*")),
            Err(CursorError::Invalid)
        );
        assert_eq!(
            FeedCursor::decode("é", &glob("*")),
            Err(CursorError::Invalid)
        );
    }

    #[test]
    fn a_fingerprint_is_order_free_and_counts_repeats() {
        let (a, b) = (
            StateId::parse("a".to_owned()).unwrap(),
            StateId::parse("b".to_owned()).unwrap(),
        );
        let (mut one, mut other) = (Fingerprint::default(), Fingerprint::default());
        one.add(&a, 1, false);
        one.add(&b, 2, true);
        other.add(&b, 2, true);
        other.add(&a, 1, false);
        assert_eq!(one, other);
        other.add(&a, 1, false);
        assert_ne!(one, other, "a change read twice differs");
        let mut tombstone = Fingerprint::default();
        tombstone.add(&a, 1, true);
        let mut write = Fingerprint::default();
        write.add(&a, 1, false);
        assert_ne!(tombstone, write);
    }
}
