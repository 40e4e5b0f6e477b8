use sha2::{Digest, Sha256};

use super::{StateId, StatePattern};

pub const DEFAULT_PAGE_LIMIT: u32 = 100;
pub const MAX_PAGE_LIMIT: u32 = 1000;

/// Bytes of the check that binds a cursor to its pattern.
const CHECK_BYTES: usize = 8;

/// Where a listing resumes: after this id, in byte order.
///
/// On the wire it is opaque hex: a check (the first bytes of SHA-256 over the
/// pattern and the id) then the id. A cursor thus resumes only the listing it
/// came from: used with another pattern, or altered, it is refused instead of
/// silently skipping ids. It holds no secret, so it stays valid across
/// restarts and through any gateway.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageCursor(StateId);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cursor is not a next_cursor this service handed out for this pattern")]
pub struct InvalidCursor;

impl PageCursor {
    pub fn after(id: StateId) -> Self {
        Self(id)
    }

    pub fn last_seen(&self) -> &StateId {
        &self.0
    }

    pub fn encode(&self, pattern: &StatePattern) -> String {
        check(pattern, &self.0)
            .iter()
            .chain(self.0.as_str().as_bytes())
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    pub fn decode(raw: &str, pattern: &StatePattern) -> Result<Self, InvalidCursor> {
        let bytes = hex_bytes(raw).ok_or(InvalidCursor)?;
        if bytes.len() <= CHECK_BYTES {
            return Err(InvalidCursor);
        }
        let (sent_check, id) = bytes.split_at(CHECK_BYTES);
        let id = std::str::from_utf8(id)
            .ok()
            .and_then(|id| StateId::parse(id).ok())
            .ok_or(InvalidCursor)?;
        if sent_check != check(pattern, &id) {
            return Err(InvalidCursor);
        }
        Ok(Self(id))
    }
}

fn check(pattern: &StatePattern, id: &StateId) -> [u8; CHECK_BYTES] {
    let mut hash = Sha256::new();
    // The length keeps the pattern/id boundary unambiguous.
    hash.update((pattern.as_str().len() as u64).to_be_bytes());
    hash.update(pattern.as_str());
    hash.update(id.as_str());
    let digest = hash.finalize();
    let mut check = [0; CHECK_BYTES];
    check.copy_from_slice(&digest[..CHECK_BYTES]);
    check
}

fn hex_bytes(raw: &str) -> Option<Vec<u8>> {
    if !raw.len().is_multiple_of(2) {
        return None;
    }
    (0..raw.len())
        .step_by(2)
        .map(|i| {
            raw.get(i..i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        })
        .collect()
}

/// How many ids one page holds: 1 to 1000.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageLimit(u32);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("limit must be between 1 and {MAX_PAGE_LIMIT}")]
pub struct InvalidLimit;

impl PageLimit {
    pub fn parse(raw: Option<u32>) -> Result<Self, InvalidLimit> {
        match raw.unwrap_or(DEFAULT_PAGE_LIMIT) {
            n @ 1..=MAX_PAGE_LIMIT => Ok(Self(n)),
            _ => Err(InvalidLimit),
        }
    }

    pub fn get(self) -> u32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn glob(raw: &str) -> StatePattern {
        StatePattern::parse(raw).unwrap()
    }

    #[test]
    fn cursor_round_trips_any_id_with_its_pattern() {
        let longest = "é".repeat(450);
        for id in ["a", "dev:tap/x y", "ünï 🚀", "\"'\\", longest.as_str()] {
            let cursor = PageCursor::after(StateId::parse(id).unwrap());
            let encoded = cursor.encode(&glob("*"));
            assert_eq!(PageCursor::decode(&encoded, &glob("*")).unwrap(), cursor);
        }
    }

    #[test]
    fn cursor_is_stable_and_bound_to_its_pattern() {
        let cursor = PageCursor::after(StateId::parse("dev:b").unwrap());
        let encoded = cursor.encode(&glob("dev:*"));
        // No per-process secret: another gateway, or this one after a restart, takes it.
        assert_eq!(encoded, cursor.clone().encode(&glob("dev:*")));
        assert_eq!(PageCursor::decode(&encoded, &glob("dev:*")), Ok(cursor));
        for other in ["*", "dev:", "dev:**", "prod:*"] {
            assert_eq!(
                PageCursor::decode(&encoded, &glob(other)),
                Err(InvalidCursor),
                "{other}"
            );
        }
    }

    #[test]
    fn cursor_rejects_garbage_and_tampering() {
        let star = glob("*");
        // The old format (hex of the id alone) and a bare id are refused too.
        for raw in ["", "a", "zz", "ff", "é1", "61", "0011223344556677"] {
            assert_eq!(PageCursor::decode(raw, &star), Err(InvalidCursor), "{raw}");
        }
        let encoded = PageCursor::after(StateId::parse("abc").unwrap()).encode(&star);
        let tampered = format!("{}64", &encoded[..encoded.len() - 2]);
        assert_eq!(PageCursor::decode(&tampered, &star), Err(InvalidCursor));
    }

    #[test]
    fn limit_defaults_and_bounds() {
        assert_eq!(PageLimit::parse(None).unwrap().get(), 100);
        assert_eq!(PageLimit::parse(Some(1000)).unwrap().get(), 1000);
        assert_eq!(PageLimit::parse(Some(0)), Err(InvalidLimit));
        assert_eq!(PageLimit::parse(Some(1001)), Err(InvalidLimit));
    }
}
