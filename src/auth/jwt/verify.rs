//! Checking one token against its issuer: the algorithm, the signature by
//! the key of its `kid`, `aud`, `exp` and `nbf` with the issuer's leeway;
//! then its bindings. A refusal says why in words that never quote the token.

use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, Header, Validation};
use serde_json::{Map, Value};

use super::binding::first_grant;
use super::issuers::Issuer;
use crate::auth::Grant;

/// Why a token was not let in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// `exp` past by more than the leeway.
    Expired,
    Invalid(String),
    /// `aud` missing, or without the issuer's audience.
    WrongAudience(String),
    /// `iss` is no configured issuer.
    UnknownIssuer,
    /// Valid, but no binding of its issuer takes it.
    NoBinding(String),
    /// Its issuer has never given its keys: try again after this long.
    KeysUnavailable(Duration),
}

/// A credential of three dot-separated parts is a JWT.
pub fn looks_like_jwt(credential: &str) -> bool {
    credential.split('.').count() == 3
}

/// The token's header and its unverified `iss`, to pick the issuer whose
/// keys then verify it.
pub fn unverified(token: &str) -> Result<(Header, String), Refusal> {
    let header = jsonwebtoken::decode_header(token).map_err(|_| {
        Refusal::Invalid(
            "the token's header is not a JWT header with an accepted algorithm".to_owned(),
        )
    })?;
    let payload = token.split('.').nth(1).unwrap_or_default();
    let claims: Map<String, Value> = URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .ok_or_else(|| Refusal::Invalid("the token's claims are not a JSON object".to_owned()))?;
    match claims.get("iss") {
        Some(Value::String(iss)) => Ok((header, iss.clone())),
        _ => Err(Refusal::UnknownIssuer),
    }
}

/// Whether `issuer` accepts the header's algorithm.
pub fn check_algorithm(issuer: &Issuer, header: &Header) -> Result<(), Refusal> {
    if issuer.algorithms.contains(&header.alg) {
        Ok(())
    } else {
        Err(Refusal::Invalid(format!(
            "the issuer {} does not accept the algorithm {:?}",
            issuer.issuer, header.alg
        )))
    }
}

/// The grant of a token whose key is `key`, checked in full.
pub fn verify(
    token: &str,
    alg: Algorithm,
    issuer: &Issuer,
    key: &DecodingKey,
) -> Result<Grant, Refusal> {
    let mut validation = Validation::new(alg);
    validation.algorithms = vec![alg];
    validation.leeway = issuer.leeway.as_secs();
    validation.validate_exp = true;
    validation.validate_nbf = true;
    validation.set_audience(&[&issuer.audience]);
    validation.set_issuer(&[&issuer.issuer]);
    validation.set_required_spec_claims(&["exp", "aud", "iss"]);
    let data = jsonwebtoken::decode::<Map<String, Value>>(token, key, &validation).map_err(
        |err| match err.kind() {
            ErrorKind::ExpiredSignature => Refusal::Expired,
            ErrorKind::InvalidAudience => Refusal::WrongAudience(format!(
                "the token's aud does not hold {:?}, the audience of its issuer",
                issuer.audience
            )),
            ErrorKind::MissingRequiredClaim(claim) if claim == "aud" => Refusal::WrongAudience(
                format!("the token has no aud; it must hold {:?}", issuer.audience),
            ),
            ErrorKind::MissingRequiredClaim(claim) => {
                Refusal::Invalid(format!("the token has no {claim} claim"))
            }
            ErrorKind::ImmatureSignature => Refusal::Invalid(
                "the token is not valid yet: its nbf is ahead by more than the leeway".to_owned(),
            ),
            ErrorKind::InvalidSignature => Refusal::Invalid(
                "the token's signature does not verify with its issuer's key".to_owned(),
            ),
            ErrorKind::InvalidIssuer => Refusal::UnknownIssuer,
            _ => Refusal::Invalid("the token is not a valid JWT of its issuer".to_owned()),
        },
    )?;
    first_grant(&issuer.bindings, &data.claims).ok_or_else(|| {
        Refusal::NoBinding(format!(
            "no binding of the issuer {} takes this token's claims",
            issuer.issuer
        ))
    })
}
