//! `/v1/locks/{state_id}/history`: the id's leases, newest first, and how
//! each one ended. Read from ClickHouse, so any gateway answers it.

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::context::AppContext;
use super::error::ApiError;
use super::extract::{ApiQuery, StatePath, page_limit};
use super::wire::rfc3339_millis;
use crate::domain::LeaseInfo;
use crate::store::{LeaseEnd, PastLease};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseHistoryParams {
    limit: Option<String>,
}

/// One lease as the history shows it: never its lease_id, which would let
/// a reader write as a holder whose lease still runs.
#[derive(Serialize)]
struct PastLeaseView<'a> {
    owner: &'a str,
    fencing_token: u64,
    info: &'a LeaseInfo,
    acquired_at: String,
    /// `released`, `expired` or `forced`; null while the lease runs.
    ended_by: Option<&'static str>,
    ended_at: Option<String>,
    /// For a forced end: the token's name that forced it, and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    actor: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'a str>,
}

impl<'a> From<&'a PastLease> for PastLeaseView<'a> {
    fn from(lease: &'a PastLease) -> Self {
        let forced = match &lease.ended {
            Some((LeaseEnd::Forced(forced), _)) => Some(forced),
            _ => None,
        };
        Self {
            owner: &lease.owner,
            fencing_token: lease.fencing_token,
            info: &lease.info,
            acquired_at: rfc3339_millis(lease.acquired_ms),
            ended_by: lease.ended.as_ref().map(|(end, _)| end.as_str()),
            ended_at: lease.ended.as_ref().map(|(_, at)| rfc3339_millis(*at)),
            actor: forced.map(|f| f.actor.as_str()),
            reason: forced.map(|f| f.reason.as_str()),
        }
    }
}

#[derive(Serialize)]
struct LeaseHistory<'a> {
    state_id: &'a str,
    leases: Vec<PastLeaseView<'a>>,
}

pub async fn list(
    State(ctx): State<AppContext>,
    StatePath(id): StatePath,
    ApiQuery(params): ApiQuery<LeaseHistoryParams>,
) -> Result<Response, ApiError> {
    let limit = page_limit(params.limit)?;
    let Some(store) = ctx.journal.leases() else {
        return Err(ApiError::HistoryOff(
            "the gateway runs with --history=false: it keeps no lease history".to_owned(),
        ));
    };
    let leases = store.leases(&id, limit.get()).await?;
    let body = LeaseHistory {
        state_id: id.as_str(),
        leases: leases.iter().map(PastLeaseView::from).collect(),
    };
    Ok(Json(body).into_response())
}
