//! The issuers file (`--jwt-issuers`): a JSON list of issuers, each with
//! where its keys are, the audience its tokens must name and its bindings.
//! What parses is checked: an issuer in use is always a usable one.

use std::path::{Path, PathBuf};
use std::time::Duration;

use jsonwebtoken::Algorithm;
use serde::Deserialize;

use super::binding::{Binding, Template};
use crate::auth::Role;
use crate::domain::StatePattern;

/// The longest leeway an issuer may give on `exp` and `nbf`.
const MAX_LEEWAY: Duration = Duration::from_secs(300);
const DEFAULT_LEEWAY_SECONDS: u64 = 60;

/// Where an issuer's key set is read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeySource {
    Url(url::Url),
    File(PathBuf),
}

#[derive(Clone, Debug)]
pub struct Issuer {
    /// The `iss` its tokens carry.
    pub issuer: String,
    pub keys: KeySource,
    /// The PEM CA file a `jwks_url` over https must chain to; the system's when none.
    pub ca_file: Option<PathBuf>,
    /// What `aud` must hold.
    pub audience: String,
    pub leeway: Duration,
    /// RS256 and ES256 at most: never `none`, never an HMAC.
    pub algorithms: Vec<Algorithm>,
    pub bindings: Vec<Binding>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawIssuer {
    issuer: String,
    jwks_url: Option<String>,
    jwks_file: Option<PathBuf>,
    audience: String,
    leeway_seconds: Option<u64>,
    algorithms: Option<Vec<String>>,
    ca_file: Option<PathBuf>,
    bindings: Vec<RawBinding>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBinding {
    claims: serde_json::Map<String, serde_json::Value>,
    role: String,
    scope: Option<Vec<String>>,
    name: String,
}

/// Reads and checks the issuers file; the error names the file, the issuer
/// and what is wrong.
pub fn load(path: &Path) -> Result<Vec<Issuer>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the issuers file {}: {e}", path.display()))?;
    parse(&text).map_err(|why| format!("issuers file {}: {why}", path.display()))
}

pub fn parse(text: &str) -> Result<Vec<Issuer>, String> {
    let raw: Vec<RawIssuer> = serde_json::from_str(text).map_err(|e| e.to_string())?;
    if raw.is_empty() {
        return Err("no issuer: the list is empty".to_owned());
    }
    let mut issuers: Vec<Issuer> = Vec::with_capacity(raw.len());
    for (index, raw) in raw.into_iter().enumerate() {
        let issuer = checked(raw).map_err(|why| format!("issuer {}: {why}", index + 1))?;
        if issuers.iter().any(|other| other.issuer == issuer.issuer) {
            return Err(format!(
                "issuer {}: {:?} is listed twice",
                index + 1,
                issuer.issuer
            ));
        }
        issuers.push(issuer);
    }
    Ok(issuers)
}

fn checked(raw: RawIssuer) -> Result<Issuer, String> {
    if raw.issuer.is_empty() {
        return Err("`issuer` is empty".to_owned());
    }
    if raw.audience.is_empty() {
        return Err("`audience` is empty: every token must be meant for this gateway".to_owned());
    }
    let keys = match (raw.jwks_url, raw.jwks_file) {
        (Some(url), None) => {
            let url = url::Url::parse(&url).map_err(|e| format!("jwks_url {url:?}: {e}"))?;
            if !matches!(url.scheme(), "https" | "http") {
                return Err("jwks_url must be https:// (or http://)".to_owned());
            }
            KeySource::Url(url)
        }
        (None, Some(path)) => KeySource::File(path),
        _ => return Err("give one of `jwks_url` and `jwks_file`".to_owned()),
    };
    let leeway = Duration::from_secs(raw.leeway_seconds.unwrap_or(DEFAULT_LEEWAY_SECONDS));
    if leeway > MAX_LEEWAY {
        return Err(format!(
            "leeway_seconds is {}; at most {} are allowed",
            leeway.as_secs(),
            MAX_LEEWAY.as_secs()
        ));
    }
    let algorithms = match raw.algorithms {
        None => vec![Algorithm::RS256, Algorithm::ES256],
        Some(names) if names.is_empty() => {
            return Err("`algorithms` is empty".to_owned());
        }
        Some(names) => names
            .iter()
            .map(|name| match name.as_str() {
                "RS256" => Ok(Algorithm::RS256),
                "ES256" => Ok(Algorithm::ES256),
                other => Err(format!(
                    "algorithm {other:?} is not accepted: RS256 and ES256 only (never none, never an HMAC)"
                )),
            })
            .collect::<Result<_, _>>()?,
    };
    if raw.bindings.is_empty() {
        return Err("no binding: no token of it could be let in".to_owned());
    }
    let bindings = raw
        .bindings
        .into_iter()
        .enumerate()
        .map(|(index, raw)| binding(raw).map_err(|why| format!("binding {}: {why}", index + 1)))
        .collect::<Result<_, _>>()?;
    Ok(Issuer {
        issuer: raw.issuer,
        keys,
        ca_file: raw.ca_file,
        audience: raw.audience,
        leeway,
        algorithms,
        bindings,
    })
}

fn binding(raw: RawBinding) -> Result<Binding, String> {
    let role = match raw.role.as_str() {
        "read" => Role::Read,
        "write" => Role::Write,
        "admin" => Role::Admin,
        other => return Err(format!("role {other:?}: use read, write or admin")),
    };
    let claims = raw
        .claims
        .into_iter()
        .map(|(claim, glob)| {
            let glob = glob
                .as_str()
                .ok_or_else(|| format!("claim {claim:?}: its glob must be a string"))?;
            StatePattern::parse(glob)
                .map(|glob| (claim.clone(), glob))
                .map_err(|e| format!("claim {claim:?}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    let scope = match raw.scope {
        None => None,
        Some(globs) if globs.is_empty() => {
            return Err("`scope` is empty: leave it out for every state_id".to_owned());
        }
        Some(globs) => Some(
            globs
                .iter()
                .map(|glob| {
                    if glob.is_empty() {
                        return Err("a scope glob is empty".to_owned());
                    }
                    Template::parse(glob)
                })
                .collect::<Result<_, _>>()?,
        ),
    };
    if raw.name.is_empty() {
        return Err("`name` is empty: it is the actor history records".to_owned());
    }
    Ok(Binding {
        claims,
        role,
        scope,
        name: Template::parse(&raw.name)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"[{"issuer":"https://token.actions.githubusercontent.com",
        "jwks_url":"https://token.actions.githubusercontent.com/.well-known/jwks",
        "audience":"statehouse",
        "bindings":[{"claims":{"repository":"org/*"},"role":"write",
                     "scope":["gh:${repository}/*"],"name":"github:${repository}"}]},
       {"issuer":"https://kubernetes.default.svc","jwks_file":"/var/jwks.json",
        "audience":"statehouse","leeway_seconds":0,"algorithms":["RS256"],
        "bindings":[{"claims":{"sub":"system:serviceaccount:etl:*"},"role":"read","name":"${sub}"}]}]"#;

    #[test]
    fn a_good_file_parses_with_its_defaults() {
        let issuers = parse(GOOD).unwrap();
        assert_eq!(issuers.len(), 2);
        assert_eq!(issuers[0].leeway, Duration::from_secs(60));
        assert_eq!(issuers[0].algorithms, [Algorithm::RS256, Algorithm::ES256]);
        assert_eq!(issuers[1].leeway, Duration::ZERO);
        assert_eq!(issuers[1].keys, KeySource::File("/var/jwks.json".into()));
        assert!(issuers[1].bindings[0].scope.is_none());
    }

    #[test]
    fn unsafe_or_unclear_issuers_are_refused() {
        let base = r#"{"issuer":"i","jwks_file":"f","audience":"a","bindings":[{"claims":{},"role":"read","name":"n"}]"#;
        for (extra, why) in [
            (r#","algorithms":["HS256"]"#, "never an HMAC"),
            (r#","algorithms":["none"]"#, "never none"),
            (r#","algorithms":[]"#, "empty"),
            (r#","leeway_seconds":301"#, "at most 300"),
            (r#","jwks_url":"https://x/jwks""#, "one of"),
            (r#","audiences":"x""#, "unknown field"),
        ] {
            let text = format!("[{base}{extra}}}]");
            let err = parse(&text).unwrap_err();
            assert!(err.contains(why), "{extra}: {err}");
        }
        for (text, why) in [
            ("[]", "empty"),
            (
                r#"[{"issuer":"i","jwks_file":"f","audience":"","bindings":[]}]"#,
                "audience",
            ),
            (
                r#"[{"issuer":"i","jwks_file":"f","audience":"a","bindings":[]}]"#,
                "no binding",
            ),
            (
                r#"[{"issuer":"i","jwks_file":"f","audience":"a","bindings":[{"claims":{},"role":"owner","name":"n"}]}]"#,
                "role",
            ),
            (
                r#"[{"issuer":"i","jwks_file":"f","audience":"a","bindings":[{"claims":{},"role":"read","name":"${x"}]}]"#,
                "without its",
            ),
            (
                r#"[{"issuer":"i","audience":"a","bindings":[{"claims":{},"role":"read","name":"n"}]}]"#,
                "one of",
            ),
        ] {
            let err = parse(text).unwrap_err();
            assert!(err.contains(why), "{text}: {err}");
        }
        let twice = format!("[{base}}},{base}}}]");
        assert!(parse(&twice).unwrap_err().contains("twice"));
    }
}
