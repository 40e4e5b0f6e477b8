//! A binding: which tokens of an issuer it takes (globs on their claims),
//! and what it grants them (a role, a scope and a name, templates over the
//! claims). A claim's text is put into a scope as literal text, so that a
//! `*` or `?` in a claim matches only itself and never widens the scope.

use serde_json::{Map, Value};

use crate::auth::{Actor, Grant, Role};
use crate::domain::{Scope, StatePattern};

/// Text with `${claim}` places, each filled with the token's claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Template(Vec<Piece>);

#[derive(Clone, Debug, PartialEq, Eq)]
enum Piece {
    Text(String),
    Claim(String),
}

impl Template {
    /// `${name}` is a claim (letters, digits, `_`, `-`, `.`, `:` and `/`);
    /// a `$` not before `{` is itself.
    pub fn parse(raw: &str) -> Result<Self, String> {
        let mut pieces = Vec::new();
        let mut rest = raw;
        while let Some(start) = rest.find("${") {
            if start > 0 {
                pieces.push(Piece::Text(rest[..start].to_owned()));
            }
            let after = &rest[start + 2..];
            let end = after
                .find('}')
                .ok_or_else(|| format!("{raw:?}: a `${{` without its `}}`"))?;
            let name = &after[..end];
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_-.:/".contains(c))
            {
                return Err(format!(
                    "{raw:?}: `${{{name}}}` is no claim name (letters, digits, _ - . : /)"
                ));
            }
            pieces.push(Piece::Claim(name.to_owned()));
            rest = &after[end + 1..];
        }
        if !rest.is_empty() {
            pieces.push(Piece::Text(rest.to_owned()));
        }
        Ok(Self(pieces))
    }

    /// The pieces filled in, each with whether it came from a claim; None
    /// when the token lacks a claim the template names.
    fn fill<'a>(&'a self, claims: &'a Map<String, Value>) -> Option<Vec<(String, bool)>> {
        self.0
            .iter()
            .map(|piece| match piece {
                Piece::Text(text) => Some((text.clone(), false)),
                Piece::Claim(name) => claim_text(claims.get(name)?).map(|text| (text, true)),
            })
            .collect()
    }

    /// The template as text (a name).
    pub fn render(&self, claims: &Map<String, Value>) -> Option<String> {
        let pieces = self.fill(claims)?;
        Some(pieces.into_iter().map(|(text, _)| text).collect())
    }

    /// The template as a state-id glob, the claims' text literal in it.
    pub fn render_glob(&self, claims: &Map<String, Value>) -> Option<StatePattern> {
        let pieces = self.fill(claims)?;
        StatePattern::with_literals(
            pieces
                .iter()
                .map(|(text, literal)| (text.as_str(), *literal)),
        )
        .ok()
    }
}

/// A claim's value as text: a string as it is, a number or a boolean as
/// JSON writes it; an object, an array or null is no text.
fn claim_text(value: &Value) -> Option<String> {
    match value {
        Value::String(text) => Some(text.clone()),
        Value::Number(number) => Some(number.to_string()),
        Value::Bool(flag) => Some(flag.to_string()),
        _ => None,
    }
}

/// One binding of an issuer.
#[derive(Clone, Debug)]
pub struct Binding {
    /// Every claim must be present as text that its glob matches.
    pub claims: Vec<(String, StatePattern)>,
    pub role: Role,
    /// None: every state_id.
    pub scope: Option<Vec<Template>>,
    pub name: Template,
}

impl Binding {
    /// What the binding grants a token with `claims`; None when it does not
    /// take the token (a claim missing or not matching, a template naming a
    /// claim the token lacks).
    pub fn grant(&self, claims: &Map<String, Value>) -> Option<Grant> {
        let takes = self.claims.iter().all(|(name, glob)| {
            claims
                .get(name)
                .and_then(claim_text)
                .is_some_and(|text| glob.matches_text(&text))
        });
        if !takes {
            return None;
        }
        let scope = match &self.scope {
            None => Scope::everything(),
            Some(templates) => Scope::of(
                templates
                    .iter()
                    .map(|template| template.render_glob(claims))
                    .collect::<Option<Vec<_>>>()?,
            ),
        };
        Some(Grant {
            role: self.role,
            actor: Actor(self.name.render(claims)?),
            scope,
        })
    }
}

/// The first of `bindings` that takes the token, as the contract orders them.
pub fn first_grant(bindings: &[Binding], claims: &Map<String, Value>) -> Option<Grant> {
    bindings.iter().find_map(|binding| binding.grant(claims))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::StateId;

    fn claims(json: &str) -> Map<String, Value> {
        serde_json::from_str(json).unwrap()
    }

    fn binding(globs: &[(&str, &str)], scope: &[&str], name: &str) -> Binding {
        Binding {
            claims: globs
                .iter()
                .map(|(claim, glob)| ((*claim).to_owned(), StatePattern::parse(*glob).unwrap()))
                .collect(),
            role: Role::Write,
            scope: Some(scope.iter().map(|t| Template::parse(t).unwrap()).collect()),
            name: Template::parse(name).unwrap(),
        }
    }

    fn id(raw: &str) -> StateId {
        StateId::parse(raw.to_owned()).unwrap()
    }

    #[test]
    fn templates_fill_claims_and_keep_other_text() {
        let t = Template::parse("gh:${repository}/${ref}-$x").unwrap();
        let filled = t.render(&claims(
            r#"{"repository":"org/repo","ref":"refs/heads/main"}"#,
        ));
        assert_eq!(filled.as_deref(), Some("gh:org/repo/refs/heads/main-$x"));
        assert_eq!(t.render(&claims(r#"{"repository":"org/repo"}"#)), None);
        let numbers = Template::parse("${n}:${b}").unwrap();
        assert_eq!(
            numbers.render(&claims(r#"{"n":42,"b":true}"#)).as_deref(),
            Some("42:true")
        );
        assert_eq!(numbers.render(&claims(r#"{"n":[1],"b":true}"#)), None);
    }

    #[test]
    fn bad_templates_are_refused() {
        for raw in ["${", "a${b", "${}", "${a b}", "${a$}"] {
            assert!(Template::parse(raw).is_err(), "{raw}");
        }
    }

    #[test]
    fn every_claim_glob_must_match() {
        let b = binding(
            &[("repository", "org/*"), ("ref", "refs/heads/main")],
            &["gh:${repository}/*"],
            "github:${repository}",
        );
        let grant = b
            .grant(&claims(
                r#"{"repository":"org/etl","ref":"refs/heads/main"}"#,
            ))
            .unwrap();
        assert_eq!(grant.actor.0, "github:org/etl");
        assert!(grant.scope.allows(&id("gh:org/etl/tap-a")));
        assert!(!grant.scope.allows(&id("gh:org/other/tap-a")));
        assert!(
            b.grant(&claims(
                r#"{"repository":"org/etl","ref":"refs/heads/dev"}"#
            ))
            .is_none()
        );
        assert!(b.grant(&claims(r#"{"repository":"org/etl"}"#)).is_none());
        assert!(
            b.grant(&claims(
                r#"{"repository":"other/etl","ref":"refs/heads/main"}"#
            ))
            .is_none()
        );
    }

    #[test]
    fn a_claim_never_widens_a_scope() {
        let b = binding(&[("project", "*")], &["team:${project}/*"], "${project}");
        for (claim, inside, outside) in [
            ("*", "team:*/x", "team:etl/x"),
            ("org/*", "team:org/*/x", "team:org/etl/x"),
            ("a?", "team:a?/x", "team:ab/x"),
        ] {
            let grant = b
                .grant(&claims(&format!(r#"{{"project":"{claim}"}}"#)))
                .unwrap();
            assert!(grant.scope.allows(&id(inside)), "{claim}: {inside}");
            assert!(!grant.scope.allows(&id(outside)), "{claim}: {outside}");
            assert!(!grant.scope.is_everything(), "{claim}");
        }
        // A scope of the claim alone: `*` is the id `*`, not every id.
        let alone = binding(&[], &["${project}"], "x")
            .grant(&claims(r#"{"project":"*"}"#))
            .unwrap();
        assert!(!alone.scope.is_everything());
        assert!(alone.scope.allows(&id("*")));
        assert!(!alone.scope.allows(&id("anything")));
    }

    #[test]
    fn the_first_binding_that_takes_the_token_wins() {
        let bindings = [
            binding(&[("sub", "admin:*")], &["*"], "first"),
            binding(&[("sub", "*")], &["x:*"], "second"),
        ];
        let grant = |sub: &str| {
            first_grant(&bindings, &claims(&format!(r#"{{"sub":"{sub}"}}"#)))
                .map(|grant| grant.actor.0)
        };
        assert_eq!(grant("admin:me").as_deref(), Some("first"));
        assert_eq!(grant("other").as_deref(), Some("second"));
        assert!(first_grant(&bindings, &claims("{}")).is_none());
    }

    #[test]
    fn no_scope_is_every_id() {
        let mut b = binding(&[], &[], "n");
        b.scope = None;
        assert!(b.grant(&claims("{}")).unwrap().scope.is_everything());
    }
}
