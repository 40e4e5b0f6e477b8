//! `GET /v1/whoami`: what the caller's token lets it do, so that a client
//! (the dashboard) can say why a button is off before the gateway refuses it.

use axum::Json;
use axum::extract::{Extension, State};
use serde::Serialize;

use super::context::AppContext;
use crate::auth::{Actor, Role};
use crate::domain::Scope;

#[derive(Serialize)]
struct Caller {
    /// The gateway asks for tokens; without them everyone is an admin.
    tokens: bool,
    role: &'static str,
    /// The token's name (the actor its changes are recorded under).
    name: Option<String>,
    /// The globs of state_ids the token reaches; null for every id.
    scope: Option<Vec<String>>,
}

pub async fn whoami(
    State(ctx): State<AppContext>,
    Extension(role): Extension<Role>,
    Extension(actor): Extension<Actor>,
    Extension(scope): Extension<Scope>,
) -> Json<serde_json::Value> {
    let tokens = ctx.tokens.required();
    let caller = Caller {
        tokens,
        role: role.as_str(),
        name: tokens.then_some(actor.0),
        scope: scope.globs(),
    };
    Json(serde_json::to_value(caller).expect("a caller always serializes"))
}
