//! How a state is answered: its document with its ETag, or 304 when the
//! client's copy is current. Shared by plain reads, long-polls and writes.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use super::wire::rfc3339_millis;
use crate::domain::{ETag, JsonObject};
use crate::store::StoredState;

#[derive(Serialize)]
struct StateRepresentation<'a> {
    state_id: &'a str,
    completed: &'a JsonObject,
    partial: &'a JsonObject,
    updated_at: String,
}

/// The state's document, with its ETag.
pub(super) fn representation(state: &StoredState, status: StatusCode) -> Response {
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

/// 304, naming the current version.
pub(super) fn not_modified(etag: &ETag) -> Response {
    let mut response = StatusCode::NOT_MODIFIED.into_response();
    if let Ok(value) = HeaderValue::from_str(etag.as_str()) {
        response.headers_mut().insert(header::ETAG, value);
    }
    response
}
