//! `GET /metrics`: the registry's counters, with the pools this gateway is
//! the authority for read from its lock core at each scrape, and the runs
//! running read from ClickHouse (open runs whose lease has ended are
//! settled `lost` first, so a run lost with nobody reading it is counted).

use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

use super::context::AppContext;
use crate::domain::{Scope, StatePattern};
use crate::runs::RunBook;
use crate::store::Selection;

/// Sets `statehouse_runs_running`; a failed read leaves the last count and
/// is logged, since a scrape answers whatever ClickHouse does.
async fn count_runs(ctx: &AppContext) {
    let (Some(runs), Some(leases)) = (ctx.journal.runs(), ctx.journal.leases()) else {
        return;
    };
    let book = RunBook {
        runs,
        locks: &ctx.locks,
        leases,
        metrics: &ctx.metrics,
    };
    let every = StatePattern::parse("*".to_owned()).expect("* is a glob");
    let selection = Selection::Matching(every, Scope::everything());
    let settled = match runs.open(&selection).await {
        Ok(open) => book.settle(open).await,
        Err(err) => Err(err.into()),
    };
    match settled {
        Ok(runs) => {
            let running = runs.iter().filter(|run| run.end.is_none()).count();
            ctx.metrics.runs_running(running);
        }
        Err(err) => tracing::warn!(error = %err, "runs running not counted"),
    }
}

pub async fn metrics(State(ctx): State<AppContext>) -> Response {
    let pools = ctx.pools.local_occupancies();
    let counts: Vec<(&str, usize, usize)> = pools
        .iter()
        .map(|o| (o.id.as_str(), o.holders.len(), o.waiting))
        .collect();
    ctx.metrics.pools(&counts);
    count_runs(&ctx).await;
    let mut response = ctx.metrics.render().into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    response
}
