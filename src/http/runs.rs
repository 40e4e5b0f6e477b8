//! `/v1/runs`: the runs recorded under leases (design.md, "Runs
//! (contract)"). Read from ClickHouse, so any gateway starts, ends and
//! answers any run; every read first settles the open runs it would show
//! whose lease has ended (`runs::RunBook::settle`).

use std::time::UNIX_EPOCH;

use axum::Json;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use super::context::AppContext;
use super::error::ApiError;
use super::extract::{ApiQuery, OptionalJson, page_limit};
use super::states::parse_pattern;
use super::wire::rfc3339_millis;
use crate::auth::Actor;
use crate::domain::{LeaseInfo, Scope, StateId};
use crate::runs::{Ending, RunBook};
use crate::store::{RunQuery, Selection, StoredRun, now_ms};

const STATUSES: [&str; 4] = ["running", "succeeded", "failed", "lost"];

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct StartBody {
    state_id: Option<String>,
    lease_id: Option<Uuid>,
    info: Option<Value>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct EndBody {
    /// JSON numbers: `3.0` is the whole number 3, as a TTL's is.
    exit_code: Option<f64>,
    signal: Option<f64>,
    info: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListParams {
    pattern: Option<String>,
    status: Option<String>,
    since: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LatestParams {
    pattern: Option<String>,
}

/// A run as the API shows it: never its lease id, which would let a reader
/// write as its holder.
#[derive(Serialize)]
pub struct RunView {
    run_id: String,
    state_id: String,
    status: String,
    owner: String,
    fencing_token: u64,
    actor: String,
    info: Value,
    started_at: String,
    ended_at: Option<String>,
    /// Null while it runs.
    duration_seconds: Option<f64>,
    exit_code: Option<i32>,
    signal: Option<i32>,
    versions: u64,
    advanced: Value,
}

/// A run as the API shows it; a running one with its versions and streams
/// so far (`so_far`, or read from history).
async fn view(book: &RunBook<'_>, run: StoredRun) -> Result<RunView, ApiError> {
    view_with(book, run, None).await
}

async fn view_with(
    book: &RunBook<'_>,
    run: StoredRun,
    so_far: Option<(u64, String)>,
) -> Result<RunView, ApiError> {
    let json = |text: &str| serde_json::from_str(text).unwrap_or(Value::Null);
    let (status, ended_ms, exit_code, signal, info, versions, advanced) = match &run.end {
        Some(end) => (
            end.status.clone(),
            Some(end.ended_ms),
            end.exit_code,
            end.signal,
            json(&end.info),
            end.versions,
            json(&end.advanced),
        ),
        None => {
            let (versions, advanced) = match so_far {
                Some(so_far) => so_far,
                None => book.window(&run, now_ms()).await.map_err(run_error)?,
            };
            let info = json(&run.info);
            (
                "running".to_owned(),
                None,
                None,
                None,
                info,
                versions,
                json(&advanced),
            )
        }
    };
    Ok(RunView {
        run_id: run.run_id.to_string(),
        state_id: run.state_id,
        status,
        owner: run.owner,
        fencing_token: run.fencing_token,
        actor: run.actor,
        info,
        started_at: rfc3339_millis(run.started_ms),
        ended_at: ended_ms.map(rfc3339_millis),
        duration_seconds: ended_ms.map(|end| (end - run.started_ms).max(0) as f64 / 1000.0),
        exit_code,
        signal,
        versions,
        advanced,
    })
}

fn book(ctx: &AppContext) -> Result<RunBook<'_>, ApiError> {
    match (ctx.journal.runs(), ctx.journal.leases()) {
        (Some(runs), Some(leases)) => Ok(RunBook {
            runs,
            locks: &ctx.locks,
            leases,
            metrics: &ctx.metrics,
        }),
        _ => Err(ApiError::HistoryOff(
            "the gateway runs with --history=false: it keeps no runs".to_owned(),
        )),
    }
}

fn run_error(err: crate::runs::RunError) -> ApiError {
    use crate::runs::RunError;
    match err {
        RunError::LeaseNotCurrent => ApiError::RunLeaseNotCurrent,
        RunError::Exists(run) => ApiError::RunExists(run),
        RunError::Ended(run) => ApiError::RunEnded(run),
        RunError::Store(err) => err.into(),
        RunError::Lock(err) => ApiError::Lock(err),
    }
}

/// Whether `n` is a whole number from `low` to `high`.
fn whole_in(n: f64, low: i32, high: i32) -> bool {
    n.fract() == 0.0 && (f64::from(low)..=f64::from(high)).contains(&n)
}

/// An `info` object of at most the size a lease's takes.
fn parse_info(info: Option<Value>) -> Result<Option<serde_json::Map<String, Value>>, ApiError> {
    let Some(info) = info else {
        return Ok(None);
    };
    LeaseInfo::parse(info.clone()).map_err(|e| ApiError::InvalidBody(e.to_string()))?;
    match info {
        Value::Object(object) => Ok(Some(object)),
        _ => unreachable!("LeaseInfo::parse takes only objects"),
    }
}

pub async fn start(
    State(ctx): State<AppContext>,
    Extension(scope): Extension<Scope>,
    Extension(actor): Extension<Actor>,
    OptionalJson(body): OptionalJson<StartBody>,
) -> Result<Response, ApiError> {
    let book = book(&ctx)?;
    let (Some(raw_id), Some(lease_id)) = (body.state_id, body.lease_id) else {
        return Err(ApiError::InvalidBody(
            "a run needs \"state_id\" and \"lease_id\"".to_owned(),
        ));
    };
    let id = StateId::parse(&raw_id)?;
    if !scope.allows(&id) {
        return Err(ApiError::OutOfScope(scope.to_string()));
    }
    let info = parse_info(body.info)?.unwrap_or_default();
    let info = Value::Object(info).to_string();
    let run = book
        .start(&id, lease_id, &actor.0, &info)
        .await
        .map_err(run_error)?;
    // Just started: nothing written, nothing moved, no history to read.
    let view = view_with(&book, run, Some((0, "[]".to_owned()))).await?;
    Ok((StatusCode::CREATED, Json(view)).into_response())
}

/// The run, settled, if the token's scope covers it.
async fn read_run(book: &RunBook<'_>, scope: &Scope, raw: &str) -> Result<StoredRun, ApiError> {
    let not_found = || ApiError::RunNotFound(raw.to_owned());
    let run_id = Uuid::parse_str(raw).map_err(|_| not_found())?;
    let run = book.runs.get(run_id).await?.ok_or_else(not_found)?;
    let id = StateId::parse(&run.state_id)?;
    if !scope.allows(&id) {
        return Err(ApiError::OutOfScope(scope.to_string()));
    }
    let mut settled = book.settle(vec![run]).await.map_err(run_error)?;
    Ok(settled.pop().expect("one run in, one out"))
}

pub async fn end(
    State(ctx): State<AppContext>,
    Extension(scope): Extension<Scope>,
    Path(raw): Path<String>,
    OptionalJson(body): OptionalJson<EndBody>,
) -> Result<Response, ApiError> {
    let book = book(&ctx)?;
    let ending = match (body.exit_code, body.signal) {
        (Some(code), None) if whole_in(code, 0, 255) => Ending::Exit(code as i32),
        (None, Some(signal)) if whole_in(signal, 1, 127) => Ending::Signal(signal as i32),
        _ => {
            return Err(ApiError::InvalidBody(
                "an end takes \"exit_code\" (0..255) or \"signal\" (1..127), one of them"
                    .to_owned(),
            ));
        }
    };
    let info = parse_info(body.info)?;
    let run = read_run(&book, &scope, &raw).await?;
    let run = book
        .end(run, ending, info.as_ref())
        .await
        .map_err(run_error)?;
    Ok(Json(view(&book, run).await?).into_response())
}

pub async fn get(
    State(ctx): State<AppContext>,
    Extension(scope): Extension<Scope>,
    Path(raw): Path<String>,
) -> Result<Response, ApiError> {
    let book = book(&ctx)?;
    let run = read_run(&book, &scope, &raw).await?;
    Ok(Json(view(&book, run).await?).into_response())
}

#[derive(Serialize)]
struct RunListing {
    runs: Vec<RunView>,
    next_cursor: Option<String>,
}

pub async fn list(
    State(ctx): State<AppContext>,
    Extension(scope): Extension<Scope>,
    ApiQuery(params): ApiQuery<ListParams>,
) -> Result<Response, ApiError> {
    let book = book(&ctx)?;
    let pattern = parse_pattern(params.pattern)?;
    let limit = page_limit(params.limit)?.get();
    let statuses = parse_statuses(params.status)?;
    let since_ms = params.since.map(|raw| parse_instant(&raw)).transpose()?;
    let before = params.cursor.map(|raw| parse_cursor(&raw)).transpose()?;
    let selection = Selection::Matching(pattern, scope);
    // Open runs whose lease has ended are written lost first, so that the
    // status filter sees them as they are.
    book.settle(book.runs.open(&selection).await?)
        .await
        .map_err(run_error)?;
    let query = RunQuery {
        selection: &selection,
        statuses: &statuses,
        since_ms,
        before,
        limit,
    };
    let mut runs = book.runs.list(&query).await?;
    let next_cursor = (runs.len() > limit as usize).then(|| {
        runs.truncate(limit as usize);
        let last = runs.last().expect("a full page has a last run");
        format!("{}.{}", last.started_ms, last.run_id)
    });
    let mut views = Vec::with_capacity(runs.len());
    for run in runs {
        views.push(view(&book, run).await?);
    }
    Ok(Json(RunListing {
        runs: views,
        next_cursor,
    })
    .into_response())
}

#[derive(Serialize)]
struct Latest {
    state_id: String,
    run: RunView,
    last_succeeded_at: Option<String>,
}

pub async fn latest(
    State(ctx): State<AppContext>,
    Extension(scope): Extension<Scope>,
    ApiQuery(params): ApiQuery<LatestParams>,
) -> Result<Response, ApiError> {
    let book = book(&ctx)?;
    let pattern = parse_pattern(params.pattern)?;
    let selection = Selection::Matching(pattern, scope);
    book.settle(book.runs.open(&selection).await?)
        .await
        .map_err(run_error)?;
    let mut latest = Vec::new();
    for (run, succeeded_ms) in book.runs.latest(&selection).await? {
        latest.push(Latest {
            state_id: run.state_id.clone(),
            run: view(&book, run).await?,
            last_succeeded_at: succeeded_ms.map(rfc3339_millis),
        });
    }
    Ok(Json(serde_json::json!({ "latest": latest })).into_response())
}

fn parse_statuses(raw: Option<String>) -> Result<Vec<String>, ApiError> {
    let Some(raw) = raw else {
        return Ok(Vec::new());
    };
    raw.split(',')
        .map(|status| {
            STATUSES
                .contains(&status)
                .then(|| status.to_owned())
                .ok_or_else(|| {
                    ApiError::InvalidQuery(format!(
                        "status {status:?} is none of {}",
                        STATUSES.join(", ")
                    ))
                })
        })
        .collect()
}

/// An RFC 3339 instant in UTC, as milliseconds.
fn parse_instant(raw: &str) -> Result<i64, ApiError> {
    let at = humantime::parse_rfc3339_weak(raw).map_err(|e| {
        ApiError::InvalidQuery(format!("since {raw:?} is no RFC 3339 instant: {e}"))
    })?;
    let since = at
        .duration_since(UNIX_EPOCH)
        .map_err(|_| ApiError::InvalidQuery(format!("since {raw:?} is before 1970")))?;
    Ok(since.as_millis() as i64)
}

/// A listing's cursor: the last run's start and id.
fn parse_cursor(raw: &str) -> Result<(i64, Uuid), ApiError> {
    let invalid = || ApiError::InvalidQuery(format!("cursor {raw:?} is not one this API gave"));
    let (ms, id) = raw.split_once('.').ok_or_else(invalid)?;
    Ok((
        ms.parse().map_err(|_| invalid())?,
        Uuid::parse_str(id).map_err(|_| invalid())?,
    ))
}
