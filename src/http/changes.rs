//! `GET /v1/changes?pattern=GLOB&since=C&wait=D&limit=N`: the change feed.
//!
//! A follower holds no `--max-concurrent-requests` permit while it waits
//! (with `wait`, the admission counts it against `--max-watchers`), and
//! answers at once when the gateway stops. With `Accept:
//! text/event-stream` it is a stream (`changes_stream`). The rules of what
//! it is delivered are in `states::feed`.

use axum::Json;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::admission::accepts_event_stream;
use super::auth::presented_token;
use super::changes_stream::{self, ChangeOut, Credentials};
use super::context::AppContext;
use super::error::ApiError;
use super::extract::{ApiQuery, page_limit};
use super::states::parse_pattern;
use crate::domain::{Scope, StatePattern, Wait};
use crate::states::{Delivery, FeedCursor, Follow};
use crate::store::now_ms;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChangesParams {
    /// The glob; every id when absent.
    pattern: Option<String>,
    /// The cursor to follow from; none for a first call.
    since: Option<String>,
    /// How long to wait for a change; 0 when absent.
    wait: Option<String>,
    /// The most ids one answer delivers.
    limit: Option<String>,
}

#[derive(Serialize)]
struct ChangeList {
    changes: Vec<ChangeOut>,
    /// Where to follow on from.
    cursor: String,
}

pub async fn list(
    State(ctx): State<AppContext>,
    Extension(scope): Extension<Scope>,
    ApiQuery(params): ApiQuery<ChangesParams>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let streams = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .any(accepts_event_stream);
    // A stream resumes after the last event it had, whatever its URL says.
    let last_event = headers
        .get("last-event-id")
        .filter(|_| streams)
        .map(|value| {
            value.to_str().map(str::to_owned).map_err(|_| {
                ApiError::InvalidHeader(
                    "Last-Event-ID is not a cursor this service handed out".to_owned(),
                )
            })
        })
        .transpose()?;
    let follow = follow(&ctx, scope.clone(), params, last_event)?;
    let feed = ctx.states.feed();
    if streams {
        let credentials = Credentials {
            tokens: ctx.tokens.clone(),
            presented: presented_token(&headers),
            scope,
        };
        return changes_stream::stream(feed, follow, credentials).await;
    }
    let delivery = feed.changes(&follow).await?;
    Ok(Json(listing(delivery, &follow.pattern)).into_response())
}

/// What the query asks, checked: a bad parameter, or a cursor of another
/// pattern or made up, is 400; a cursor past the retention is 410.
fn follow(
    ctx: &AppContext,
    scope: Scope,
    params: ChangesParams,
    last_event: Option<String>,
) -> Result<Follow, ApiError> {
    let pattern = parse_pattern(params.pattern)?;
    let limit = page_limit(params.limit)?;
    let wait = match params.wait {
        Some(raw) => Wait::parse(&raw).map_err(|e| ApiError::InvalidQuery(e.to_string()))?,
        None => Wait::parse("0").expect("0 is a wait"),
    };
    let since = last_event
        .or(params.since)
        .map(|raw| {
            FeedCursor::decode(&raw, &pattern).map_err(|e| ApiError::InvalidQuery(e.to_string()))
        })
        .transpose()?;
    if let Some(cursor) = &since {
        let retention = ctx.states.feed().retention();
        let age_ms = now_ms() - cursor.read_at_us / 1000;
        if age_ms > i64::try_from(retention.as_millis()).unwrap_or(i64::MAX) {
            return Err(ApiError::CursorExpired(format!(
                "this cursor is {:.1}s old, older than the {} the gateway keeps changes for (--watch-retention); list the states again and follow from a new cursor",
                age_ms as f64 / 1000.0,
                humantime::format_duration(retention)
            )));
        }
    }
    Ok(Follow {
        pattern,
        scope,
        since,
        limit: limit.get() as usize,
        deadline: Instant::now() + wait.jittered(),
    })
}

fn listing(delivery: Delivery, pattern: &StatePattern) -> ChangeList {
    ChangeList {
        cursor: delivery.cursor.encode(pattern),
        changes: delivery.changes.into_iter().map(ChangeOut::from).collect(),
    }
}
