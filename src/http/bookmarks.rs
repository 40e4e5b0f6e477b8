//! `/v1/bookmarks`: one row per (state_id, stream) of the effective state, the
//! flat shape dashboards (Grafana's Infinity data source, the page at `/`)
//! read without walking documents.

use std::collections::HashSet;

use axum::Json;
use axum::extract::{Extension, State};
use serde::{Deserialize, Serialize};

use super::context::AppContext;
use super::error::ApiError;
use super::extract::{ApiQuery, page_limit};
use super::states::{page_cursor, parse_at, parse_pattern};
use super::wire::rfc3339_millis;
use crate::domain::{self, AsOf, PageCursor, Scope, Version};
use crate::store::StoredState;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BookmarkParams {
    pattern: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
    /// The bookmarks as they stood at this instant (from history).
    at: Option<String>,
}

#[derive(Serialize)]
struct BookmarkRow {
    state_id: String,
    /// Null for a state without `singer_state.bookmarks`.
    stream: Option<String>,
    replication_key: Option<domain::Json>,
    replication_key_value: Option<domain::Json>,
    /// The stream's bookmark object as it is.
    bookmark: Option<domain::Json>,
    /// The stream's newest change moved it backwards.
    last_change_regressed: bool,
    updated_at: String,
    age_seconds: f64,
}

#[derive(Serialize)]
struct BookmarkListing {
    bookmarks: Vec<BookmarkRow>,
    next_cursor: Option<String>,
}

/// `limit` counts states, as in `/v1/states`; each gives one row per stream.
pub async fn list(
    State(ctx): State<AppContext>,
    Extension(scope): Extension<Scope>,
    ApiQuery(params): ApiQuery<BookmarkParams>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let pattern = parse_pattern(params.pattern)?;
    let limit = page_limit(params.limit)?;
    let cursor = page_cursor(params.cursor, &pattern)?;
    let at = parse_at(params.at)?;
    let (states, has_more) = ctx
        .states
        .list_documents_as_of(&pattern, &scope, cursor.as_ref(), limit, at)
        .await?;
    let next_cursor = has_more
        .then(|| states.last())
        .flatten()
        .map(|last| PageCursor::after(last.id.clone()).encode(&pattern));
    let current: Vec<_> = states
        .iter()
        .map(|s| (&s.id, Version::from_millis(s.updated_at_ms)))
        .collect();
    let regressed: HashSet<(String, String)> = ctx
        .states
        .last_changes_regressed(&current)
        .await?
        .into_iter()
        .filter(|change| change.regressed)
        .map(|change| (change.state_id, change.stream))
        .collect();
    // Ages as of the instant asked about.
    let now_ms = at.map_or_else(crate::store::now_ms, AsOf::millis);
    let bookmarks = states
        .iter()
        .flat_map(|state| rows_of(state, &regressed, now_ms))
        .collect();
    let listing = BookmarkListing {
        bookmarks,
        next_cursor,
    };
    Ok(Json(
        serde_json::to_value(listing).expect("a listing always serializes"),
    ))
}

fn rows_of(
    state: &StoredState,
    regressed: &HashSet<(String, String)>,
    now_ms: i64,
) -> Vec<BookmarkRow> {
    let row = |stream: Option<&str>, bookmark: Option<&domain::Json>| {
        let field = |name: &str| bookmark.and_then(|b| b.member(name)).cloned();
        BookmarkRow {
            state_id: state.id.as_str().to_owned(),
            stream: stream.map(str::to_owned),
            replication_key: field("replication_key"),
            replication_key_value: field("replication_key_value"),
            bookmark: bookmark.cloned(),
            last_change_regressed: stream.is_some_and(|stream| {
                regressed.contains(&(state.id.as_str().to_owned(), stream.to_owned()))
            }),
            updated_at: rfc3339_millis(state.updated_at_ms),
            age_seconds: (now_ms - state.updated_at_ms).max(0) as f64 / 1000.0,
        }
    };
    match state.doc.bookmarks() {
        Some(streams) if !streams.is_empty() => streams
            .iter()
            .map(|(stream, bookmark)| row(Some(stream), Some(bookmark)))
            .collect(),
        _ => vec![row(None, None)],
    }
}
