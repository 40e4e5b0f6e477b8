//! `/v1/states`: Meltano state documents over REST.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::error::ApiError;
use super::extract::{ApiQuery, StateBody, StatePath, page_limit};
use super::rfc3339_millis;
use crate::AppContext;
use crate::domain::{IfNoneMatch, JsonObject, PageCursor, Provenance, StateIdError, StatePattern};
use crate::locks::FORWARDED_BY;
use crate::states::{Change, WriteConditions, Written};
use crate::store::StoredState;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListParams {
    pattern: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteManyParams {
    pattern: Option<String>,
}

#[derive(Serialize)]
struct StateListing {
    states: Vec<ListedState>,
    next_cursor: Option<String>,
}

#[derive(Serialize)]
struct ListedState {
    state_id: String,
    updated_at: String,
}

#[derive(Serialize)]
struct StateRepresentation<'a> {
    state_id: &'a str,
    completed: &'a JsonObject,
    partial: &'a JsonObject,
    updated_at: String,
}

fn representation(state: &StoredState, status: StatusCode) -> Response {
    let body = StateRepresentation {
        state_id: state.id.as_str(),
        completed: &state.doc.completed,
        partial: &state.doc.partial,
        updated_at: rfc3339_millis(state.updated_at_ms),
    };
    let mut response = (status, Json(body)).into_response();
    if let Ok(etag) = HeaderValue::from_str(state.etag.as_str()) {
        response.headers_mut().insert(header::ETAG, etag);
    }
    response
}

pub(super) fn parse_pattern(raw: Option<String>) -> Result<StatePattern, ApiError> {
    StatePattern::parse(raw.unwrap_or_else(|| "*".to_owned()))
        .map_err(|e| ApiError::InvalidQuery(e.to_string()))
}

/// A listing's `cursor`, bound to its `pattern`.
pub(super) fn page_cursor(
    raw: Option<String>,
    pattern: &StatePattern,
) -> Result<Option<PageCursor>, ApiError> {
    raw.map(|raw| {
        PageCursor::decode(&raw, pattern).map_err(|e| ApiError::InvalidQuery(e.to_string()))
    })
    .transpose()
}

pub async fn list(
    State(ctx): State<AppContext>,
    ApiQuery(params): ApiQuery<ListParams>,
) -> Result<Json<Value>, ApiError> {
    let pattern = parse_pattern(params.pattern)?;
    let limit = page_limit(params.limit)?;
    let cursor = page_cursor(params.cursor, &pattern)?;
    let (summaries, has_more) = ctx.states.list(&pattern, cursor.as_ref(), limit).await?;
    let next_cursor = has_more
        .then(|| {
            summaries
                .last()
                .map(|last| PageCursor::after(last.id.clone()).encode(&pattern))
        })
        .flatten();
    let listing = StateListing {
        states: summaries
            .into_iter()
            .map(|s| ListedState {
                updated_at: rfc3339_millis(s.updated_at_ms),
                state_id: s.id.as_str().to_owned(),
            })
            .collect(),
        next_cursor,
    };
    Ok(Json(
        serde_json::to_value(listing).expect("a listing always serializes"),
    ))
}

pub async fn delete_many(
    State(ctx): State<AppContext>,
    ApiQuery(params): ApiQuery<DeleteManyParams>,
    provenance: Provenance,
    request: Request,
) -> Result<Json<Value>, ApiError> {
    // Clearing everything must be asked for (pattern=*), never the result of a missing parameter.
    let Some(raw) = params.pattern else {
        return Err(ApiError::InvalidQuery(
            "pattern is required; use pattern=* to delete every state".into(),
        ));
    };
    let pattern = parse_pattern(Some(raw))?;
    let deleted = ctx.states.delete_matching(&pattern, &provenance).await?;
    // Gateways that are authorities for some matches keep their state in
    // memory: each deletes and forgets them too before this answers.
    let (parts, _) = request.into_parts();
    if !parts.headers.contains_key(FORWARDED_BY) {
        ctx.locks.tell_peers(&parts, &Bytes::new()).await?;
    }
    tracing::warn!(%pattern, deleted, "deleted states by pattern");
    Ok(Json(serde_json::json!({ "deleted": deleted })))
}

pub async fn get(
    State(ctx): State<AppContext>,
    StatePath(id): StatePath,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let state = ctx
        .states
        .get(&id)
        .await?
        .ok_or_else(|| ApiError::StateNotFound(id.as_str().to_owned()))?;
    let unchanged = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| IfNoneMatch::new(v).unchanged(&state.etag));
    if unchanged {
        let mut response = StatusCode::NOT_MODIFIED.into_response();
        if let Ok(value) = HeaderValue::from_str(state.etag.as_str()) {
            response.headers_mut().insert(header::ETAG, value);
        }
        return Ok(response);
    }
    Ok(representation(&state, StatusCode::OK))
}

pub async fn put(
    State(ctx): State<AppContext>,
    StatePath(id): StatePath,
    conditions: WriteConditions,
    provenance: Provenance,
    StateBody(doc): StateBody,
) -> Result<Response, ApiError> {
    let written = ctx
        .states
        .write(&id, Change::Replace(doc), &conditions, &provenance)
        .await?;
    Ok(written_response(&written))
}

pub async fn patch(
    State(ctx): State<AppContext>,
    StatePath(id): StatePath,
    conditions: WriteConditions,
    provenance: Provenance,
    StateBody(doc): StateBody,
) -> Result<Response, ApiError> {
    let written = ctx
        .states
        .write(&id, Change::Update(doc), &conditions, &provenance)
        .await?;
    Ok(written_response(&written))
}

/// 201 with the new state when it was created, 200 when it was replaced.
pub(super) fn written_response(written: &Written) -> Response {
    let status = if written.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    representation(&written.state, status)
}

pub async fn delete(
    State(ctx): State<AppContext>,
    StatePath(id): StatePath,
    conditions: WriteConditions,
    provenance: Provenance,
) -> Result<StatusCode, ApiError> {
    ctx.states.delete(&id, &conditions, &provenance).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `/v1/states/` names the empty id, which cannot exist: say so instead of 404.
pub async fn empty_id() -> ApiError {
    ApiError::InvalidStateId(StateIdError::Empty)
}
