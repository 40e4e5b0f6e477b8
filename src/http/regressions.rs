//! `GET /v1/regressions`: the newest versions that moved a stream's bookmark
//! backwards or dropped it, across states, for the dashboard's Regressions view.

use axum::Json;
use axum::extract::{Extension, State};
use serde::{Deserialize, Serialize};

use super::context::AppContext;
use super::error::ApiError;
use super::extract::{ApiQuery, page_limit};
use super::states::parse_pattern;
use super::wire::rfc3339_millis;
use crate::domain::Scope;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegressionParams {
    pattern: Option<String>,
    limit: Option<String>,
}

#[derive(Serialize)]
struct RegressedVersionView {
    state_id: String,
    /// The version (its `updated_at`), as in the state's history.
    version: String,
    regressed_streams: Vec<String>,
    /// Streams whose bookmark the version dropped (see `--bookmark-loss`).
    lost_streams: Vec<String>,
    actor: String,
    operation: String,
    lease_owner: Option<String>,
}

#[derive(Serialize)]
struct RegressionListing {
    regressions: Vec<RegressedVersionView>,
}

/// Newest first; `limit` counts versions. Only ids within the token's scope.
pub async fn list(
    State(ctx): State<AppContext>,
    Extension(scope): Extension<Scope>,
    ApiQuery(params): ApiQuery<RegressionParams>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let pattern = parse_pattern(params.pattern)?;
    let limit = page_limit(params.limit)?;
    let versions = ctx.states.regressed_versions(pattern, scope, limit).await?;
    let listing = RegressionListing {
        regressions: versions
            .into_iter()
            .map(|v| RegressedVersionView {
                state_id: v.state_id,
                version: rfc3339_millis(v.version_ms),
                regressed_streams: v.regressed_streams,
                lost_streams: v.lost_streams,
                actor: v.actor,
                operation: v.operation,
                lease_owner: Some(v.lease_owner).filter(|o| !o.is_empty()),
            })
            .collect(),
    };
    Ok(Json(
        serde_json::to_value(listing).expect("a listing always serializes"),
    ))
}
