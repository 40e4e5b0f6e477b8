//! Memory under the largest bodies: 32 clients each PUT a state document of
//! exactly the body limit (16 MiB) at once, against a gateway process with
//! production defaults, for a few rounds. Prints the gateway's resident
//! memory before and at its peak, and the peak per body in flight: the
//! factor in the bound docs/operations.md states (body limit x max
//! concurrent requests x factor, plus base). Exits non-zero on any answer but 2xx.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::Barrier;

mod process;

const CLIENTS: usize = 32;
const BODY_LIMIT: usize = 16 * 1024 * 1024;
const ROUNDS: usize = 3;

/// A valid state document of exactly `len` bytes.
fn document_of_len(len: usize) -> Vec<u8> {
    let (head, tail) = (r#"{"completed":{"pad":""#, r#""}}"#);
    let mut doc = Vec::with_capacity(len);
    doc.extend_from_slice(head.as_bytes());
    doc.resize(len - tail.len(), b'x');
    doc.extend_from_slice(tail.as_bytes());
    doc
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

#[tokio::main]
async fn main() {
    let url = std::env::var("STATEHOUSE_BENCH_CLICKHOUSE_URL")
        .expect("set STATEHOUSE_BENCH_CLICKHOUSE_URL (bench/run does)");
    // A generous query timeout: the figure wanted is the memory of bodies
    // that make it all the way to ClickHouse, not of early 503s.
    let gateway = process::GatewayProcess::start(&url, &["--query-timeout", "120s"]).await;
    let http = reqwest::Client::new();
    let body = axum::body::Bytes::from(document_of_len(BODY_LIMIT));
    // Warm up the paths the burst takes, so the base includes what any busy gateway holds.
    for i in 0..4 {
        let reply = http
            .put(format!("{}/v1/states/warm-{i}", gateway.base))
            .body(r#"{"completed":{"warm":true}}"#)
            .send()
            .await
            .unwrap();
        assert!(reply.status().is_success(), "warm-up: {}", reply.status());
    }
    let base = gateway.rss_kib();
    println!(
        "statehouse memory: {CLIENTS} clients each PUT {} MiB at once, {ROUNDS} rounds",
        BODY_LIMIT / (1024 * 1024)
    );
    println!("gateway RSS before: {:.1} MiB", mib(base));

    let mut failures = Vec::new();
    for round in 0..ROUNDS {
        let start = Arc::new(Barrier::new(CLIENTS));
        let started = Instant::now();
        let clients: Vec<_> = (0..CLIENTS)
            .map(|n| {
                let (http, base, body, start) = (
                    http.clone(),
                    gateway.base.clone(),
                    body.clone(),
                    start.clone(),
                );
                tokio::spawn(async move {
                    start.wait().await;
                    http.put(format!("{base}/v1/states/big-{n}"))
                        .body(body)
                        .send()
                        .await
                        .map(|r| r.status().as_u16())
                })
            })
            .collect();
        for client in clients {
            match client.await.unwrap() {
                Ok(status) if (200..300).contains(&status) => {}
                Ok(status) => failures.push(format!("round {round}: {status}")),
                Err(err) => failures.push(format!("round {round}: {err}")),
            }
        }
        println!(
            "round {round}: {:.1} s, RSS after {:.1} MiB, peak so far {:.1} MiB",
            started.elapsed().as_secs_f64(),
            mib(gateway.rss_kib()),
            mib(gateway.peak_rss_kib()),
        );
    }
    let peak = gateway.peak_rss_kib();
    let bodies_kib = (CLIENTS * BODY_LIMIT / 1024) as u64;
    let factor = peak.saturating_sub(base) as f64 / bodies_kib as f64;
    println!(
        "gateway RSS: base {:.1} MiB, peak {:.1} MiB, peak - base {:.1} MiB for {} MiB of bodies in flight",
        mib(base),
        mib(peak),
        mib(peak.saturating_sub(base)),
        bodies_kib / 1024
    );
    println!("factor (peak - base) / (clients x body): {factor:.2}");
    println!("unexpected answers: {}", failures.len());
    for line in failures.iter().take(10) {
        println!("  {line}");
    }
    if !failures.is_empty() {
        std::process::exit(1);
    }
}
