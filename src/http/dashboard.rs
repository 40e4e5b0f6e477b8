//! `GET /` and `GET /assets/{file}`: the dashboard page and its scripts and
//! styles, embedded in the binary and served as files, so that the page
//! runs under a CSP that allows no inline script or style and nothing from
//! another origin. The page reads and changes state only through the public
//! API, with the bearer token the user gives it (kept in sessionStorage).

use axum::extract::Path;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

use super::error::{ProblemType, problem};

const PAGE: &str = include_str!("dashboard/index.html");

const JS: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";

/// Every file under `/assets/`: its name, its type and its bytes. uPlot
/// (MIT, `dashboard/vendor/`) draws the charts.
const ASSETS: &[(&str, &str, &str)] = &[
    ("app.js", JS, include_str!("dashboard/app.js")),
    ("common.js", JS, include_str!("dashboard/common.js")),
    ("state.js", JS, include_str!("dashboard/state.js")),
    ("chart.js", JS, include_str!("dashboard/chart.js")),
    (
        "regressions.js",
        JS,
        include_str!("dashboard/regressions.js"),
    ),
    ("pools.js", JS, include_str!("dashboard/pools.js")),
    ("runs.js", JS, include_str!("dashboard/runs.js")),
    ("live.js", JS, include_str!("dashboard/live.js")),
    ("app.css", CSS, include_str!("dashboard/app.css")),
    (
        "uPlot.iife.min.js",
        JS,
        include_str!("dashboard/vendor/uPlot.iife.min.js"),
    ),
    (
        "uPlot.min.css",
        CSS,
        include_str!("dashboard/vendor/uPlot.min.css"),
    ),
];

/// Scripts, styles and calls from this origin only; no inline script or
/// style, no eval, no frame, no form target, no other host or scheme.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
    style-src 'self'; connect-src 'self'; img-src 'self'; base-uri 'none'; \
    form-action 'none'; frame-ancestors 'none'";

pub async fn page() -> Response {
    let mut response = PAGE.into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

pub async fn asset(Path(file): Path<String>) -> Response {
    let Some((_, kind, body)) = ASSETS.iter().find(|(name, _, _)| *name == file) else {
        return problem(
            ProblemType::NotFound,
            &format!("the dashboard has no file {file:?}"),
        );
    };
    let mut response = (*body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    // Revalidated on each load: a new binary's page never meets old files.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}
