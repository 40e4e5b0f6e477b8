//! `GET /metrics`: the registry's counters, with the pools this gateway is
//! the authority for read from its lock core at each scrape.

use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

use super::context::AppContext;

pub async fn metrics(State(ctx): State<AppContext>) -> Response {
    let pools = ctx.pools.local_occupancies();
    let counts: Vec<(&str, usize, usize)> = pools
        .iter()
        .map(|o| (o.id.as_str(), o.holders.len(), o.waiting))
        .collect();
    ctx.metrics.pools(&counts);
    let mut response = ctx.metrics.render().into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    response
}
