//! One entry of a tokens file: `<role> <token|sha256:hex> [<name>]
//! [scope=<glob>[,<glob>...]] [expires=<RFC 3339>]`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use crate::domain::{Scope, StatePattern};

/// What a token may do; each role includes the ones before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// Read states and locks: dashboards.
    Read,
    /// Also write states and take locks: Meltano workers.
    Write,
    /// Also delete many states and force-unlock: operators.
    Admin,
}

impl Role {
    fn parse(raw: &str) -> Option<Self> {
        match raw {
            "read" => Some(Self::Read),
            "write" => Some(Self::Write),
            "admin" => Some(Self::Admin),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Write => "write",
            Self::Admin => "admin",
        }
    }

    /// The role with its article, as a sentence names it: "an admin token".
    pub fn with_article(self) -> &'static str {
        match self {
            Self::Read => "a read",
            Self::Write => "a write",
            Self::Admin => "an admin",
        }
    }
}

/// An entry as written, the token already reduced to its digest.
#[derive(Clone, Debug)]
pub struct Line {
    pub digest: [u8; 32],
    pub role: Role,
    /// Empty when the line names none.
    pub name: String,
    pub scope: Scope,
    pub expires: Option<SystemTime>,
}

pub fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

fn parse_hex_digest(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

impl Line {
    /// Parses one non-blank, non-comment entry; the error says what is wrong
    /// with it (never quoting the token).
    pub fn parse(entry: &str) -> Result<Self, String> {
        let mut words = entry.split_whitespace();
        let (Some(role), Some(secret)) = (words.next(), words.next()) else {
            return Err("expected `<role> <token>` or `<role> <token> <name>`".into());
        };
        let role = Role::parse(role).ok_or("role must be read, write or admin")?;
        let digest = match secret.strip_prefix("sha256:") {
            Some(hex) => parse_hex_digest(hex).ok_or("sha256: needs 64 hex digits")?,
            None if secret.len() < 16 => return Err("a token needs at least 16 characters".into()),
            None => digest(secret),
        };
        let (mut name, mut scope, mut expires) = (Vec::new(), None, None);
        for word in words {
            if let Some(globs) = word.strip_prefix("scope=") {
                if scope.replace(parse_scope(globs)?).is_some() {
                    return Err("scope= is given twice".into());
                }
            } else if let Some(at) = word.strip_prefix("expires=") {
                if expires.replace(parse_expiry(at)?).is_some() {
                    return Err("expires= is given twice".into());
                }
            } else {
                name.push(word);
            }
        }
        Ok(Self {
            digest,
            role,
            name: name.join(" "),
            scope: scope.unwrap_or_else(Scope::everything),
            expires,
        })
    }
}

fn parse_scope(globs: &str) -> Result<Scope, String> {
    globs
        .split(',')
        .map(|glob| {
            StatePattern::parse(glob)
                .map_err(|e| format!("scope= needs globs separated by commas: {e}"))
        })
        .collect::<Result<_, _>>()
        .map(Scope::of)
}

/// RFC 3339: `2026-12-31T23:59:59Z`, fractions and a `±HH:MM` offset allowed.
fn parse_expiry(raw: &str) -> Result<SystemTime, String> {
    let invalid = || format!("expires={raw} is not an RFC 3339 time such as 2026-12-31T23:59:59Z");
    let upper = raw.to_ascii_uppercase();
    let split = upper
        .len()
        .checked_sub(6)
        .and_then(|at| Some((upper.get(..at)?, upper.get(at..)?)));
    let (utc_text, offset) = match split {
        Some((local, offset))
            if offset.starts_with(['+', '-']) && offset.get(3..4) == Some(":") =>
        {
            let hours: u64 = offset[1..3].parse().map_err(|_| invalid())?;
            let minutes: u64 = offset[4..].parse().map_err(|_| invalid())?;
            let by = Duration::from_secs(hours * 3600 + minutes * 60);
            (format!("{local}Z"), Some((offset.starts_with('+'), by)))
        }
        _ => (upper.clone(), None),
    };
    // The weak parser also takes a time without a zone, which RFC 3339 does not.
    if !utc_text.ends_with('Z') {
        return Err(invalid());
    }
    let at = humantime::parse_rfc3339_weak(&utc_text).map_err(|_| invalid())?;
    let utc = match offset {
        // A local time ahead of UTC: the UTC one is earlier.
        Some((true, by)) => at.checked_sub(by),
        Some((false, by)) => at.checked_add(by),
        None => Some(at),
    };
    utc.filter(|t| *t >= UNIX_EPOCH).ok_or_else(invalid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::StateId;

    fn at(rfc3339: &str) -> SystemTime {
        humantime::parse_rfc3339(rfc3339).unwrap()
    }

    #[test]
    fn a_plain_line_has_every_id_and_no_expiry() {
        let line = Line::parse("write worker-token-0123456789 etl workers").unwrap();
        assert_eq!(line.role, Role::Write);
        assert_eq!(line.name, "etl workers");
        assert!(line.scope.is_everything());
        assert_eq!(line.expires, None);
        assert_eq!(line.digest, digest("worker-token-0123456789"));
    }

    #[test]
    fn scope_and_expiry_follow_the_name_in_any_order() {
        let line = Line::parse(
            "read sha256:0000000000000000000000000000000000000000000000000000000000000000 team a dashboard expires=2027-01-01T00:00:00Z scope=team-a:*,shared:?",
        )
        .unwrap();
        assert_eq!(line.name, "team a dashboard");
        let id = |raw: &str| StateId::parse(raw.to_owned()).unwrap();
        assert!(line.scope.allows(&id("team-a:tap")));
        assert!(line.scope.allows(&id("shared:x")));
        assert!(!line.scope.allows(&id("team-b:tap")));
        assert_eq!(line.expires, Some(at("2027-01-01T00:00:00Z")));
        let unnamed = Line::parse("admin admin-token-0123456789 scope=a*").unwrap();
        assert_eq!(unnamed.name, "");
    }

    #[test]
    fn expiry_takes_fractions_and_offsets() {
        for (raw, utc) in [
            ("2027-01-01T00:00:00.500Z", "2027-01-01T00:00:00.500Z"),
            ("2027-01-01T02:00:00+02:00", "2027-01-01T00:00:00Z"),
            ("2026-12-31T19:30:00-04:30", "2027-01-01T00:00:00Z"),
            ("2027-01-01t00:00:00z", "2027-01-01T00:00:00Z"),
        ] {
            let line = Line::parse(&format!("read read-token-0123456789 expires={raw}")).unwrap();
            assert_eq!(line.expires, Some(at(utc)), "{raw}");
        }
    }

    #[test]
    fn bad_options_say_what_is_wrong() {
        for (options, reason) in [
            ("scope=", "scope= needs globs"),
            ("scope=a*,,b*", "scope= needs globs"),
            ("scope=a* scope=b*", "twice"),
            ("expires=tomorrow", "RFC 3339"),
            ("expires=2027-01-01", "RFC 3339"),
            ("expires=2027-01-01T00:00:00", "RFC 3339"),
            (
                "expires=2027-01-01T00:00:00Z expires=2028-01-01T00:00:00Z",
                "twice",
            ),
        ] {
            let err = Line::parse(&format!("read read-token-0123456789 {options}")).unwrap_err();
            assert!(err.contains(reason), "{options}: {err}");
            assert!(!err.contains("read-token-0123456789"), "{err}");
        }
    }
}
