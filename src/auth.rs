//! Bearer tokens with three roles. Only SHA-256 digests of the tokens are kept,
//! and a presented token is compared against every one in constant time.

use sha2::{Digest, Sha256};

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
}

#[derive(Debug, thiserror::Error)]
#[error("{source_name} line {line}: {reason}")]
pub struct TokenError {
    source_name: String,
    line: usize,
    reason: &'static str,
}

#[derive(Clone, Default)]
pub struct Tokens {
    entries: Vec<Entry>,
}

#[derive(Clone)]
struct Entry {
    digest: [u8; 32],
    role: Role,
    /// Who the token stands for, as history records it.
    actor: String,
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

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokens({} configured)", self.entries.len())
    }
}

fn digest(token: &str) -> [u8; 32] {
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

/// Equal without an early exit, so timing says nothing about where they differ.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Tokens {
    /// Adds entries of the form `<role> <token> [<name>]` or `<role>
    /// sha256:<hex digest> [<name>]`, one per line (a file) or separated by
    /// commas (an environment variable); blank entries and `#` comments are
    /// skipped. The name is what history records as the actor.
    pub fn add(
        &mut self,
        source_name: &str,
        text: &str,
        separator: char,
    ) -> Result<(), TokenError> {
        for (index, entry) in text.split(separator).enumerate() {
            let entry = entry.trim();
            if entry.is_empty() || entry.starts_with('#') {
                continue;
            }
            let fail = |reason| TokenError {
                source_name: source_name.to_owned(),
                line: index + 1,
                reason,
            };
            let mut words = entry.split_whitespace();
            let (Some(role), Some(secret)) = (words.next(), words.next()) else {
                return Err(fail("expected `<role> <token>` or `<role> <token> <name>`"));
            };
            let name = words.collect::<Vec<_>>().join(" ");
            let role =
                Role::parse(role).ok_or_else(|| fail("role must be read, write or admin"))?;
            let digest = match secret.strip_prefix("sha256:") {
                Some(hex) => {
                    parse_hex_digest(hex).ok_or_else(|| fail("sha256: needs 64 hex digits"))?
                }
                None if secret.len() < 16 => {
                    return Err(fail("a token needs at least 16 characters"));
                }
                None => digest(secret),
            };
            let actor = if name.is_empty() {
                let short: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
                format!("{}:{short}", role.as_str())
            } else {
                name
            };
            self.entries.push(Entry {
                digest,
                role,
                actor,
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

    /// The role and actor of a presented token, if it is one of ours (the
    /// strongest entry, should a token be listed twice).
    pub fn identify(&self, presented: &str) -> Option<(Role, Actor)> {
        let presented = digest(presented);
        // Every entry is compared, matched or not.
        self.entries
            .iter()
            .filter(|entry| constant_time_eq(&entry.digest, &presented))
            .max_by_key(|entry| entry.role)
            .map(|entry| (entry.role, Actor(entry.actor.clone())))
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
        let role_of = |t: &str| tokens.identify(t).map(|(role, _)| role);
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
        let actor = |t: &str| tokens.identify(t).map(|(_, actor)| actor.0);
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
    fn roles_are_ordered() {
        assert!(Role::Read < Role::Write && Role::Write < Role::Admin);
    }
}
