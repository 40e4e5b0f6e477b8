use std::fmt;

use crate::telemetry::ClientText;

/// Meltano's own SQL state backends keep ids in a VARCHAR(900).
pub const MAX_STATE_ID_BYTES: usize = 900;

/// A state id that is known to be valid: 1 to 900 bytes of UTF-8.
///
/// Any other content is allowed (Meltano ids hold `:`, `-`, `.`, `/`, spaces),
/// so every query binds it as a parameter and never splices it into SQL.
/// For the same reason its `Display` is the log form ([`ClientText`]: quoted
/// and escaped unless plain); the id itself is [`StateId::as_str`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(transparent)]
pub struct StateId(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateIdError {
    #[error("state_id must not be empty")]
    Empty,
    #[error("state_id is {0} bytes long; at most {MAX_STATE_ID_BYTES} bytes are allowed")]
    TooLong(usize),
}

impl StateId {
    pub fn parse(raw: impl Into<String>) -> Result<Self, StateIdError> {
        let raw = raw.into();
        match raw.len() {
            0 => Err(StateIdError::Empty),
            n if n > MAX_STATE_ID_BYTES => Err(StateIdError::TooLong(n)),
            _ => Ok(Self(raw)),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for StateId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        ClientText(&self.0).fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_meltano_ids_and_odd_characters() {
        for id in [
            "dev:tap-github-to-target-jsonl",
            "a/b c.d",
            "x",
            "'; DROP TABLE state; --",
            "back\\slash \"quoted\"",
            "ünïcødé 🚀",
        ] {
            assert_eq!(StateId::parse(id).unwrap().as_str(), id);
        }
    }

    #[test]
    fn length_is_counted_in_bytes() {
        assert!(StateId::parse("a".repeat(900)).is_ok());
        assert_eq!(
            StateId::parse("a".repeat(901)),
            Err(StateIdError::TooLong(901))
        );
        // 300 three-byte characters fill the 900 bytes exactly; one more does not fit.
        assert!(StateId::parse("€".repeat(300)).is_ok());
        assert_eq!(
            StateId::parse("€".repeat(301)),
            Err(StateIdError::TooLong(903))
        );
    }

    #[test]
    fn displays_as_a_log_safe_form() {
        assert_eq!(
            StateId::parse("dev:tap-a").unwrap().to_string(),
            "dev:tap-a"
        );
        let forged = StateId::parse("a\r\nINFO forged").unwrap();
        assert_eq!(forged.to_string(), r#""a\r\nINFO forged""#);
        assert_eq!(forged.as_str(), "a\r\nINFO forged");
    }

    #[test]
    fn rejects_empty() {
        assert_eq!(StateId::parse(""), Err(StateIdError::Empty));
    }
}
