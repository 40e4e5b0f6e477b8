//! `/v1/states`: Meltano state documents over REST.

use axum::Json;

use axum::extract::{Extension, Path, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::auth::{Denial, DenialReason};
use super::context::AppContext;
use super::error::ApiError;
use super::extract::{ApiQuery, StateBody, StatePath, allowed_streams, page_limit, read_request};
use super::long_poll;
use super::state_answer::{not_modified, representation};
use super::wire::rfc3339_millis;
use crate::domain::{
    AsOf, DocumentError, IfNoneMatch, JsonObject, PageCursor, Provenance, Scope, StateDocument,
    StateId, StateIdError, StatePattern, Wait,
};
use crate::states::{Change, WriteConditions, Written};
use uuid::Uuid;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListParams {
    pattern: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
    /// `documents`: each state with its `completed` and `partial` (bulk export).
    include: Option<String>,
    /// The states as they stood at this instant (from history).
    at: Option<String>,
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
    state_id: StateId,
    updated_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    completed: Option<JsonObject>,
    #[serde(skip_serializing_if = "Option::is_none")]
    partial: Option<JsonObject>,
}

/// An `at=`: an RFC 3339 instant, in any offset.
pub(super) fn parse_at(raw: Option<String>) -> Result<Option<AsOf>, ApiError> {
    raw.map(|raw| AsOf::parse(&raw).map_err(|e| ApiError::InvalidQuery(e.to_string())))
        .transpose()
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
    Extension(scope): Extension<Scope>,
    ApiQuery(params): ApiQuery<ListParams>,
) -> Result<Response, ApiError> {
    let pattern = parse_pattern(params.pattern)?;
    let limit = page_limit(params.limit)?;
    let cursor = page_cursor(params.cursor, &pattern)?;
    let with_documents = match params.include.as_deref() {
        None => false,
        Some("documents") => true,
        Some(other) => {
            return Err(ApiError::InvalidQuery(format!(
                "include {other:?} is not known; the one value is documents"
            )));
        }
    };
    // Serialized straight from the documents, so every number keeps its text.
    let at = parse_at(params.at)?;
    let (states, has_more): (Vec<ListedState>, bool) = if with_documents {
        let (states, has_more) = ctx
            .states
            .list_documents_as_of(&pattern, &scope, cursor.as_ref(), limit, at)
            .await?;
        let listed = states
            .into_iter()
            .map(|s| ListedState {
                updated_at: rfc3339_millis(s.updated_at_ms),
                state_id: s.id,
                completed: Some(s.doc.completed),
                partial: Some(s.doc.partial),
            })
            .collect();
        (listed, has_more)
    } else {
        let (summaries, has_more) = ctx
            .states
            .list_as_of(&pattern, &scope, cursor.as_ref(), limit, at)
            .await?;
        let listed = summaries
            .into_iter()
            .map(|s| ListedState {
                updated_at: rfc3339_millis(s.updated_at_ms),
                state_id: s.id,
                completed: None,
                partial: None,
            })
            .collect();
        (listed, has_more)
    };
    let next_cursor = has_more
        .then(|| states.last())
        .flatten()
        .map(|last| PageCursor::after(last.state_id.clone()).encode(&pattern));
    let listing = StateListing {
        states,
        next_cursor,
    };
    Ok(Json(listing).into_response())
}

/// `POST /v1/states`: many states at once (a JSON array), written as PUTs
/// would be, or none of them.
pub async fn import(
    State(ctx): State<AppContext>,
    Extension(scope): Extension<Scope>,
    provenance: Provenance,
    request: Request,
) -> Result<Response, ApiError> {
    let (parts, bytes) = read_request(request, &ctx).await?;
    let entries = StateDocument::batch_from_request(&bytes).map_err(|err| match &err.error {
        DocumentError::InvalidJson(_) => ApiError::InvalidJson(err.to_string()),
        DocumentError::NotAState(_) => ApiError::InvalidDocument(err.to_string()),
    })?;
    let mut batch = Vec::with_capacity(entries.len());
    for (index, entry) in entries.into_iter().enumerate() {
        let in_batch = |inner: ApiError| ApiError::InBatch {
            index,
            state_id: entry.state_id.clone(),
            inner: Box::new(inner),
        };
        let id = StateId::parse(entry.state_id.clone()).map_err(|e| in_batch(e.into()))?;
        // One entry out of scope refuses them all, before anything is written.
        keep_in_scope(&ctx, &parts, &scope, &provenance.actor, &id).map_err(in_batch)?;
        let lease = entry
            .lease_id
            .as_deref()
            .map(|raw| {
                Uuid::parse_str(raw).map_err(|_| {
                    in_batch(ApiError::InvalidDocument(format!(
                        "lease_id {raw:?} is not a UUID"
                    )))
                })
            })
            .transpose()?;
        batch.push((id, entry.doc, lease));
    }
    let allowed = allowed_streams(&parts.headers)?;
    // The entries of ids another gateway is the authority for are admitted
    // by a ticket from it, asked for with this request's credentials.
    let authorization = parts.headers.get(header::AUTHORIZATION);
    let imported = ctx
        .states
        .import(batch, &allowed, &provenance, authorization)
        .await?;
    let body = serde_json::json!({"written": imported.written, "created": imported.created});
    Ok(Json(body).into_response())
}

/// An id a batch names, held to the token's scope: one outside is counted
/// and logged as a denial, and refuses the batch.
pub(super) fn keep_in_scope(
    ctx: &AppContext,
    parts: &Parts,
    scope: &Scope,
    actor: &str,
    id: &StateId,
) -> Result<(), ApiError> {
    if scope.allows(id) {
        return Ok(());
    }
    let denial = Denial {
        ctx,
        parts,
        state_id: Some(id.as_str()),
    };
    denial.record(DenialReason::Scope, actor);
    Err(ApiError::OutOfScope(scope.to_string()))
}

/// `DELETE /v1/states/{state_id}/bookmarks/{stream}`: that stream starts over.
pub async fn reset_stream(
    State(ctx): State<AppContext>,
    Path((raw_id, stream)): Path<(String, String)>,
    conditions: WriteConditions,
    provenance: Provenance,
) -> Result<Response, ApiError> {
    let id = StateId::parse(raw_id)?;
    let written = ctx
        .states
        .write(&id, Change::ResetStream(stream), &conditions, &provenance)
        .await?;
    Ok(representation(&written.state, StatusCode::OK))
}

pub async fn delete_many(
    State(ctx): State<AppContext>,
    Extension(scope): Extension<Scope>,
    ApiQuery(params): ApiQuery<DeleteManyParams>,
    provenance: Provenance,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    // Clearing everything must be asked for (pattern=*), never the result of a missing parameter.
    let Some(raw) = params.pattern else {
        return Err(ApiError::InvalidQuery(
            "pattern is required; use pattern=* to delete every state".into(),
        ));
    };
    let pattern = parse_pattern(Some(raw))?;
    // Gateways that are the authority for some matches admit those by
    // ticket, asked with this request's credentials.
    let cleared = ctx
        .states
        .delete_matching(
            &pattern,
            &scope,
            &provenance,
            headers.get(header::AUTHORIZATION),
        )
        .await?;
    tracing::warn!(
        %pattern,
        %scope,
        deleted = cleared.deleted,
        skipped_locked = cleared.skipped_locked,
        "deleted states by pattern"
    );
    let locked: Vec<&str> = cleared.locked.iter().map(StateId::as_str).collect();
    Ok(Json(serde_json::json!({
        "deleted": cleared.deleted,
        "skipped_locked": cleared.skipped_locked,
        "locked": locked,
    })))
}

/// `GET /v1/states/{state_id}`'s query: `wait` makes it a long-poll.
#[derive(Deserialize)]
pub struct GetParams {
    wait: Option<String>,
    /// The state as it stood at this instant (from history).
    at: Option<String>,
}

pub async fn get(
    State(ctx): State<AppContext>,
    StatePath(id): StatePath,
    ApiQuery(params): ApiQuery<GetParams>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let if_none_match = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .map(IfNoneMatch::new);
    let at = parse_at(params.at)?;
    // A past instant never changes: a read as of one answers at once.
    if let Some(raw) = params.wait.filter(|_| at.is_none()) {
        let wait = Wait::parse(&raw).map_err(|e| ApiError::InvalidQuery(e.to_string()))?;
        return long_poll::answer(&ctx, &id, if_none_match.as_ref(), wait).await;
    }
    let state = match at {
        Some(at) => ctx.states.get_at(&id, at).await?,
        None => ctx.states.get(&id).await?,
    }
    .ok_or_else(|| ApiError::StateNotFound(id.as_str().to_owned()))?;
    if if_none_match.is_some_and(|tags| tags.unchanged(&state.etag)) {
        return Ok(not_modified(&state.etag));
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

/// Names the streams whose bookmarks a write moved backwards (in warn mode).
const BOOKMARK_REGRESSION: HeaderName = HeaderName::from_static("statehouse-bookmark-regression");

/// Names the streams whose bookmarks a write dropped (in warn mode, or
/// allowed by the request).
const BOOKMARK_LOSS: HeaderName = HeaderName::from_static("statehouse-bookmark-loss");

/// 201 with the new state when it was created, 200 when it was replaced.
pub(super) fn written_response(written: &Written) -> Response {
    let status = if written.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let mut response = representation(&written.state, status);
    for (name, streams) in [
        (BOOKMARK_REGRESSION, &written.regressed),
        (BOOKMARK_LOSS, &written.lost),
    ] {
        if !streams.is_empty()
            && let Ok(value) = HeaderValue::from_str(&streams.join(", "))
        {
            response.headers_mut().insert(name, value);
        }
    }
    response
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
