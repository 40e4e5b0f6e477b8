//! What tracing costs a PUT: one gateway with export off, one exporting to
//! a local OTLP receiver, one whose collector is down (a closed port), each
//! under the same writers sending a sampled `traceparent`, side by side in
//! one run, taking turns. Prints PUTs/s, p50/p99, the gateway's memory, and
//! the spans received or dropped.
//!
//! Run with `bench/run traces` (it starts the local ClickHouse and builds
//! the release binary); or set STATEHOUSE_BENCH_CLICKHOUSE_URL and
//! STATEHOUSE_BIN and run `cargo bench --bench traces`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;

mod process;

use process::GatewayProcess;

/// How long each gateway is measured in one round.
const FOR: Duration = Duration::from_secs(3);
/// Rounds: the gateways take turns, each measured once a round.
const ROUNDS: u32 = 3;
/// Writers at once, each on a state_id of its own.
const WRITERS: usize = 8;

/// A collector that takes every export and counts its bytes (no decoding:
/// the bench measures the gateway, not the collector).
async fn receiver() -> (String, Arc<AtomicU64>) {
    async fn take(State(bytes): State<Arc<AtomicU64>>, body: Bytes) -> StatusCode {
        bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
        StatusCode::OK
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let bytes = Arc::new(AtomicU64::new(0));
    let app = Router::new()
        .route("/v1/traces", post(take))
        .with_state(bytes.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (endpoint, bytes)
}

/// PUT latencies of `WRITERS` writers for `FOR`, and how long that took.
async fn measure(gateway: &GatewayProcess) -> (Vec<Duration>, Duration) {
    let http = reqwest::Client::new();
    let started = Instant::now();
    let writers: Vec<_> = (0..WRITERS)
        .map(|writer| {
            let (http, base) = (http.clone(), gateway.base.clone());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut n = 0u64;
                while started.elapsed() < FOR {
                    n += 1;
                    let trace = uuid::Uuid::new_v4().simple().to_string();
                    let span = &uuid::Uuid::new_v4().simple().to_string()[..16];
                    let sent = Instant::now();
                    let status = http
                        .put(format!("{base}/v1/states/bench-{writer}"))
                        .header("traceparent", format!("00-{trace}-{span}-01"))
                        .body(format!(r#"{{"completed": {{"n": {n}}}}}"#))
                        .send()
                        .await
                        .expect("the gateway answers")
                        .status();
                    assert!(status.is_success(), "PUT answered {status}");
                    latencies.push(sent.elapsed());
                }
                latencies
            })
        })
        .collect();
    let mut all = Vec::new();
    for writer in writers {
        all.extend(writer.await.unwrap());
    }
    (all, started.elapsed())
}

fn percentile_ms(sorted: &[Duration], p: f64) -> f64 {
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[rank].as_secs_f64() * 1000.0
}

/// A sample of the gateway's /metrics, 0 if absent.
async fn metric(gateway: &GatewayProcess, sample: &str) -> f64 {
    let text = reqwest::get(format!("{}/metrics", gateway.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::main]
async fn main() {
    let url = std::env::var("STATEHOUSE_BENCH_CLICKHOUSE_URL")
        .expect("set STATEHOUSE_BENCH_CLICKHOUSE_URL (bench/run does)");
    let (endpoint, received) = receiver().await;
    let closed = {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        format!("http://127.0.0.1:{port}")
    };
    let cases: [(&str, Vec<(&str, &str)>); 3] = [
        ("export off", vec![]),
        (
            "export on",
            vec![("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)],
        ),
        (
            "collector down",
            vec![("OTEL_EXPORTER_OTLP_ENDPOINT", closed.as_str())],
        ),
    ];
    println!(
        "traces: {WRITERS} writers, PUTs with a sampled traceparent, {ROUNDS} rounds of {} s per gateway, taking turns",
        FOR.as_secs()
    );
    let mut gateways = Vec::new();
    for (name, env) in &cases {
        let gateway = if env.is_empty() {
            GatewayProcess::start(&url, &[]).await
        } else {
            GatewayProcess::start_with_env(&url, &[], env).await
        };
        // Warm: connections, the schema's first writes.
        measure_briefly(&gateway).await;
        gateway.reset_peak();
        gateways.push((*name, gateway, Vec::new(), Duration::ZERO));
    }
    // The gateways take turns, so that a slower moment of the shared machine
    // or of ClickHouse falls on each of them alike.
    // Each round starts with another, so that none is always first.
    for round in 0..ROUNDS as usize {
        for turn in 0..gateways.len() {
            let at = (round + turn) % gateways.len();
            let (_, gateway, latencies, took) = &mut gateways[at];
            let (more, this_took) = measure(gateway).await;
            latencies.extend(more);
            *took += this_took;
        }
    }
    // What was queued goes within the export delay.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    println!(
        "{:<16} {:>8} {:>9} {:>9} {:>14} {:>22}",
        "gateway", "PUTs/s", "p50 ms", "p99 ms", "RSS/peak MiB", "spans sent / dropped"
    );
    let mut baseline = None;
    for (name, gateway, mut latencies, took) in gateways {
        latencies.sort();
        let rate = latencies.len() as f64 / took.as_secs_f64();
        let dropped = metric(&gateway, "statehouse_trace_spans_dropped_total").await;
        let sent_kib = if name == "export on" {
            received.load(Ordering::Relaxed) as f64 / 1024.0
        } else {
            0.0
        };
        let ratio = match baseline {
            None => {
                baseline = Some(rate);
                String::new()
            }
            Some(base) => format!("  ({:.2}x the rate with export off)", rate / base),
        };
        println!(
            "{:<16} {:>8.0} {:>9.2} {:>9.2} {:>6.1}/{:<7.1} {:>12.0} KiB / {:<6.0}{ratio}",
            name,
            rate,
            percentile_ms(&latencies, 0.5),
            percentile_ms(&latencies, 0.99),
            gateway.rss_kib() as f64 / 1024.0,
            gateway.peak_rss_kib() as f64 / 1024.0,
            sent_kib,
            dropped,
        );
    }
}

/// A second of writing, not counted.
async fn measure_briefly(gateway: &GatewayProcess) {
    let http = reqwest::Client::new();
    let until = Instant::now() + Duration::from_secs(1);
    while Instant::now() < until {
        let _ = http
            .put(format!("{}/v1/states/bench-warm", gateway.base))
            .body(r#"{"completed": {}}"#)
            .send()
            .await;
    }
}
