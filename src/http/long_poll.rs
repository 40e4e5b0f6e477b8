//! `GET /v1/states/{state_id}?wait=D`: a read that waits for a change.
//!
//! The waiter registers before it reads, so a change between its read and
//! its wait still wakes it (see `states::watch`). Every wake is only a
//! hint: it reads the state again and answers only when what the client
//! asked about moved. It holds no `--max-concurrent-requests` permit (the
//! admission counts it against `--max-watchers` instead), and answers at
//! once when the gateway stops, with what it knows then.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use tokio::time::{Instant, timeout_at};

use super::context::AppContext;
use super::error::ApiError;
use super::state_answer::{not_modified, representation};
use crate::domain::{IfNoneMatch, StateId, Wait};
use crate::states::WaitEnd;
use crate::store::StoredState;

/// What the client's copy is measured against.
enum Decision {
    /// Answer now with this.
    Answer(Response),
    /// Nothing moved yet; at the end, answer with this.
    Wait(Response),
}

/// With `If-None-Match`: at once when the tag is no longer current (200, or
/// 404 when the state is gone); else on a change, or 304 at the deadline.
/// Without: at once when the state exists; else when it is created, or 404
/// at the deadline.
pub(super) async fn answer(
    ctx: &AppContext,
    id: &StateId,
    if_none_match: Option<&IfNoneMatch>,
    wait: Wait,
) -> Result<Response, ApiError> {
    let deadline = Instant::now() + wait.jittered();
    let mut watching = ctx.states.watches().watch(id);
    loop {
        let state = ctx.states.get(id).await?;
        watching.read(state.as_ref().map(|s| s.updated_at_ms));
        let at_end = match decide(id, state.as_ref(), if_none_match) {
            Decision::Answer(response) => return Ok(response),
            Decision::Wait(at_end) => at_end,
        };
        if watching.closing() {
            return Ok(at_end);
        }
        match timeout_at(deadline, watching.next()).await {
            Ok(WaitEnd::Changed) => continue,
            Ok(WaitEnd::Closing) | Err(_) => return Ok(at_end),
        }
    }
}

fn decide(
    id: &StateId,
    state: Option<&StoredState>,
    if_none_match: Option<&IfNoneMatch>,
) -> Decision {
    let missing = || ApiError::StateNotFound(id.as_str().to_owned()).into_response();
    match (if_none_match, state) {
        (Some(_), None) => Decision::Answer(missing()),
        (Some(tags), Some(state)) if tags.unchanged(&state.etag) => {
            Decision::Wait(not_modified(&state.etag))
        }
        (_, Some(state)) => Decision::Answer(representation(state, StatusCode::OK)),
        (None, None) => Decision::Wait(missing()),
    }
}
