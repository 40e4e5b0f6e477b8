//! `/v1/internal/tickets`: the authority's admission of writes another
//! gateway sends (a bulk import's entries; see `locks::ticket`). Gateways
//! call these on each other, with the importing client's credentials.

use axum::Json;
use axum::extract::{Extension, Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use uuid::Uuid;

use super::context::AppContext;
use super::error::ApiError;
use super::extract::{ApiQuery, read_request};
use super::states::keep_in_scope;
use crate::domain::{Provenance, Scope, StateId};
use crate::locks::TicketRequest;

/// `POST /v1/internal/tickets`: 201 with the ticket, or the problem of the
/// first write refused, naming its entry.
pub async fn issue(
    State(ctx): State<AppContext>,
    Extension(scope): Extension<Scope>,
    provenance: Provenance,
    request: Request,
) -> Result<Response, ApiError> {
    let (parts, bytes) = read_request(request, &ctx).await?;
    let asked: TicketRequest = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::InvalidBody(format!("not a ticket request: {e}")))?;
    let mut writes = Vec::with_capacity(asked.writes.len());
    for (index, write) in asked.writes.into_iter().enumerate() {
        let state_id = write.state_id.clone();
        let in_batch = |inner: ApiError| ApiError::InBatch {
            index,
            state_id: state_id.clone(),
            inner: Box::new(inner),
        };
        let id = StateId::parse(write.state_id).map_err(|e| in_batch(e.into()))?;
        // The same token's scope as at the gateway the import reached: a
        // request to this route directly gets no further than through it.
        keep_in_scope(&ctx, &parts, &scope, &provenance.actor, &id).map_err(in_batch)?;
        writes.push((id, write.lease_id));
    }
    let grant = ctx.states.issue_ticket(&writes)?;
    Ok((StatusCode::CREATED, Json(grant)).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettleParams {
    outcome: Option<String>,
}

/// `DELETE /v1/internal/tickets/{ticket}?outcome=known|unknown`: 204, also
/// for a ticket already settled or dropped at the end of its budget.
pub async fn settle(
    State(ctx): State<AppContext>,
    Path(raw): Path<String>,
    ApiQuery(params): ApiQuery<SettleParams>,
) -> Result<StatusCode, ApiError> {
    let ticket = Uuid::parse_str(&raw)
        .map_err(|_| ApiError::InvalidQuery(format!("ticket {raw:?} is not a UUID")))?;
    let known = match params.outcome.as_deref() {
        None | Some("known") => true,
        Some("unknown") => false,
        Some(other) => {
            return Err(ApiError::InvalidQuery(format!(
                "outcome {other:?} is neither known nor unknown"
            )));
        }
    };
    ctx.states.settle_ticket(ticket, known);
    Ok(StatusCode::NO_CONTENT)
}
