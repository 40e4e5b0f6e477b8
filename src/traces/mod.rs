//! OpenTelemetry traces: on only when `OTEL_EXPORTER_OTLP_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set. Then the `tracing` spans of
//! statehouse are exported over OTLP/HTTP (see `export`), a request joins the
//! caller's W3C `traceparent`, and what the gateway sends on (to a peer, to
//! ClickHouse) carries the trace. Off, nothing here is set up and every
//! function below answers at the cost of one atomic load.

mod export;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue};
use opentelemetry::KeyValue;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanContext, TraceContextExt, TracerProvider as _};
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};
use prometheus_client::metrics::counter::Counter;
use tracing::{Level, Subscriber};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

use self::export::{DROPPED, Queue, Reqwest};
use crate::client::TlsFiles;

/// The W3C header that carries a trace from one process to the next.
pub const TRACEPARENT: &str = "traceparent";

/// The provider while export is on: set once, by [`start`].
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// What `OTEL_*` variables turn export on.
const ENDPOINT_VARIABLES: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
];

/// How long an export may take when `OTEL_EXPORTER_OTLP_TIMEOUT` says nothing.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a span may wait for its batch to fill when
/// `OTEL_BSP_SCHEDULE_DELAY` says nothing.
const SEND_EVERY: Duration = Duration::from_secs(1);

/// Whether spans are exported.
pub fn enabled() -> bool {
    PROVIDER.get().is_some()
}

/// Spans that never reached the collector, for `/metrics`.
pub fn spans_dropped() -> Counter {
    DROPPED.clone()
}

/// Starts export if the `OTEL_*` variables ask for it, answering the
/// tracer the `tracing` layer hands spans to; None when export is off.
pub fn start() -> Result<Option<SdkTracer>, String> {
    let variable = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    if ENDPOINT_VARIABLES
        .iter()
        .all(|name| variable(name).is_none())
    {
        return Ok(None);
    }
    let protocol = match variable("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| variable("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .as_deref()
    {
        None | Some("http/protobuf") => Protocol::HttpBinary,
        Some("http/json") => Protocol::HttpJson,
        Some(other) => {
            return Err(format!(
                "OTEL_EXPORTER_OTLP_PROTOCOL={other:?} is not supported: statehouse exports over OTLP/HTTP, http/protobuf (the default) or http/json"
            ));
        }
    };
    let milliseconds = |value: String| value.trim().parse().ok().map(Duration::from_millis);
    let timeout = variable("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
        .or_else(|| variable("OTEL_EXPORTER_OTLP_TIMEOUT"))
        .and_then(milliseconds)
        .unwrap_or(EXPORT_TIMEOUT);
    let every = variable("OTEL_BSP_SCHEDULE_DELAY")
        .and_then(milliseconds)
        .unwrap_or(SEND_EVERY);
    // An https collector is trusted as any TLS peer: the system's roots, or
    // the CA file and client certificate the standard variables name.
    let file = |name: &str| {
        variable(&format!("OTEL_EXPORTER_OTLP_TRACES_{name}"))
            .or_else(|| variable(&format!("OTEL_EXPORTER_OTLP_{name}")))
            .map(PathBuf::from)
    };
    let tls = TlsFiles {
        ca_file: file("CERTIFICATE"),
        client_cert_file: file("CLIENT_CERTIFICATE"),
        client_key_file: file("CLIENT_KEY"),
    };
    let http = crate::client::builder(&tls)?
        .timeout(timeout)
        .build()
        .map_err(|e| format!("cannot set up the trace exporter's HTTP client: {e}"))?;
    let mut exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(Reqwest(http))
        .with_protocol(protocol)
        .with_timeout(timeout)
        .build()
        .map_err(|e| format!("cannot export traces: {e}"))?;
    let service = variable("OTEL_SERVICE_NAME").unwrap_or_else(|| "statehouse".to_owned());
    let resource = Resource::builder().with_service_name(service).build();
    opentelemetry_sdk::trace::SpanExporter::set_resource(&mut exporter, &resource);
    let queue = Queue::start(exporter, every)
        .map_err(|e| format!("cannot start the trace exporter: {e}"))?;
    let provider = SdkTracerProvider::builder()
        .with_span_processor(queue)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::AlwaysOn)))
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("statehouse");
    let _ = PROVIDER.set(provider);
    Ok(Some(tracer))
}

/// Starts export, as [`start`], for a command that logs on its own (not
/// through `tracing`): its spans go to OpenTelemetry only. Answers whether
/// export is on.
pub fn start_without_logs() -> Result<bool, String> {
    let Some(tracer) = start()? else {
        return Ok(false);
    };
    // Already initialized: only a test in this process could have done it.
    let _ = tracing_subscriber::registry()
        .with(layer(tracer))
        .try_init();
    Ok(true)
}

/// The `tracing` layer that hands statehouse's own spans, of level info and
/// up, to `tracer`; what `RUST_LOG` lets the log show does not change it.
pub fn layer<S>(tracer: SdkTracer) -> impl Layer<S>
where
    S: Subscriber + for<'span> LookupSpan<'span>,
{
    tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(Targets::new().with_target("statehouse", Level::INFO))
}

/// Sends the spans still queued, waiting for them at most `within`; a
/// collector that is down costs the shutdown no more.
pub fn flush(within: Duration) {
    if let Some(provider) = PROVIDER.get()
        && let Err(err) = provider.shutdown_with_timeout(within)
    {
        tracing::warn!(error = %err, "not every span reached the collector at shutdown");
    }
}

/// Makes `span`, a request's and not yet entered, a server span in the
/// trace the `traceparent` of `headers` names (a new trace without one),
/// and records its trace id as its `trace_id` field, so that its log lines
/// name the trace. The span declares `otel.kind` and `trace_id` empty.
pub fn join(span: &tracing::Span, headers: &HeaderMap) {
    if !enabled() {
        return;
    }
    // Before the span starts: its kind cannot change after.
    span.record("otel.kind", "server");
    join_context(span, headers);
}

/// Puts `span`, not yet entered, in the trace of `headers`' `traceparent`.
fn join_context(span: &tracing::Span, headers: &HeaderMap) {
    if !enabled() {
        return;
    }
    let parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    // Before the span is entered, or the parent is ignored.
    let _ = span.set_parent(parent);
    let context = span.context();
    let span_context = context.span().span_context().clone();
    if span_context.is_valid() {
        span.record("trace_id", tracing::field::display(span_context.trace_id()));
    }
}

/// Puts `span`, not yet entered, in the trace of the `TRACEPARENT`
/// variable, as a process started by an orchestrator finds it.
pub fn join_environment(span: &tracing::Span) {
    let mut headers = HeaderMap::new();
    if let Some(value) = std::env::var_os("TRACEPARENT")
        .and_then(|v| v.into_string().ok())
        .and_then(|v| HeaderValue::from_str(v.trim()).ok())
    {
        headers.insert(TRACEPARENT, value);
    }
    join_context(span, &headers);
}

/// Names the current span, a request's, by its route: `PUT
/// /v1/states/{state_id}`, never a path that holds an id. `method` is a
/// standard method's name or `other`, never one a client made up.
pub fn name_by_route(method: &'static str, route: Option<&str>) {
    if !enabled() {
        return;
    }
    let context = tracing::Span::current().context();
    let span = context.span();
    span.set_attribute(KeyValue::new("http.request.method", method));
    match route {
        Some(route) => {
            span.update_name(format!("{method} {route}"));
            span.set_attribute(KeyValue::new("http.route", route.to_owned()));
        }
        None => span.update_name(method),
    }
}

/// Records the status the current span's request was answered with.
pub fn record_status(status: u16) {
    if !enabled() {
        return;
    }
    tracing::Span::current().set_attribute("http.response.status_code", i64::from(status));
}

/// Sets `headers`' `traceparent` to the current span's, for a request sent
/// on in its name (forwarded to a peer).
pub fn inject(headers: &mut HeaderMap) {
    if !enabled() {
        return;
    }
    let context = tracing::Span::current().context();
    TraceContextPropagator::new().inject_context(&context, &mut HeaderInjector(headers));
}

/// The current span's `traceparent`, for a statement sent to ClickHouse;
/// None when export is off or no span is current.
pub fn traceparent() -> Option<HeaderValue> {
    if !enabled() {
        return None;
    }
    let context = tracing::Span::current().context();
    let mut headers = HeaderMap::new();
    TraceContextPropagator::new().inject_context(&context, &mut HeaderInjector(&mut headers));
    headers.remove(TRACEPARENT)
}

/// The span of a request that hands work to a batch (a group commit, a read
/// batch): the batch's span links to it.
#[derive(Clone, Debug, Default)]
pub struct Caller(Option<SpanContext>);

impl Caller {
    /// The current span, if it is traced and sampled (exported).
    pub fn current() -> Self {
        if !enabled() {
            return Self(None);
        }
        let context = tracing::Span::current().context();
        let span_context = context.span().span_context().clone();
        Self(span_context.is_sampled().then_some(span_context))
    }
}

/// A span for work done for several requests at once, linked to each of
/// their spans and in no request's trace: `make` builds it (with `parent:
/// None`) only when one of the callers is exported, so work for requests
/// that are not traced, or not sampled, exports nothing.
pub fn batch_span<'a>(
    make: impl FnOnce() -> tracing::Span,
    callers: impl IntoIterator<Item = &'a Caller>,
) -> tracing::Span {
    let mut links = callers
        .into_iter()
        .filter_map(|caller| caller.0.as_ref())
        .peekable();
    if links.peek().is_none() {
        return tracing::Span::none();
    }
    let span = make();
    for link in links {
        span.add_link(link.clone());
    }
    span
}
