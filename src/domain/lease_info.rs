//! Who holds a lease, in the holder's words: the `info` of an acquire, and
//! the reason of a force-unlock. Both are checked here, at the edge, so the
//! lock core and the lease rows carry them as they are.

use std::sync::Arc;

use serde::{Serialize, Serializer};
use serde_json::Value;
use serde_json::value::RawValue;

/// The most an acquire's `info` may take, as compact JSON text: it rides on
/// every lease row and every answer that names the holder.
pub const MAX_INFO_BYTES: usize = 4096;

/// The most a force-unlock's reason may take.
pub const MAX_REASON_BYTES: usize = 512;

/// A lease's `info`: a JSON object, kept as its compact text (what the lease
/// rows store) and shown as that object. No info is `{}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseInfo(Arc<str>);

/// Why an acquire's `info` was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InfoError {
    #[error("info must be a JSON object")]
    NotAnObject,
    #[error("info takes at most {MAX_INFO_BYTES} bytes of JSON, got {0}")]
    TooLarge(usize),
}

impl Default for LeaseInfo {
    fn default() -> Self {
        Self(Arc::from("{}"))
    }
}

impl LeaseInfo {
    /// An acquire's `info`: an object of at most [`MAX_INFO_BYTES`] as compact text.
    pub fn parse(value: Value) -> Result<Self, InfoError> {
        if !value.is_object() {
            return Err(InfoError::NotAnObject);
        }
        let text = value.to_string();
        if text.len() > MAX_INFO_BYTES {
            return Err(InfoError::TooLarge(text.len()));
        }
        Ok(Self(Arc::from(text)))
    }

    /// The text a lease row holds. An empty column (a row written before
    /// leases had info) or one that is not an object reads as no info, so
    /// that a view never breaks on a row it did not write.
    pub fn from_stored(text: &str) -> Self {
        match serde_json::from_str::<Value>(text) {
            Ok(value) if value.is_object() => Self(Arc::from(text)),
            _ => Self::default(),
        }
    }

    /// The compact JSON text, as stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Serialize for LeaseInfo {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // Already checked JSON: sent as it is, not parsed again per answer.
        let raw: &RawValue = serde_json::from_str(&self.0).map_err(serde::ser::Error::custom)?;
        raw.serialize(serializer)
    }
}

/// Who ended a lease by force, and why: kept on its row for the id's history.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Forced {
    /// The token's name (see `auth::Actor`).
    pub actor: String,
    pub reason: String,
}

/// A force-unlock's `?reason=`: at most [`MAX_REASON_BYTES`] bytes.
pub fn parse_reason(raw: Option<String>) -> Result<String, usize> {
    let reason = raw.unwrap_or_default();
    if reason.len() > MAX_REASON_BYTES {
        return Err(reason.len());
    }
    Ok(reason)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn info_is_an_object_kept_as_compact_text() {
        let info = LeaseInfo::parse(json!({"host": "a", "pid": 7})).unwrap();
        assert_eq!(info.as_str(), r#"{"host":"a","pid":7}"#);
        assert_eq!(
            serde_json::to_value(&info).unwrap(),
            json!({"host": "a", "pid": 7})
        );
        assert_eq!(LeaseInfo::default().as_str(), "{}");
    }

    #[test]
    fn info_that_is_not_an_object_is_refused() {
        for value in [json!([1]), json!("x"), json!(3), json!(null)] {
            assert_eq!(LeaseInfo::parse(value), Err(InfoError::NotAnObject));
        }
    }

    #[test]
    fn info_is_measured_as_compact_json() {
        // {"k":"…"} is 8 bytes around the value.
        let fits = json!({"k": "x".repeat(MAX_INFO_BYTES - 8)});
        assert!(LeaseInfo::parse(fits).is_ok());
        let over = json!({"k": "x".repeat(MAX_INFO_BYTES - 7)});
        assert_eq!(
            LeaseInfo::parse(over),
            Err(InfoError::TooLarge(MAX_INFO_BYTES + 1))
        );
    }

    #[test]
    fn a_stored_info_that_is_not_an_object_reads_as_none() {
        assert_eq!(LeaseInfo::from_stored(""), LeaseInfo::default());
        assert_eq!(LeaseInfo::from_stored("[1]"), LeaseInfo::default());
        assert_eq!(LeaseInfo::from_stored(r#"{"a":1}"#).as_str(), r#"{"a":1}"#);
    }

    #[test]
    fn a_reason_takes_at_most_512_bytes() {
        assert_eq!(parse_reason(None), Ok(String::new()));
        assert_eq!(parse_reason(Some("é".repeat(256))), Ok("é".repeat(256)));
        assert_eq!(parse_reason(Some("x".repeat(513))), Err(513));
    }
}
