//! OpenTelemetry traces, exported by gateway processes (the tracer is
//! process-wide) to a local collector: a request joins its caller's trace,
//! its spans are named by route, its ClickHouse statements carry the trace,
//! and its log lines name it.

use std::time::{Duration, Instant};

use reqwest::StatusCode;

use crate::helpers::{
    ClosedPort, GatewayProcess, clickhouse_target, clickhouse_url, free_port, metric,
    spawn_gateway_process_logging, spawn_gateway_process_on, unique_schema,
};
use crate::otlp::{Collector, Received};
use crate::proxy::Proxy;

/// A fresh trace id and span id, as a caller would make them.
fn caller_ids() -> (String, String) {
    let trace = uuid::Uuid::new_v4().simple().to_string();
    let span = uuid::Uuid::new_v4().simple().to_string()[..16].to_owned();
    (trace, span)
}

/// A gateway process exporting to `collector`, as service `it-traces`.
async fn traced_gateway(
    clickhouse_url: &str,
    collector: &Collector,
    env: &[(&str, &str)],
) -> GatewayProcess {
    let schema = unique_schema();
    let mut all = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint.as_str()),
        ("OTEL_SERVICE_NAME", "it-traces"),
    ];
    all.extend_from_slice(env);
    spawn_gateway_process_logging(clickhouse_url, &["--schema", &schema], "json", &all).await
}

async fn send(
    method: reqwest::Method,
    url: String,
    traceparent: &str,
    body: Option<&str>,
) -> StatusCode {
    send_with(method, url, &[("traceparent", traceparent)], body).await
}

async fn send_with(
    method: reqwest::Method,
    url: String,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> StatusCode {
    let mut request = reqwest::Client::new().request(method, url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    if let Some(body) = body {
        request = request.body(body.to_owned());
    }
    request.send().await.unwrap().status()
}

/// The server span whose parent is the caller's span `parent`.
fn server_span<'a>(spans: &'a [Received], parent: &str) -> &'a Received {
    spans
        .iter()
        .find(|span| span.parent_span_id == parent)
        .unwrap_or_else(|| panic!("no span is a child of {parent}: {spans:#?}"))
}

/// Whether ClickHouse got a request holding `statement` with a
/// `traceparent` of trace `trace_id`, or of a batch span linked to it.
fn reached_clickhouse(
    heads: &[String],
    spans: &[Received],
    statement: &str,
    trace_id: &str,
) -> bool {
    heads
        .iter()
        .filter(|head| head.contains(statement))
        .filter_map(|head| {
            head.lines()
                .find_map(|line| line.strip_prefix("traceparent: "))
                .map(str::to_owned)
        })
        .any(|traceparent| {
            let fields: Vec<&str> = traceparent.trim().split('-').collect();
            let (trace, span) = (fields[1], fields[2]);
            trace == trace_id
                || spans.iter().any(|batch| {
                    batch.span_id == span && batch.links.iter().any(|(t, _)| t == trace_id)
                })
        })
}

#[tokio::test]
async fn a_traced_put_and_get_join_the_callers_trace_down_to_clickhouse() {
    let collector = Collector::start().await;
    let proxy = Proxy::to_clickhouse().await;
    let target = clickhouse_target();
    let url = format!(
        "clickhouse://{}:{}@{}/{}",
        target.user, target.password, proxy.addr, target.database
    );
    let gateway = traced_gateway(&url, &collector, &[]).await;
    proxy.record_heads();
    let id = format!("traced-{}", uuid::Uuid::new_v4().simple());
    let state_url = format!("{}/v1/states/{id}", gateway.base);

    let (put_trace, put_parent) = caller_ids();
    let put = send(
        reqwest::Method::PUT,
        state_url.clone(),
        &format!("00-{put_trace}-{put_parent}-01"),
        Some(r#"{"completed":{"v":1}}"#),
    )
    .await;
    assert_eq!(put, StatusCode::CREATED);
    // An id never written: its GET is read from ClickHouse.
    let (get_trace, get_parent) = caller_ids();
    let get = send(
        reqwest::Method::GET,
        format!("{state_url}-unwritten"),
        &format!("00-{get_trace}-{get_parent}-01"),
        None,
    )
    .await;
    assert_eq!(get, StatusCode::NOT_FOUND);

    // 1. The PUT's server span is a child of the caller's, named by route.
    let spans = collector
        .trace(&put_trace, |spans| {
            spans.iter().any(|s| s.parent_span_id == put_parent)
        })
        .await;
    let span = server_span(&spans, &put_parent);
    assert_eq!(span.name, "PUT /v1/states/{state_id}");
    assert!(!span.name.contains(&id));
    assert_eq!(span.attributes["http.route"], "/v1/states/{state_id}");
    assert_eq!(span.attributes["http.response.status_code"], "201");
    assert_eq!(span.attributes["resource.service.name"], "it-traces");
    assert_eq!(span.kind, 2, "a server span (SPAN_KIND_SERVER)");
    let spans = collector
        .trace(&get_trace, |spans| {
            spans.iter().any(|s| s.parent_span_id == get_parent)
        })
        .await;
    let span = server_span(&spans, &get_parent);
    assert_eq!(span.name, "GET /v1/states/{state_id}");
    assert_eq!(span.attributes["http.response.status_code"], "404");

    // 2. The INSERT and the SELECT carried a traceparent of the request's
    // trace, or of a batch span linked to it (batch spans arrive as well).
    let heads = proxy.heads();
    for (statement, trace) in [("INSERT", &put_trace), ("SELECT", &get_trace)] {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while !reached_clickhouse(&heads, &collector.spans(), statement, trace) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no {statement} with a traceparent of {trace}: {heads:#?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // 4. The gateway's log names the trace.
    let logs = gateway.kill_and_collect_logs().await;
    assert!(
        logs.iter()
            .any(|line| String::from_utf8_lossy(line).contains(&put_trace)),
        "no log line names trace {put_trace}"
    );
}

#[tokio::test]
async fn an_unsampled_caller_exports_nothing_and_a_sampled_one_does_over_json() {
    let collector = Collector::start().await;
    let gateway = traced_gateway(
        &clickhouse_url(),
        &collector,
        &[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")],
    )
    .await;
    let state_url = format!("{}/v1/states/sampling", gateway.base);
    let (unsampled, parent) = caller_ids();
    let put = send(
        reqwest::Method::PUT,
        state_url.clone(),
        &format!("00-{unsampled}-{parent}-00"),
        Some(r#"{"completed":{"v":1}}"#),
    )
    .await;
    assert_eq!(put, StatusCode::CREATED);
    let (sampled, parent) = caller_ids();
    let put = send(
        reqwest::Method::PUT,
        state_url,
        &format!("00-{sampled}-{parent}-01"),
        Some(r#"{"completed":{"v":2}}"#),
    )
    .await;
    assert_eq!(put, StatusCode::OK);
    collector
        .trace(&sampled, |spans| {
            spans.iter().any(|s| s.parent_span_id == parent)
        })
        .await;
    // Spans leave in the order they end: the unsampled request's would be here by now.
    let leaked: Vec<Received> = collector
        .spans()
        .into_iter()
        .filter(|span| {
            span.trace_id == unsampled || span.links.iter().any(|(t, _)| *t == unsampled)
        })
        .collect();
    assert!(leaked.is_empty(), "{leaked:#?}");
    gateway.terminate().await;
}

/// A traced gateway that advertises itself to its peers, on `schema`.
async fn traced_peer(schema: &str, collector: &Collector, service: &str) -> GatewayProcess {
    let port = free_port();
    let advertise = format!("http://127.0.0.1:{port}");
    let flags = [
        "--schema",
        schema,
        "--advertise-url",
        &advertise,
        "--claim-settle",
        "200ms",
    ];
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint.as_str()),
        ("OTEL_SERVICE_NAME", service),
    ];
    spawn_gateway_process_on(port, &clickhouse_url(), &flags, "json", &env).await
}

#[tokio::test]
async fn a_write_forwarded_to_its_authority_stays_in_the_callers_trace() {
    let collector = Collector::start().await;
    let schema = unique_schema();
    let a = traced_peer(&schema, &collector, "gateway-a").await;
    let b = traced_peer(&schema, &collector, "gateway-b").await;
    let id = "forwarded-trace";
    // Acquired through A: A is the id's authority.
    let (lease, _) = a.api().lease(id, "it", 60, 0.0).await;

    let (trace, parent) = caller_ids();
    let traceparent = format!("00-{trace}-{parent}-01");
    let put = send_with(
        reqwest::Method::PUT,
        format!("{}/v1/states/{id}", b.base),
        &[("traceparent", &traceparent), ("lease-id", &lease)],
        Some(r#"{"completed":{"v":1}}"#),
    )
    .await;
    assert_eq!(put, StatusCode::CREATED);

    let of = |spans: &[Received], service: &str| -> Vec<Received> {
        spans
            .iter()
            .filter(|s| s.attributes["resource.service.name"] == service)
            .filter(|s| s.name == "PUT /v1/states/{state_id}")
            .cloned()
            .collect()
    };
    let spans = collector
        .trace(&trace, |spans| {
            !of(spans, "gateway-a").is_empty() && !of(spans, "gateway-b").is_empty()
        })
        .await;
    let on_b = of(&spans, "gateway-b");
    let on_a = of(&spans, "gateway-a");
    assert_eq!(
        on_b[0].parent_span_id, parent,
        "B's span is the caller's child"
    );
    let b_spans: Vec<&str> = spans
        .iter()
        .filter(|s| s.attributes["resource.service.name"] == "gateway-b")
        .map(|s| s.span_id.as_str())
        .collect();
    assert!(
        b_spans.contains(&on_a[0].parent_span_id.as_str()),
        "A's span is a child of one of B's: {spans:#?}"
    );
    a.terminate().await;
    b.terminate().await;
}

/// 80 PUTs one after another through `gateway`, each answered 201.
async fn eighty_puts(gateway: &GatewayProcess) {
    let client = reqwest::Client::new();
    for n in 0..80 {
        let (trace, parent) = caller_ids();
        let status = client
            .put(format!("{}/v1/states/down-{n}", gateway.base))
            .header("traceparent", format!("00-{trace}-{parent}-01"))
            .body(r#"{"completed":{"v":1}}"#)
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status, StatusCode::CREATED);
    }
}

/// Every request is answered while the collector is down, and the spans
/// that could not be sent are counted. What the down collector costs in
/// time (acceptance 6: at most 2x a gateway without tracing, plus 1 s) is
/// a figure a loaded machine moves: `bench/traces` measures it.
#[tokio::test]
async fn a_collector_that_is_down_fails_no_request_and_its_spans_are_counted() {
    let closed = ClosedPort::bind();
    let endpoint = closed.url();
    let traced = spawn_gateway_process_logging(
        &clickhouse_url(),
        &["--schema", &unique_schema()],
        "json",
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)],
    )
    .await;
    eighty_puts(&traced).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let metrics = reqwest::get(format!("{}/metrics", traced.base))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let dropped = metric(&metrics, "statehouse_trace_spans_dropped_total")
            .expect("the counter is exported");
        if dropped > 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no dropped span counted: {metrics}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    traced.terminate().await;
}

#[tokio::test]
async fn the_spans_of_the_last_requests_reach_the_collector_at_sigterm() {
    let collector = Collector::start().await;
    // Batches wait a minute to fill: only the flush at shutdown sends this one.
    let gateway = traced_gateway(
        &clickhouse_url(),
        &collector,
        &[("OTEL_BSP_SCHEDULE_DELAY", "60000")],
    )
    .await;
    let (trace, parent) = caller_ids();
    let put = send(
        reqwest::Method::PUT,
        format!("{}/v1/states/last-before-sigterm", gateway.base),
        &format!("00-{trace}-{parent}-01"),
        Some(r#"{"completed":{"v":1}}"#),
    )
    .await;
    assert_eq!(put, StatusCode::CREATED);
    assert!(
        collector.spans().is_empty(),
        "nothing is sent before the flush"
    );
    // Exits 0, or this fails.
    gateway.terminate().await;
    let spans: Vec<Received> = collector
        .spans()
        .into_iter()
        .filter(|span| span.trace_id == trace)
        .collect();
    server_span(&spans, &parent);
}

#[tokio::test]
async fn statehouse_lock_joins_its_callers_trace_and_hands_the_command_its_own() {
    let collector = Collector::start().await;
    let gateway = traced_gateway(&clickhouse_url(), &collector, &[]).await;
    let dir = std::env::temp_dir().join(format!("traces-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let (trace, parent) = caller_ids();
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_statehouse"))
        .args(["lock", "--url", &gateway.base, "traced-run", "--"])
        .args(["sh", "-c", "printf %s \"$TRACEPARENT\" > seen"])
        .current_dir(&dir)
        .env_remove("STATEHOUSE_TOKEN")
        .env("TRACEPARENT", format!("00-{trace}-{parent}-01"))
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &collector.endpoint)
        .env("OTEL_SERVICE_NAME", "it-runner")
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let seen = std::fs::read_to_string(dir.join("seen")).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();

    // The runner flushed before it exited; the gateway sends within a second.
    let named = |spans: &[Received], name: &str| spans.iter().find(|s| s.name == name).cloned();
    let spans = collector
        .trace(&trace, |spans| {
            named(spans, "POST /v1/locks/{state_id}").is_some()
                && named(spans, "DELETE /v1/locks/{state_id}/{lease_id}").is_some()
        })
        .await;
    let run = named(&spans, "statehouse lock").expect("the run's span");
    assert_eq!(run.parent_span_id, parent, "the run joins its caller");
    assert_eq!(run.attributes["resource.service.name"], "it-runner");
    let hold = named(&spans, "hold").expect("the hold's span");
    let acquire = named(&spans, "acquire").expect("the acquire's span");
    for phase in [
        &hold,
        &acquire,
        &named(&spans, "release").expect("the release's span"),
    ] {
        assert_eq!(phase.parent_span_id, run.span_id, "{phase:#?}");
    }
    let granted = named(&spans, "POST /v1/locks/{state_id}").unwrap();
    assert_eq!(
        granted.parent_span_id, acquire.span_id,
        "the gateway's acquire"
    );
    // The command's TRACEPARENT: the run's trace, the hold's span its parent.
    assert_eq!(seen, format!("00-{trace}-{}-01", hold.span_id));
    gateway.terminate().await;
}

#[tokio::test]
async fn a_collector_ca_file_that_cannot_be_read_stops_the_start_naming_it() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_statehouse"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env("STATEHOUSE_CLICKHOUSE_URL", clickhouse_url())
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "https://127.0.0.1:4318")
        .env(
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
            "/nonexistent/collector-ca.pem",
        )
        .env("RUST_LOG", "off")
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("statehouse: error: ")
            && stderr.contains("/nonexistent/collector-ca.pem"),
        "{stderr}"
    );
}
