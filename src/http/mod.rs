//! The HTTP face: routes, extractors, errors, and the middleware around them.

mod admission;
mod auth;
mod bookmarks;
mod browser;
mod changes;
mod changes_stream;
mod context;
mod dashboard;
mod error;
mod extract;
mod forward;
mod health;
mod held_body;
mod history;
mod lock_history;
mod lock_view;
mod locks;
mod long_poll;
mod metrics_page;
mod pool_view;
mod pools;
mod regressions;
mod restore;
mod runs;
mod server;
mod state_answer;
mod states;
mod tickets;
mod whoami;
mod wire;

use std::borrow::Cow;
use std::time::Instant;

use axum::Router;
use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, MethodRouter, get, on};
use tower::ServiceBuilder;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;

use error::{PROBLEM_JSON, ProblemType, bare_problem, problem};

pub use self::admission::Admission;
use self::admission::Counts;
use self::auth::Access;
pub use self::browser::OwnHosts;
pub use self::context::AppContext;
pub use self::health::Readiness;
use self::server::TlsSession;
pub use self::server::{bind, serve};
use self::wire::REQUEST_ID;
use crate::auth::Role;
use crate::locks::FORWARDED_BY;
use crate::metrics::method_label;
use crate::telemetry::ClientText;
use crate::traces;

/// One operation per entry: `op!(METHOD path => handler, access, counts, served)`.
macro_rules! op {
    ($method:ident $path:literal => $handler:expr, $access:expr, $counts:expr, $served:expr) => {
        Operation {
            path: $path,
            method: Method::$method,
            access: $access,
            counts: $counts,
            served: $served,
            handler: on(MethodFilter::$method, $handler),
        }
    };
}

struct Operation {
    path: &'static str,
    method: Method,
    access: Access,
    counts: Counts,
    served: Served,
    handler: MethodRouter<AppContext>,
}

/// Which gateway serves an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Served {
    /// Whichever gateway the request reached.
    Anywhere,
    /// The authority for the path's state_id: lock operations and the
    /// writes that lock rules apply to.
    ByAuthority,
}

/// Every operation of the API: who may call it, which concurrency limit it
/// counts against, and which gateway serves it. The router is built from
/// this table, and the contract test holds it against `openapi.yaml` both ways.
fn operations() -> Vec<Operation> {
    use Access::{Metrics, Needs, Open};
    use Counts::{LockWaiter, Nothing, Request, RequestOrWatcher};
    use Role::{Admin, Read, Write};
    use Served::{Anywhere, ByAuthority};
    vec![
        op!(GET "/v1/states" => states::list, Needs(Read), Request, Anywhere),
        op!(POST "/v1/states" => states::import, Needs(Write), Request, Anywhere),
        op!(DELETE "/v1/states" => states::delete_many, Needs(Admin), Request, Anywhere),
        op!(GET "/v1/states/{state_id}" => states::get, Needs(Read), RequestOrWatcher, Anywhere),
        op!(PUT "/v1/states/{state_id}" => states::put, Needs(Write), Request, ByAuthority),
        op!(PATCH "/v1/states/{state_id}" => states::patch, Needs(Write), Request, ByAuthority),
        op!(DELETE "/v1/states/{state_id}" => states::delete, Needs(Write), Request, ByAuthority),
        op!(GET "/v1/states/{state_id}/history" => history::list, Needs(Read), Request, Anywhere),
        op!(GET "/v1/states/{state_id}/history/{version}" => history::get, Needs(Read), Request, Anywhere),
        op!(POST "/v1/states/{state_id}/rollback" => history::rollback, Needs(Write), Request, ByAuthority),
        op!(DELETE "/v1/states/{state_id}/bookmarks/{stream}" => states::reset_stream, Needs(Write), Request, ByAuthority),
        op!(GET "/v1/changes" => changes::list, Needs(Read), RequestOrWatcher, Anywhere),
        op!(GET "/v1/bookmarks" => bookmarks::list, Needs(Read), Request, Anywhere),
        op!(GET "/v1/regressions" => regressions::list, Needs(Read), Request, Anywhere),
        op!(POST "/v1/restore" => restore::restore, Needs(Write), Request, Anywhere),
        op!(GET "/v1/whoami" => whoami::whoami, Needs(Read), Request, Anywhere),
        op!(GET "/v1/locks" => locks::list, Needs(Read), Request, Anywhere),
        op!(POST "/v1/locks/{state_id}" => locks::acquire, Needs(Write), LockWaiter, ByAuthority),
        op!(GET "/v1/locks/{state_id}" => locks::get, Needs(Read), Request, ByAuthority),
        op!(DELETE "/v1/locks/{state_id}" => locks::force_unlock, Needs(Admin), Request, ByAuthority),
        op!(GET "/v1/locks/{state_id}/history" => lock_history::list, Needs(Read), Request, Anywhere),
        op!(PUT "/v1/locks/{state_id}/{lease_id}" => locks::renew, Needs(Write), Request, ByAuthority),
        op!(DELETE "/v1/locks/{state_id}/{lease_id}" => locks::release, Needs(Write), Request, ByAuthority),
        op!(GET "/v1/pools" => pools::list, Needs(Read), Request, Anywhere),
        op!(POST "/v1/pools/{name}" => pools::acquire, Needs(Write), LockWaiter, ByAuthority),
        op!(GET "/v1/pools/{name}" => pools::get, Needs(Read), Request, ByAuthority),
        op!(DELETE "/v1/pools/{name}" => pools::force_release, Needs(Admin), Request, ByAuthority),
        op!(PUT "/v1/pools/{name}/{lease_id}" => pools::renew, Needs(Write), Request, ByAuthority),
        op!(DELETE "/v1/pools/{name}/{lease_id}" => pools::release, Needs(Write), Request, ByAuthority),
        op!(GET "/v1/runs" => runs::list, Needs(Read), Request, Anywhere),
        op!(POST "/v1/runs" => runs::start, Needs(Write), Request, Anywhere),
        op!(GET "/v1/runs/latest" => runs::latest, Needs(Read), Request, Anywhere),
        op!(GET "/v1/runs/{run_id}" => runs::get, Needs(Read), Request, Anywhere),
        op!(PATCH "/v1/runs/{run_id}" => runs::end, Needs(Write), Request, Anywhere),
        op!(POST "/v1/internal/tickets" => tickets::issue, Needs(Write), Request, Anywhere),
        op!(DELETE "/v1/internal/tickets/{ticket}" => tickets::settle, Needs(Write), Request, Anywhere),
        op!(GET "/" => dashboard::page, Open, Request, Anywhere),
        op!(GET "/assets/{file}" => dashboard::asset, Open, Request, Anywhere),
        op!(GET "/healthz" => health::healthz, Open, Nothing, Anywhere),
        op!(GET "/readyz" => health::readyz, Open, Nothing, Anywhere),
        op!(GET "/metrics" => metrics_page::metrics, Metrics, Nothing, Anywhere),
    ]
}

/// The (path template, method) pairs the router serves.
pub fn operation_list() -> Vec<(&'static str, Method)> {
    operations()
        .into_iter()
        .map(|op| (op.path, op.method))
        .collect()
}

pub fn router(ctx: AppContext) -> Router {
    let api = operations().into_iter().fold(Router::new(), |router, op| {
        let mut handler = op.handler;
        if op.served == Served::ByAuthority {
            handler = handler.route_layer(middleware::from_fn_with_state(
                ctx.clone(),
                forward::to_authority,
            ));
        }
        // A request forwarded to another gateway is refused first, whatever
        // this gateway's tokens (another cluster's may differ), so that the
        // forwarder finds its peer gone. Then it is authorized, then
        // admitted against its token's share (so the guard comes first: it
        // names the token), then forwarded or served; one refused for any
        // of these costs no ClickHouse query.
        let meant_here = middleware::from_fn_with_state(ctx.clone(), forward::meant_here);
        let guard = middleware::from_fn_with_state((ctx.clone(), op.access), auth::guard);
        let admit = middleware::from_fn_with_state(
            (ctx.admission.clone(), ctx.metrics.clone(), op.counts),
            admission::admit,
        );
        let layered = handler
            .route_layer(admit)
            .route_layer(guard)
            .route_layer(meant_here);
        router.route(op.path, layered)
    });
    api
        // `/v1/states/` names the empty id: a 400 says why, where a 404 would puzzle.
        .route(
            "/v1/states/",
            get(states::empty_id)
                .put(states::empty_id)
                .patch(states::empty_id)
                .delete(states::empty_id),
        )
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(
            (ctx.tokens.clone(), ctx.own_hosts.clone()),
            browser::guard,
        ))
        .layer(middleware::from_fn_with_state(ctx.clone(), record_metrics))
        .with_state(ctx)
        .layer(
            ServiceBuilder::new()
                .layer(SetRequestIdLayer::new(REQUEST_ID, MakeRequestUuid))
                .layer(
                    TraceLayer::new_for_http()
                        .make_span_with(request_span)
                        .on_response(DefaultOnResponse::new().level(Level::INFO)),
                )
                .layer(PropagateRequestIdLayer::new(REQUEST_ID))
                .layer(middleware::from_fn(problem_for_bare_errors))
                .layer(CatchPanicLayer::custom(|_| {
                    problem(
                        ProblemType::Internal,
                        "the request hit a bug in statehouse; it has been logged",
                    )
                })),
        )
}

/// Every field a client sent is logged through [`ClientText`], so no header
/// can put a line break or a terminal escape into the log. With traces on,
/// the span joins the caller's `traceparent` here, before it is entered,
/// and its `trace_id` names the trace in every log line of the request.
fn request_span(request: &Request<Body>) -> tracing::Span {
    let header_text = |name| {
        request.headers().get(name).map_or(Cow::Borrowed("-"), |v| {
            String::from_utf8_lossy(v.as_bytes())
        })
    };
    let request_id = header_text(REQUEST_ID);
    let user_agent = header_text(header::USER_AGENT);
    let forwarded_by = header_text(FORWARDED_BY);
    let scheme = match request.extensions().get::<TlsSession>() {
        Some(_) => "https",
        None => "http",
    };
    let span = tracing::info_span!(
        "request",
        method = %ClientText(request.method().as_str()),
        path = %ClientText(request.uri().path()),
        scheme,
        request_id = %ClientText(&request_id),
        user_agent = %ClientText(&user_agent),
        forwarded_by = %ClientText(&forwarded_by),
        trace_id = tracing::field::Empty,
        otel.kind = tracing::field::Empty,
    );
    traces::join(&span, request.headers());
    span
}

async fn not_found(request: Request) -> Response {
    problem(
        ProblemType::NotFound,
        &format!("no route for {}", request.uri().path()),
    )
}

/// Requests by route and status, with latency, labelled by the route
/// template (never the raw path, which would explode label cardinality);
/// the request's span is named by the same template.
async fn record_metrics(State(ctx): State<AppContext>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().clone();
    let matched = request.extensions().get::<MatchedPath>();
    traces::name_by_route(method_label(&method), matched.map(MatchedPath::as_str));
    let route = matched.map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let response = next.run(request).await;
    traces::record_status(response.status().as_u16());
    ctx.metrics.observe_request(
        &method,
        &route,
        response.status().as_u16(),
        started.elapsed().as_secs_f64(),
    );
    response
}

/// Turns an error status that some layer answered without a body of ours
/// (405 from the method router, 413 from the body limit, ...) into problem+json.
async fn problem_for_bare_errors(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    // Our handlers answer errors in JSON (problems, or /readyz's report); only
    // bare text or empty bodies come from elsewhere.
    let ours = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| {
            v.as_bytes().starts_with(PROBLEM_JSON.as_bytes())
                || v.as_bytes().starts_with(b"application/json")
        });
    if !status.is_client_error() && !status.is_server_error() || ours {
        return response;
    }
    let detail = match status {
        StatusCode::METHOD_NOT_ALLOWED => "this method is not allowed on this path".to_owned(),
        other => other
            .canonical_reason()
            .unwrap_or("request failed")
            .to_owned(),
    };
    let mut replacement = bare_problem(status, &detail);
    if let Some(allow) = response.headers().get(header::ALLOW) {
        replacement
            .headers_mut()
            .insert(header::ALLOW, allow.clone());
    }
    replacement.into_response()
}
