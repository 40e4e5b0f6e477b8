//! Bearer tokens with three roles, each limited to a scope of state_ids and
//! perhaps to a time. Only SHA-256 digests of the tokens are kept, and a
//! presented token is compared against every one in constant time.

pub mod jwt;
mod line;
pub mod live;
pub mod reload;

use std::path::PathBuf;
use std::time::SystemTime;

pub use self::line::Role;
use self::line::{Line, digest};
use crate::domain::Scope;

#[derive(Debug, thiserror::Error)]
#[error("{source_name} line {line}: {reason}")]
pub struct TokenError {
    source_name: String,
    line: usize,
    reason: String,
}

#[derive(Clone, Default)]
pub struct Tokens {
    entries: Vec<Entry>,
}

#[derive(Clone)]
struct Entry {
    digest: [u8; 32],
    role: Role,
    /// Who the token stands for, as history and the log record it.
    actor: String,
    scope: Scope,
    expires: Option<SystemTime>,
}

/// Who made a request, as history records it: the token's name, else its role
/// and a short digest of it, else `anonymous` when the gateway has no tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Actor(pub String);

impl Actor {
    pub fn anonymous() -> Self {
        Self("anonymous".to_owned())
    }
}

/// What a presented token may do.
#[derive(Clone, Debug)]
pub struct Grant {
    pub role: Role,
    pub actor: Actor,
    pub scope: Scope,
}

/// What a presented token turned out to be.
#[derive(Clone, Debug)]
pub enum Identified {
    Unknown,
    /// One of ours, past its `expires=`: named so the denial can be logged.
    Expired(Actor),
    Valid(Grant),
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokens({} configured)", self.entries.len())
    }
}

/// Equal without an early exit, so timing says nothing about where they differ.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Tokens {
    /// Adds entries (see [`line`] for their form), one per line (a file) or
    /// separated by commas (an environment variable); blank entries and `#`
    /// comments are skipped. Between commas, a word with no blank after an
    /// entry ending in `scope=…` is one more glob of that scope.
    pub fn add(
        &mut self,
        source_name: &str,
        text: &str,
        separator: char,
    ) -> Result<(), TokenError> {
        let mut entries: Vec<(usize, String)> = Vec::new();
        for (index, piece) in text.split(separator).enumerate() {
            let piece = piece.trim();
            let continues_scope = separator == ','
                && !piece.is_empty()
                && !piece.contains(char::is_whitespace)
                && entries.last().is_some_and(|(_, last)| {
                    last.split_whitespace()
                        .last()
                        .is_some_and(|word| word.starts_with("scope="))
                });
            match entries.last_mut() {
                Some((_, last)) if continues_scope => {
                    last.push(',');
                    last.push_str(piece);
                }
                _ => entries.push((index + 1, piece.to_owned())),
            }
        }
        for (line, entry) in entries {
            if entry.is_empty() || entry.starts_with('#') {
                continue;
            }
            let parsed = Line::parse(&entry).map_err(|reason| TokenError {
                source_name: source_name.to_owned(),
                line,
                reason,
            })?;
            let actor = if parsed.name.is_empty() {
                let short: String = parsed.digest[..4]
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect();
                format!("{}:{short}", parsed.role.as_str())
            } else {
                parsed.name
            };
            self.entries.push(Entry {
                digest: parsed.digest,
                role: parsed.role,
                actor,
                scope: parsed.scope,
                expires: parsed.expires,
            });
        }
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// What a presented token may do at `now`: of the entries listing it
    /// that have not expired, the strongest; `Expired` when all have.
    pub fn identify(&self, presented: &str, now: SystemTime) -> Identified {
        let presented = digest(presented);
        // Every entry is compared, matched or not.
        let matching: Vec<&Entry> = self
            .entries
            .iter()
            .filter(|entry| constant_time_eq(&entry.digest, &presented))
            .collect();
        let live = matching
            .iter()
            .filter(|entry| entry.expires.is_none_or(|at| now < at))
            .max_by_key(|entry| entry.role);
        match (live, matching.first()) {
            (Some(entry), _) => Identified::Valid(Grant {
                role: entry.role,
                actor: Actor(entry.actor.clone()),
                scope: entry.scope.clone(),
            }),
            (None, Some(expired)) => Identified::Expired(Actor(expired.actor.clone())),
            (None, None) => Identified::Unknown,
        }
    }
}

/// Where the tokens come from: read at start, and again on a reload.
#[derive(Clone, Debug, Default)]
pub struct TokenSources {
    pub file: Option<PathBuf>,
    /// `STATEHOUSE_TOKENS` (`--tokens`): comma-separated, fixed for the
    /// life of the process.
    pub inline: Option<String>,
}

/// Why the tokens could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read the tokens file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid token entry: {0}")]
    Invalid(#[from] TokenError),
}

impl TokenSources {
    pub fn load(&self) -> Result<Tokens, LoadError> {
        let mut tokens = Tokens::default();
        if let Some(path) = &self.file {
            let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
                path: path.display().to_string(),
                source,
            })?;
            tokens.add(&path.display().to_string(), &text, '\n')?;
        }
        if let Some(text) = &self.inline {
            tokens.add("STATEHOUSE_TOKENS", text, ',')?;
        }
        Ok(tokens)
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_come_from_plain_or_hashed_entries() {
        let mut tokens = Tokens::default();
        let hashed: String = digest("admin-token-0123456789")
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        tokens
            .add(
                "file",
                &format!("# comment\nread reader-token-0123456789\n\nwrite writer-token-0123456789\nadmin sha256:{hashed}\n"),
                '\n',
            )
            .unwrap();
        assert_eq!(tokens.len(), 3);
        let role_of = |t: &str| match tokens.identify(t, SystemTime::now()) {
            Identified::Valid(grant) => Some(grant.role),
            _ => None,
        };
        assert_eq!(role_of("reader-token-0123456789"), Some(Role::Read));
        assert_eq!(role_of("writer-token-0123456789"), Some(Role::Write));
        assert_eq!(role_of("admin-token-0123456789"), Some(Role::Admin));
        assert_eq!(role_of("reader-token-012345678"), None);
        assert_eq!(role_of(""), None);
    }

    #[test]
    fn a_token_is_named_by_its_line_or_by_its_role_and_digest() {
        let mut tokens = Tokens::default();
        tokens
            .add(
                "file",
                "write worker-token-0123456789 etl workers\nread dash-token-0123456789",
                '\n',
            )
            .unwrap();
        let actor = |t: &str| match tokens.identify(t, SystemTime::now()) {
            Identified::Valid(grant) => Some(grant.actor.0),
            _ => None,
        };
        assert_eq!(
            actor("worker-token-0123456789").as_deref(),
            Some("etl workers")
        );
        let short: String = digest("dash-token-0123456789")[..4]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            actor("dash-token-0123456789"),
            Some(format!("read:{short}"))
        );
    }

    #[test]
    fn bad_entries_name_their_line() {
        for (text, reason) in [
            ("reader-token-0123456789", "expected"),
            ("owner token-0123456789012", "role must be"),
            ("read short", "at least 16"),
            ("read sha256:abc", "64 hex"),
        ] {
            let err = Tokens::default()
                .add("STATEHOUSE_TOKENS", text, ',')
                .unwrap_err();
            assert!(err.to_string().contains(reason), "{text}: {err}");
            assert!(
                err.to_string().starts_with("STATEHOUSE_TOKENS line 1"),
                "{err}"
            );
        }
    }

    #[test]
    fn a_token_past_its_expiry_is_expired_and_named() {
        let mut tokens = Tokens::default();
        tokens
            .add(
                "file",
                "write old-token-0123456789 nightly expires=2027-01-01T00:00:00Z",
                '\n',
            )
            .unwrap();
        let at = |t: &str| humantime::parse_rfc3339(t).unwrap();
        assert!(matches!(
            tokens.identify("old-token-0123456789", at("2026-12-31T23:59:59Z")),
            Identified::Valid(_)
        ));
        match tokens.identify("old-token-0123456789", at("2027-01-01T00:00:00Z")) {
            Identified::Expired(actor) => assert_eq!(actor.0, "nightly"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            tokens.identify("other-token-0123456789", at("2027-01-01T00:00:00Z")),
            Identified::Unknown
        ));
    }

    #[test]
    fn between_commas_a_scope_keeps_its_globs() {
        let mut tokens = Tokens::default();
        tokens
            .add(
                "STATEHOUSE_TOKENS",
                "read team-a-token-0123456789 scope=team-a:*,shared:*, write w-token-0123456789 worker",
                ',',
            )
            .unwrap();
        assert_eq!(tokens.len(), 2);
        let Identified::Valid(grant) =
            tokens.identify("team-a-token-0123456789", SystemTime::now())
        else {
            panic!("not identified");
        };
        let id = |raw: &str| crate::domain::StateId::parse(raw.to_owned()).unwrap();
        assert!(grant.scope.allows(&id("shared:x")));
        assert!(grant.scope.allows(&id("team-a:x")));
        assert!(!grant.scope.allows(&id("team-b:x")));
        assert!(matches!(
            tokens.identify("w-token-0123456789", SystemTime::now()),
            Identified::Valid(Grant {
                role: Role::Write,
                ..
            })
        ));
    }

    #[test]
    fn roles_are_ordered() {
        assert!(Role::Read < Role::Write && Role::Write < Role::Admin);
    }
}
