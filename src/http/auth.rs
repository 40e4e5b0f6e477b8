//! The bearer-token guard in front of every operation.

use std::time::SystemTime;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::Response;

use super::error::{ProblemType, problem};
use super::server::TlsSession;
use crate::AppContext;
use crate::auth::{Actor, Identified, Role};

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

/// Lets the request through if it carries a token with the role it needs;
/// with no tokens configured, everything goes through. Two `Authorization`
/// headers are refused on every operation that takes a token, configured or
/// not, so that a client learns of them before it meets a gateway with tokens.
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
    let needed = match access {
        Access::Open => None,
        Access::Metrics => ctx.protect_metrics.then_some(Role::Read),
        Access::Needs(role) => Some(role),
    };
    let Some(needed) = needed else {
        return next.run(request).await;
    };
    let mut request = request;
    let mut values = request.headers().get_all(header::AUTHORIZATION).iter();
    let (first, second) = (values.next(), values.next());
    if second.is_some() {
        // Which one counts would be a guess; proxies and servers differ on it.
        return problem(
            ProblemType::InvalidHeader,
            "send one Authorization header, not several",
        );
    }
    if ctx.tokens.is_empty() {
        request.extensions_mut().insert(Actor::anonymous());
        return next.run(request).await;
    }
    let Some(presented) = first.and_then(bearer_token) else {
        return unauthorized("send Authorization: Bearer <token>");
    };
    match ctx.tokens.identify(presented, SystemTime::now()) {
        Identified::Unknown => unauthorized("the bearer token is not one this gateway knows"),
        Identified::Expired(_) => unauthorized(
            "the bearer token has expired (its expires= has passed); ask for a new one",
        ),
        Identified::Valid(grant) if grant.role < needed => problem(
            ProblemType::Forbidden,
            &format!(
                "this needs a {} token; yours is {}",
                needed.as_str(),
                grant.role.as_str()
            ),
        ),
        Identified::Valid(grant) => {
            request.extensions_mut().insert(grant.actor);
            next.run(request).await
        }
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
