//! The bearer-token guard in front of every operation.

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;

use super::error::{ProblemType, problem};
use crate::AppContext;
use crate::auth::Role;

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
    let mut response = problem(StatusCode::UNAUTHORIZED, ProblemType::Unauthorized, detail);
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"statehouse\""),
    );
    response
}

/// Lets the request through if it carries a token with the role it needs;
/// with no tokens configured, everything goes through.
pub async fn guard(
    State((ctx, access)): State<(AppContext, Access)>,
    request: Request,
    next: Next,
) -> Response {
    let needed = match access {
        Access::Open => None,
        Access::Metrics => ctx.protect_metrics.then_some(Role::Read),
        Access::Needs(role) => Some(role),
    };
    let Some(needed) = needed.filter(|_| !ctx.tokens.is_empty()) else {
        return next.run(request).await;
    };
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim);
    let Some(presented) = presented else {
        return unauthorized("send Authorization: Bearer <token>");
    };
    match ctx.tokens.role_of(presented) {
        None => unauthorized("the bearer token is not one this gateway knows"),
        Some(role) if role < needed => problem(
            StatusCode::FORBIDDEN,
            ProblemType::Forbidden,
            &format!(
                "this needs a {} token; yours is {}",
                needed.as_str(),
                role.as_str()
            ),
        ),
        Some(_) => next.run(request).await,
    }
}
