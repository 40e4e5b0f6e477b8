//! `/v1/states/{state_id}/history` and `/rollback`: the versions a state went
//! through, and a way back to any of them.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use indexmap::IndexMap;
use serde::{Deserialize, Serialize};

use super::context::AppContext;
use super::error::ApiError;
use super::extract::{ApiQuery, OptionalJson, StatePath, page_limit};
use super::states::written_response;
use crate::domain::{
    self, JsonObject, PartitionValue, Provenance, StateDocument, StateId, Version, VersionCursor,
};
use crate::states::WriteConditions;
use crate::store::VersionMeta;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HistoryParams {
    limit: Option<String>,
    cursor: Option<String>,
    /// `true`: each version shows its streams' bookmark values.
    bookmarks: Option<String>,
}

#[derive(Serialize)]
struct VersionView<'a> {
    version: String,
    operation: &'a str,
    deleted: bool,
    /// The version the state is at now.
    current: bool,
    changed_streams: &'a [String],
    regressed_streams: &'a [String],
    /// Streams whose bookmark the version dropped (see `--bookmark-loss`).
    lost_streams: &'a [String],
    actor: &'a str,
    lease_owner: Option<&'a str>,
    fencing_token: Option<u64>,
    request_id: &'a str,
    user_agent: &'a str,
    /// The version a restore brought back.
    restored_from: Option<String>,
    reason: &'a str,
    /// With `bookmarks=true`: each stream's `replication_key_value` in the
    /// version's effective state (null when it has none; `{}` for a
    /// tombstone), for charts and diffs.
    #[serde(skip_serializing_if = "Option::is_none")]
    bookmarks: Option<IndexMap<&'a str, Option<&'a domain::Json>>>,
    /// With `bookmarks=true`: each partitioned stream's partitions, each
    /// with its `context` and `replication_key_value`, as the bookmark
    /// guard pairs them (a partitioned stream's value in `bookmarks` is
    /// null: Meltano keeps its values in the partitions).
    #[serde(skip_serializing_if = "Option::is_none")]
    partitions: Option<IndexMap<&'a str, Vec<PartitionValue>>>,
}

impl<'a> VersionView<'a> {
    fn of(meta: &'a VersionMeta, current: bool) -> Self {
        Self {
            version: meta.version.to_rfc3339(),
            operation: &meta.operation,
            deleted: meta.deleted,
            current,
            changed_streams: &meta.changed_streams,
            regressed_streams: &meta.regressed_streams,
            lost_streams: &meta.lost_streams,
            actor: &meta.actor,
            lease_owner: meta.lease_owner.as_deref(),
            fencing_token: meta.fencing_token,
            request_id: &meta.request_id,
            user_agent: &meta.user_agent,
            restored_from: meta.restored_from.map(|v| v.to_rfc3339()),
            reason: &meta.reason,
            bookmarks: None,
            partitions: None,
        }
    }
}

/// Each stream's `replication_key_value` of `bookmarks` (a version's
/// effective `singer_state.bookmarks`), null where it has none.
fn bookmark_values(bookmarks: Option<&JsonObject>) -> IndexMap<&str, Option<&domain::Json>> {
    bookmarks
        .iter()
        .flat_map(|streams| streams.iter())
        .map(|(stream, bookmark)| (stream, bookmark.member("replication_key_value")))
        .collect()
}

/// Each partitioned stream's partitions in `bookmarks` (a version's
/// effective `singer_state.bookmarks`).
fn partition_values_of(bookmarks: Option<&JsonObject>) -> IndexMap<&str, Vec<PartitionValue>> {
    bookmarks
        .iter()
        .flat_map(|streams| streams.iter())
        .filter_map(|(stream, bookmark)| Some((stream, domain::partition_values(bookmark)?)))
        .collect()
}

/// `true` or `false`; anything else is a 400.
fn parse_flag(name: &str, raw: Option<&str>) -> Result<bool, ApiError> {
    match raw {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(other) => Err(ApiError::InvalidQuery(format!(
            "{name} is true or false, not {other:?}"
        ))),
    }
}

#[derive(Serialize)]
struct HistoryListing<'a> {
    state_id: &'a str,
    versions: Vec<VersionView<'a>>,
    next_cursor: Option<String>,
}

#[derive(Serialize)]
struct OneVersion<'a> {
    state_id: &'a str,
    #[serde(flatten)]
    meta: VersionView<'a>,
    /// Null for a tombstone.
    completed: Option<&'a JsonObject>,
    partial: Option<&'a JsonObject>,
}

pub async fn list(
    State(ctx): State<AppContext>,
    StatePath(id): StatePath,
    ApiQuery(params): ApiQuery<HistoryParams>,
) -> Result<Response, ApiError> {
    let limit = page_limit(params.limit)?;
    let cursor = params
        .cursor
        .map(|raw| {
            VersionCursor::decode(&raw, &id).map_err(|e| ApiError::InvalidQuery(e.to_string()))
        })
        .transpose()?;
    let with_bookmarks = parse_flag("bookmarks", params.bookmarks.as_deref())?;
    let page = ctx
        .states
        .history_page(&id, cursor, limit, with_bookmarks)
        .await?;
    let next_cursor = page
        .has_more
        .then(|| page.versions.last())
        .flatten()
        .map(|last| VersionCursor(last.meta.version).encode(&id));
    let bookmarks: Vec<Option<JsonObject>> = page
        .versions
        .iter()
        .map(|v| v.doc.as_ref().and_then(StateDocument::bookmarks))
        .collect();
    let listing = HistoryListing {
        state_id: id.as_str(),
        versions: page
            .versions
            .iter()
            .zip(&bookmarks)
            .map(|(v, streams)| VersionView {
                bookmarks: with_bookmarks.then(|| bookmark_values(streams.as_ref())),
                partitions: with_bookmarks.then(|| partition_values_of(streams.as_ref())),
                ..VersionView::of(&v.meta, v.current)
            })
            .collect(),
        next_cursor,
    };
    Ok(Json(listing).into_response())
}

pub async fn get(
    State(ctx): State<AppContext>,
    Path((raw_id, raw_version)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let id = StateId::parse(raw_id)?;
    let version = parse_version(&raw_version)?;
    let Some((stored, current)) = ctx.states.version(&id, version).await? else {
        return Err(ApiError::VersionNotFound(format!(
            "state {:?} has no version {}",
            id.as_str(),
            version.to_rfc3339()
        )));
    };
    let body = OneVersion {
        state_id: id.as_str(),
        meta: VersionView::of(&stored.meta, current),
        completed: stored.doc.as_ref().map(|d| &d.completed),
        partial: stored.doc.as_ref().map(|d| &d.partial),
    };
    Ok(Json(body).into_response())
}

fn parse_version(raw: &str) -> Result<Version, ApiError> {
    Version::parse(raw).map_err(|e| ApiError::InvalidVersion(e.to_string()))
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RollbackRequest {
    version: Option<String>,
}

/// 200 or 201 with the state as it now is, or 204 when the version rolled
/// back to is a tombstone (the state is deleted).
pub async fn rollback(
    State(ctx): State<AppContext>,
    StatePath(id): StatePath,
    conditions: WriteConditions,
    provenance: Provenance,
    OptionalJson(request): OptionalJson<RollbackRequest>,
) -> Result<Response, ApiError> {
    let Some(raw) = request.version else {
        return Err(ApiError::InvalidBody(
            "the body needs the version to roll back to: {\"version\": \"<updated_at>\"}".into(),
        ));
    };
    let version = parse_version(&raw)?;
    match ctx
        .states
        .rollback(&id, version, &conditions, &provenance)
        .await?
    {
        Some(written) => Ok(written_response(&written)),
        None => Ok(StatusCode::NO_CONTENT.into_response()),
    }
}
