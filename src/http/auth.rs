//! The bearer-token guard in front of every operation.

use std::sync::Arc;
use std::time::SystemTime;

use axum::extract::{MatchedPath, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::admission::Sharer;
use super::context::AppContext;
use super::error::{ApiError, ProblemType, problem};
use super::extract::path_id;
use super::server::TlsSession;
use crate::auth::jwt::{Refusal, looks_like_jwt};
use crate::auth::{Actor, Identified, Role};
use crate::domain::{Scope, StateId};
use crate::telemetry::ClientText;

/// Who may call an operation.
#[derive(Clone, Copy, Debug)]
pub enum Access {
    /// Health checks: orchestrators probe them without credentials.
    Open,
    /// Read-protected when the gateway is told to protect metrics.
    Metrics,
    Needs(Role),
}

fn unauthorized(detail: &str) -> Response {
    let mut response = problem(ProblemType::Unauthorized, detail);
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"statehouse\""),
    );
    response
}

/// Lets the request through if it carries a token with the role it needs
/// and, when the route names a `{state_id}`, whose scope covers it; with no
/// tokens configured, everything goes through. Two `Authorization` headers
/// are refused on every operation that takes a token, configured or not, so
/// that a client learns of them before it meets a gateway with tokens.
///
/// The path's state_id is checked here, for every route at once, so that no
/// route can forget it; what a request names in its body or query is the
/// handler's to keep within the [`Scope`] this leaves in the extensions.
pub async fn guard(
    State((ctx, access)): State<(AppContext, Access)>,
    request: Request,
    next: Next,
) -> Response {
    if ctx.client_certificates_required
        && !matches!(access, Access::Open)
        && !request
            .extensions()
            .get::<TlsSession>()
            .is_some_and(|session| session.client_certificate)
    {
        return problem(
            ProblemType::Forbidden,
            "this gateway requires a client certificate (mTLS) for everything but /healthz, /readyz and the dashboard page: present one signed by its --tls-client-ca-file CA",
        );
    }
    let tokens = ctx.tokens.current();
    let (mut parts, body) = request.into_parts();
    // Whose share of the limits the request takes, if admitted (see
    // `admission`): a token's own, once it is known to be valid.
    let required = ctx.tokens.required();
    parts.extensions.insert(if !required {
        Sharer::Everyone
    } else {
        Sharer::Token(Arc::from("anonymous"))
    });
    let needed = match access {
        Access::Open => None,
        Access::Metrics => ctx.protect_metrics.then_some(Role::Read),
        Access::Needs(role) => Some(role),
    };
    let Some(needed) = needed else {
        return next.run(Request::from_parts(parts, body)).await;
    };
    let mut values = parts.headers.get_all(header::AUTHORIZATION).iter();
    let (first, second) = (values.next(), values.next());
    let presented = first.and_then(bearer_token).map(str::to_owned);
    if second.is_some() {
        // Which one counts would be a guess; proxies and servers differ on it.
        return problem(
            ProblemType::InvalidHeader,
            "send one Authorization header, not several",
        );
    }
    if !required {
        parts.extensions.insert(Actor::anonymous());
        parts.extensions.insert(Scope::everything());
        // Without tokens, everyone may do everything.
        parts.extensions.insert(Role::Admin);
        return next.run(Request::from_parts(parts, body)).await;
    }
    let state_id = path_id(&mut parts).await;
    let denial = Denial {
        ctx: &ctx,
        parts: &parts,
        state_id: state_id.as_ref().map(StateId::as_str),
    };
    let Some(presented) = presented else {
        denial.record(DenialReason::Unknown, "-");
        return unauthorized("send Authorization: Bearer <token>");
    };
    let grant = match tokens.identify(&presented, SystemTime::now()) {
        Identified::Unknown => match ctx.tokens.jwt() {
            Some(jwt) if looks_like_jwt(&presented) => match jwt.identify(&presented).await {
                Ok(grant) => grant,
                Err(refusal) => return refused(&denial, refusal),
            },
            _ => {
                denial.record(DenialReason::Unknown, "-");
                return unauthorized("the bearer token is not one this gateway knows");
            }
        },
        Identified::Expired(actor) => {
            denial.record(DenialReason::Expired, &actor.0);
            return unauthorized(
                "the bearer token has expired (the expires= of its entry has passed); ask for a new one",
            );
        }
        Identified::Valid(grant) => grant,
    };
    if grant.role < needed {
        denial.record(DenialReason::Role, &grant.actor.0);
        return problem(
            ProblemType::Forbidden,
            &format!(
                "this needs {} token; yours is {} token",
                needed.with_article(),
                grant.role.with_article()
            ),
        );
    }
    if let Some(id) = &state_id
        && !grant.scope.allows(id)
    {
        denial.record(DenialReason::Scope, &grant.actor.0);
        return ApiError::OutOfScope(grant.scope.to_string()).into_response();
    }
    parts
        .extensions
        .insert(Sharer::Token(Arc::from(grant.actor.0.as_str())));
    parts.extensions.insert(grant.actor);
    parts.extensions.insert(grant.scope);
    parts.extensions.insert(grant.role);
    next.run(Request::from_parts(parts, body)).await
}

/// The answer to a JWT that was not let in, counted and logged by reason.
/// An issuer whose keys never came is no denial: the token may be good.
fn refused(denial: &Denial<'_>, refusal: Refusal) -> Response {
    let (reason, error) = match refusal {
        Refusal::Expired => (DenialReason::Expired, ApiError::TokenExpired),
        Refusal::Invalid(why) => (DenialReason::Invalid, ApiError::TokenInvalid(why)),
        Refusal::WrongAudience(why) => (DenialReason::Audience, ApiError::WrongAudience(why)),
        Refusal::UnknownIssuer => (DenialReason::Issuer, ApiError::UnknownIssuer),
        Refusal::NoBinding(why) => (DenialReason::Binding, ApiError::NoBinding(why)),
        Refusal::KeysUnavailable(wait) => {
            return ApiError::IssuerUnavailable(wait).into_response();
        }
    };
    denial.record(reason, "-");
    error.into_response()
}

/// Why a token was refused, as `statehouse_auth_denied_total{reason}` counts it.
#[derive(Clone, Copy, Debug)]
pub enum DenialReason {
    /// No token, or not one of ours.
    Unknown,
    Expired,
    /// The token's role is too weak for the operation.
    Role,
    /// A state_id outside the token's scope.
    Scope,
    /// A JWT that does not verify.
    Invalid,
    /// A JWT without this gateway's audience.
    Audience,
    /// A JWT of an issuer not configured.
    Issuer,
    /// A valid JWT that no binding takes.
    Binding,
}

impl DenialReason {
    fn label(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::Expired => "expired",
            Self::Role => "role",
            Self::Scope => "scope",
            Self::Invalid => "invalid",
            Self::Audience => "audience",
            Self::Issuer => "issuer",
            Self::Binding => "binding",
        }
    }
}

/// A refused request, to count and log: by its token's name, never the token.
pub struct Denial<'a> {
    pub ctx: &'a AppContext,
    pub parts: &'a Parts,
    pub state_id: Option<&'a str>,
}

impl Denial<'_> {
    pub fn record(&self, reason: DenialReason, token_name: &str) {
        self.ctx.metrics.auth_denied(reason.label());
        let route = self
            .parts
            .extensions
            .get::<MatchedPath>()
            .map_or("unmatched", MatchedPath::as_str);
        tracing::warn!(
            reason = reason.label(),
            token = %ClientText(token_name),
            method = %self.parts.method,
            route,
            state_id = %ClientText(self.state_id.unwrap_or("-")),
            "request denied"
        );
    }
}

/// The bearer token a request presents, if one (and only one) is.
pub fn presented_token(headers: &axum::http::HeaderMap) -> Option<String> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    match (values.next(), values.next()) {
        (Some(value), None) => bearer_token(value).map(str::to_owned),
        _ => None,
    }
}

/// The token of `Bearer <token>`. RFC 9110 (11.1, 11.4): the scheme is
/// case-insensitive, and one or more spaces or tabs separate it from the token.
fn bearer_token(value: &HeaderValue) -> Option<&str> {
    let value = value.to_str().ok()?;
    let (scheme, rest) = value.split_once([' ', '\t'])?;
    let token = rest.trim_matches([' ', '\t']);
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(value: &str) -> Option<String> {
        bearer_token(&HeaderValue::from_str(value).unwrap()).map(str::to_owned)
    }

    #[test]
    fn the_scheme_is_case_insensitive_and_any_blanks_may_precede_the_token() {
        for value in [
            "Bearer tok",
            "bearer tok",
            "BEARER tok",
            "bEaReR tok",
            "Bearer   tok",
            "Bearer\ttok",
            "Bearer \t tok",
            "Bearer tok ",
        ] {
            assert_eq!(token(value).as_deref(), Some("tok"), "{value:?}");
        }
    }

    #[test]
    fn other_schemes_and_empty_tokens_are_no_token() {
        for value in [
            "Basic dG9rOg==",
            "Bearertok",
            "Bearer",
            "Bearer ",
            "Bear tok",
            "tok",
            "",
        ] {
            assert_eq!(token(value), None, "{value:?}");
        }
    }
}
