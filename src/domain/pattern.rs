use std::fmt;

use super::StateId;
use crate::telemetry::ClientText;

/// Longest glob accepted: room for a 900-byte id with wildcards around it.
pub const MAX_PATTERN_BYTES: usize = 4096;

/// A state-id glob with fnmatch's meaning of `*` (any run of characters, `/`
/// included) and `?` (exactly one character). Everything else is literal,
/// including `%`, `_` and `[`, so a glob never leaks SQL LIKE or class syntax.
///
/// A pattern made by [`StatePattern::with_literals`] may also hold `*` and
/// `?` that stand only for themselves: the text a token's claim put into a
/// scope (see `auth::jwt`), so that a claim never widens it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatePattern {
    text: String,
    /// For each character of `text`, whether it is only itself even when it
    /// is `*` or `?`; empty when none is (every glob a client sends).
    literal: Vec<bool>,
}

/// One character of a glob, as matching reads it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Glob {
    Any,
    One,
    Char(char),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    /// It could only match the empty id, which cannot exist: surely a mistake.
    #[error("pattern must not be empty; `*` matches every state_id")]
    Empty,
    #[error("pattern is {0} bytes long; at most {MAX_PATTERN_BYTES} bytes are allowed")]
    TooLong(usize),
}

impl StatePattern {
    pub fn parse(raw: impl Into<String>) -> Result<Self, PatternError> {
        let raw = raw.into();
        Self::checked(raw, Vec::new())
    }

    /// A pattern of pieces, each a glob (`false`) or text whose `*` and `?`
    /// match only themselves (`true`).
    pub fn with_literals<'a>(
        pieces: impl IntoIterator<Item = (&'a str, bool)>,
    ) -> Result<Self, PatternError> {
        let (mut text, mut literal) = (String::new(), Vec::new());
        for (piece, is_literal) in pieces {
            text.push_str(piece);
            literal.extend(piece.chars().map(|_| is_literal));
        }
        if !literal.contains(&true) {
            literal.clear();
        }
        Self::checked(text, literal)
    }

    fn checked(text: String, literal: Vec<bool>) -> Result<Self, PatternError> {
        match text.len() {
            0 => Err(PatternError::Empty),
            n if n > MAX_PATTERN_BYTES => Err(PatternError::TooLong(n)),
            _ => Ok(Self { text, literal }),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The pattern's characters with their meaning, and each one's byte offset.
    fn globs(&self) -> impl Iterator<Item = (usize, Glob)> + '_ {
        self.text.char_indices().enumerate().map(|(i, (at, c))| {
            let wild = !self.literal.get(i).copied().unwrap_or(false);
            let glob = match c {
                '*' if wild => Glob::Any,
                '?' if wild => Glob::One,
                other => Glob::Char(other),
            };
            (at, glob)
        })
    }

    pub fn matches_everything(&self) -> bool {
        self.globs().all(|(_, glob)| glob == Glob::Any)
    }

    /// Whether `id` is in the glob's language (the same one [`Self::to_regex`]
    /// gives ClickHouse).
    pub fn matches(&self, id: &StateId) -> bool {
        self.matches_text(id.as_str())
    }

    /// Whether `text` is in the glob's language, by the classic two-pointer
    /// match with one backtrack point: linear in practice, quadratic at worst.
    pub fn matches_text(&self, text: &str) -> bool {
        let glob: Vec<Glob> = self.globs().map(|(_, glob)| glob).collect();
        let text: Vec<char> = text.chars().collect();
        let (mut g, mut t) = (0, 0);
        let mut star: Option<(usize, usize)> = None;
        while t < text.len() {
            match glob.get(g) {
                Some(Glob::Any) => {
                    star = Some((g, t));
                    g += 1;
                }
                Some(Glob::One) => {
                    g += 1;
                    t += 1;
                }
                Some(Glob::Char(c)) if *c == text[t] => {
                    g += 1;
                    t += 1;
                }
                _ => match star {
                    Some((star_g, star_t)) => {
                        g = star_g + 1;
                        t = star_t + 1;
                        star = Some((star_g, star_t + 1));
                    }
                    None => return false,
                },
            }
        }
        glob[g..].iter().all(|glob| *glob == Glob::Any)
    }

    /// The same language as an RE2 expression (ClickHouse `match`), anchored at
    /// both ends; `(?s)` lets `?` and `*` cross newlines as fnmatch does.
    pub fn to_regex(&self) -> String {
        let mut re = String::with_capacity(self.text.len() + 8);
        re.push_str("(?s)^");
        for (_, glob) in self.globs() {
            match glob {
                Glob::Any => re.push_str(".*"),
                Glob::One => re.push('.'),
                Glob::Char(
                    c @ ('\\' | '.' | '+' | '(' | ')' | '|' | '[' | ']' | '{' | '}' | '^' | '$'
                    | '*' | '?'),
                ) => {
                    re.push('\\');
                    re.push(c);
                }
                Glob::Char(c) => re.push(c),
            }
        }
        re.push('$');
        re
    }

    /// The literal text every match starts with, which lets ClickHouse use the
    /// primary key instead of scanning every id.
    pub fn literal_prefix(&self) -> &str {
        let end = self
            .globs()
            .find(|(_, glob)| matches!(glob, Glob::Any | Glob::One))
            .map_or(self.text.len(), |(at, _)| at);
        &self.text[..end]
    }
}

/// The log form, as for [`crate::domain::StateId`]: the glob is the client's text.
impl fmt::Display for StatePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        ClientText(&self.text).fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_in_memory_as_clickhouse_does() {
        let id = |raw: &str| StateId::parse(raw.to_owned()).unwrap();
        for (glob, text, expected) in [
            ("*", "anything/at all", true),
            ("dev:*", "dev:tap-a-to-b", true),
            ("dev:*", "prod:tap", false),
            ("dev:tap-?", "dev:tap-a", true),
            ("dev:tap-?", "dev:tap-ab", false),
            ("*-to-*", "dev:tap-a-to-target-b", true),
            ("a*b*c", "a-b-b-c", true),
            ("a*b*c", "a-b-b-d", false),
            ("100%_[x]", "100%_[x]", true),
            ("100%_[x]", "100ab[x]", false),
            ("é?", "éé", true),
            ("**", "x", true),
        ] {
            assert_eq!(
                pattern(glob).matches(&id(text)),
                expected,
                "{glob} ~ {text}"
            );
        }
    }

    fn pattern(raw: &str) -> StatePattern {
        StatePattern::parse(raw).unwrap()
    }

    #[test]
    fn wildcards_become_regex_and_the_rest_stays_literal() {
        assert_eq!(pattern("dev:*").to_regex(), "(?s)^dev:.*$");
        assert_eq!(pattern("a?c").to_regex(), "(?s)^a.c$");
        assert_eq!(pattern("100%_done").to_regex(), "(?s)^100%_done$");
        assert_eq!(
            pattern("a.b+[c](d)|{e}^$\\").to_regex(),
            "(?s)^a\\.b\\+\\[c\\]\\(d\\)\\|\\{e\\}\\^\\$\\\\$"
        );
    }

    #[test]
    fn literal_prefix_stops_at_the_first_wildcard() {
        assert_eq!(pattern("dev:tap-*-x?").literal_prefix(), "dev:tap-");
        assert_eq!(pattern("exact").literal_prefix(), "exact");
        assert_eq!(pattern("*x").literal_prefix(), "");
    }

    #[test]
    fn literal_wildcards_match_only_themselves() {
        let id = |raw: &str| StateId::parse(raw.to_owned()).unwrap();
        let made =
            StatePattern::with_literals([("gh:", false), ("org/*?", true), ("/*", false)]).unwrap();
        assert!(made.matches(&id("gh:org/*?/x")));
        assert!(!made.matches(&id("gh:org/ab/x")));
        assert!(!made.matches(&id("gh:other/x")));
        assert_eq!(made.literal_prefix(), "gh:org/*?/");
        assert_eq!(made.to_regex(), "(?s)^gh:org/\\*\\?/.*$");
        assert!(
            !StatePattern::with_literals([("*", true)])
                .unwrap()
                .matches_everything()
        );
        assert_eq!(
            StatePattern::with_literals([("a*", false)]).unwrap(),
            pattern("a*")
        );
    }

    #[test]
    fn only_stars_match_everything() {
        assert!(pattern("*").matches_everything());
        assert!(pattern("**").matches_everything());
        assert!(!pattern("*a").matches_everything());
    }

    #[test]
    fn rejects_empty_and_overlong_patterns() {
        assert_eq!(StatePattern::parse(""), Err(PatternError::Empty));
        assert!(StatePattern::parse("*".repeat(MAX_PATTERN_BYTES)).is_ok());
        assert_eq!(
            StatePattern::parse("*".repeat(MAX_PATTERN_BYTES + 1)),
            Err(PatternError::TooLong(MAX_PATTERN_BYTES + 1))
        );
    }
}
