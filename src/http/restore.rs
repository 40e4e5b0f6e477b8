//! `POST /v1/restore`: put every state a glob matches back as it was at an
//! instant, or (`dry_run`) only say what that would do, id by id and
//! stream by stream.

use axum::Json;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, header};
use serde::{Deserialize, Serialize};

use super::context::AppContext;
use super::error::ApiError;
use super::extract::OptionalJson;
use super::states::{parse_at, parse_pattern};
use super::wire::rfc3339_millis;
use crate::domain::{self, Provenance, Scope, Version};
use crate::states::{Action, Planned, RestoreAsk};

/// At most this many changes are listed; the counts cover them all.
const MAX_LISTED: usize = 1_000;

/// The longest reason, in characters (as `maxLength` counts them).
const MAX_REASON_CHARS: usize = 128;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct RestoreRequest {
    #[serde(default, deserialize_with = "not_null")]
    pattern: Option<String>,
    #[serde(default, deserialize_with = "not_null")]
    at: Option<String>,
    #[serde(default)]
    dry_run: bool,
    #[serde(default, deserialize_with = "not_null")]
    reason: Option<String>,
}

/// A member that may be left out, but is a string when given (never null).
fn not_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    String::deserialize(d).map(Some)
}

#[derive(Serialize)]
struct RestoreAnswer {
    at: String,
    dry_run: bool,
    restored: usize,
    deleted: usize,
    unchanged: usize,
    skipped_locked: usize,
    changes: Vec<ChangeView>,
    truncated: bool,
}

#[derive(Serialize)]
struct ChangeView {
    state_id: String,
    action: &'static str,
    from_version: Option<String>,
    to_version: Option<String>,
    streams: Vec<StreamView>,
}

#[derive(Serialize)]
struct StreamView {
    stream: String,
    from: Option<domain::Json>,
    to: Option<domain::Json>,
}

pub async fn restore(
    State(ctx): State<AppContext>,
    Extension(scope): Extension<Scope>,
    provenance: Provenance,
    headers: HeaderMap,
    OptionalJson(request): OptionalJson<RestoreRequest>,
) -> Result<Json<serde_json::Value>, ApiError> {
    // Restoring everything must be asked for (pattern "*"), as deleting it is.
    let Some(raw_pattern) = request.pattern else {
        return Err(ApiError::InvalidBody(
            "the body needs a pattern (\"*\" for every state) and an at".into(),
        ));
    };
    let pattern =
        parse_pattern(Some(raw_pattern)).map_err(|err| ApiError::InvalidBody(err.to_string()))?;
    let at = parse_at(request.at)
        .map_err(|err| ApiError::InvalidBody(err.to_string()))?
        .ok_or_else(|| ApiError::InvalidBody("the body needs an at (RFC 3339)".into()))?;
    let reason = request.reason.unwrap_or_default();
    let chars = reason.chars().count();
    if chars > MAX_REASON_CHARS {
        return Err(ApiError::InvalidBody(format!(
            "reason is {chars} characters; at most {MAX_REASON_CHARS}"
        )));
    }
    let provenance = Provenance {
        reason,
        ..provenance
    };
    let ask = RestoreAsk {
        pattern: &pattern,
        scope: &scope,
        at,
        dry_run: request.dry_run,
        provenance: &provenance,
        authorization: headers.get(header::AUTHORIZATION),
    };
    let planned = ctx.states.restore(&ask).await?;
    tracing::warn!(
        %pattern,
        %scope,
        at = %rfc3339_millis(at.millis()),
        dry_run = request.dry_run,
        ids = planned.len(),
        "restored states to an instant"
    );
    let answer = answer(&planned, rfc3339_millis(at.millis()), request.dry_run);
    Ok(Json(
        serde_json::to_value(answer).expect("an answer always serializes"),
    ))
}

fn answer(planned: &[Planned], at: String, dry_run: bool) -> RestoreAnswer {
    let count = |action: Action| planned.iter().filter(|p| p.action == action).count();
    let changed: Vec<&Planned> = planned
        .iter()
        .filter(|p| p.action != Action::Unchanged)
        .collect();
    let unchanged = planned.iter().filter(|p| p.action == Action::Unchanged);
    // The changes first, then the ids left as they are.
    let listed: Vec<ChangeView> = changed
        .iter()
        .copied()
        .chain(unchanged)
        .take(MAX_LISTED)
        .map(view)
        .collect();
    RestoreAnswer {
        at,
        dry_run,
        restored: count(Action::Restore),
        deleted: count(Action::Delete),
        unchanged: count(Action::Unchanged),
        skipped_locked: count(Action::SkippedLocked),
        truncated: planned.len() > listed.len(),
        changes: listed,
    }
}

fn view(planned: &Planned) -> ChangeView {
    let version = |v: Option<Version>| v.map(Version::to_rfc3339);
    ChangeView {
        state_id: planned.id.as_str().to_owned(),
        action: planned.action.as_str(),
        from_version: version(planned.from_version),
        to_version: version(planned.to_version),
        streams: planned
            .streams
            .iter()
            .map(|s| StreamView {
                stream: s.stream.clone(),
                from: s.from.clone(),
                to: s.to.clone(),
            })
            .collect(),
    }
}
