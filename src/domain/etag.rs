//! Entity tags and the preconditions that compare them (RFC 9110, 8.8.3 and
//! 13.1): one place for how a state's ETag is made and how `If-Match` and
//! `If-None-Match` hold against it.

/// A strong validator of one stored version of a state: it changes whenever
/// the version or the content does. Quoted, as it goes on the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ETag(String);

impl ETag {
    /// FNV-1a (64 bit) over the version and both stored texts: stable across
    /// builds and platforms, which ETags need (std's hasher may change
    /// between Rust releases).
    pub fn of(version_ms: i64, completed: Option<&str>, partial: Option<&str>) -> Self {
        let mut hash = Fnv1a::default();
        hash.write(&version_ms.to_le_bytes());
        for text in [completed, partial] {
            match text {
                Some(text) => {
                    hash.write(&[1]);
                    hash.write(text.as_bytes());
                }
                None => hash.write(&[0]),
            }
        }
        Self(format!("\"{:016x}\"", hash.0))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An `If-Match` precondition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IfMatch {
    Any,
    OneOf(Vec<String>),
}

impl IfMatch {
    /// Parses the header value: `*` or a comma-separated list of entity tags.
    pub fn parse(raw: &str) -> Option<Self> {
        let raw = raw.trim();
        if raw == "*" {
            return Some(Self::Any);
        }
        let tags: Vec<String> = raw
            .split(',')
            .map(|tag| tag.trim().to_owned())
            .filter(|tag| !tag.is_empty())
            .collect();
        let well_formed = !tags.is_empty()
            && tags
                .iter()
                .all(|t| t.len() >= 2 && t.starts_with(['"', 'W']) && t.ends_with('"'));
        well_formed.then_some(Self::OneOf(tags))
    }

    /// Against the current version's tag (None: no state). If-Match uses the
    /// strong comparison, so a weak tag never matches, and nothing matches a
    /// state that does not exist.
    pub fn holds_for(&self, current: Option<&ETag>) -> bool {
        match (self, current) {
            (_, None) => false,
            (Self::Any, Some(_)) => true,
            (Self::OneOf(tags), Some(etag)) => tags.iter().any(|t| t == etag.as_str()),
        }
    }
}

/// An `If-None-Match` precondition of a read: the client's copy is current
/// when any tag matches, by the weak comparison, or it sent `*`.
pub struct IfNoneMatch(String);

impl IfNoneMatch {
    pub fn new(raw: &str) -> Self {
        Self(raw.to_owned())
    }

    pub fn unchanged(&self, current: &ETag) -> bool {
        self.0
            .split(',')
            .map(str::trim)
            .any(|t| t == "*" || t.trim_start_matches("W/") == current.as_str())
    }
}

struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_if_match() {
        assert_eq!(IfMatch::parse(" * "), Some(IfMatch::Any));
        assert_eq!(
            IfMatch::parse("\"a\", W/\"b\""),
            Some(IfMatch::OneOf(vec!["\"a\"".into(), "W/\"b\"".into()]))
        );
        for bad in ["", "abc", "\"", ",", "\"a\", b"] {
            assert_eq!(IfMatch::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn if_match_is_strong_and_if_none_match_weak() {
        let etag = ETag::of(1, Some("{}"), None);
        assert_ne!(etag, ETag::of(2, Some("{}"), None), "the version counts");
        assert_ne!(etag, ETag::of(1, Some("{}"), Some("{}")), "so does content");
        let weak = format!("W/{}", etag.as_str());
        assert!(
            IfMatch::parse(etag.as_str())
                .unwrap()
                .holds_for(Some(&etag))
        );
        assert!(!IfMatch::parse(&weak).unwrap().holds_for(Some(&etag)));
        assert!(!IfMatch::Any.holds_for(None));
        assert!(IfNoneMatch::new(&weak).unchanged(&etag));
        assert!(IfNoneMatch::new("*").unchanged(&etag));
        assert!(!IfNoneMatch::new("\"other\"").unchanged(&etag));
    }
}
