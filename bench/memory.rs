//! Memory per body byte, by the shape of the body, then under the largest
//! bodies.
//!
//! Shapes: for each worst shape (one long string, 4 million small values,
//! an object of many small members, deeply nested objects), a fresh gateway
//! process takes 4 bodies of 8 MiB at once, then answers the 4 reads of
//! them back at once; each read must be the document written. Printed side
//! by side: the peak resident memory over the base, per byte of the bodies
//! in flight, for the writes and for the reads.
//!
//! Burst: 32 clients each PUT a state document of exactly the body limit
//! (16 MiB) at once, against a gateway process with production defaults,
//! for a few rounds. Prints the gateway's resident memory before and at its
//! peak, and the peak per body in flight: the factor in the bound
//! docs/operations.md states (body limit x max concurrent requests x factor,
//! plus base). Exits non-zero on any answer but 2xx.

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

const SHAPE_BODIES: usize = 4;
const SHAPE_BYTES: usize = 8 * 1024 * 1024;

/// `{"completed":{...}}` around `fill`, which writes members until the
/// document is about `SHAPE_BYTES` long.
fn shaped(fill: impl Fn(&mut String, usize)) -> String {
    let mut doc = String::with_capacity(SHAPE_BYTES + 64);
    doc.push_str(r#"{"completed":{"#);
    let mut n = 0;
    while doc.len() < SHAPE_BYTES - 1024 {
        if n > 0 {
            doc.push(',');
        }
        fill(&mut doc, n);
        n += 1;
    }
    doc.push_str("}}");
    doc
}

/// The worst shapes a client can send, each about `SHAPE_BYTES` long.
fn shapes() -> Vec<(&'static str, String)> {
    let long_string = String::from_utf8(document_of_len(SHAPE_BYTES)).unwrap();
    let zeros = format!(
        r#"{{"completed":{{"v":[{}0]}}}}"#,
        "0,".repeat((SHAPE_BYTES - 32) / 2)
    );
    let members = shaped(|doc, n| doc.push_str(&format!(r#""{n:x}":0"#)));
    let nested = shaped(|doc, n| {
        doc.push_str(&format!(r#""{n:x}":"#));
        doc.push_str(&r#"{"a":"#.repeat(100));
        doc.push('0');
        doc.push_str(&"}".repeat(100));
    });
    vec![
        ("one long string", long_string),
        ("4M small values (array)", zeros),
        ("many small members", members),
        ("nested objects, 100 deep", nested),
    ]
}

/// Peak RSS over the base, per byte of the bodies in flight, for 4 writes
/// at once and then 4 reads at once, on a fresh gateway.
async fn shape_factors(url: &str, doc: &str, failures: &mut Vec<String>) -> (f64, f64) {
    let gateway = process::GatewayProcess::start(url, &["--query-timeout", "120s"]).await;
    let http = reqwest::Client::new();
    let base = gateway.peak_rss_kib();
    let bytes_kib = (SHAPE_BODIES * doc.len() / 1024) as f64;
    let body = axum::body::Bytes::from(doc.to_owned());
    let writes: Vec<_> = (0..SHAPE_BODIES)
        .map(|n| {
            let request = http
                .put(format!("{}/v1/states/shape-{n}", gateway.base))
                .body(body.clone());
            tokio::spawn(async move { request.send().await.map(|r| r.status().as_u16()) })
        })
        .collect();
    for write in writes {
        match write.await.unwrap() {
            Ok(status) if (200..300).contains(&status) => {}
            other => failures.push(format!("write: {other:?}")),
        }
    }
    let written = gateway.peak_rss_kib();
    let before_reads = gateway.rss_kib();
    gateway.reset_peak();
    let reads: Vec<_> = (0..SHAPE_BODIES)
        .map(|n| {
            let request = http.get(format!("{}/v1/states/shape-{n}", gateway.base));
            tokio::spawn(async move {
                let reply = request.send().await.ok()?;
                let state: serde_json::Value = reply.json().await.ok()?;
                Some(state["completed"].clone())
            })
        })
        .collect();
    let sent: serde_json::Value = serde_json::from_str(doc).unwrap();
    for read in reads {
        if read.await.unwrap().as_ref() != Some(&sent["completed"]) {
            failures.push("a read did not answer the document written".into());
        }
    }
    let read = gateway.peak_rss_kib();
    (
        written.saturating_sub(base) as f64 / bytes_kib,
        read.saturating_sub(before_reads) as f64 / bytes_kib,
    )
}

#[tokio::main]
async fn main() {
    let url = std::env::var("STATEHOUSE_BENCH_CLICKHOUSE_URL")
        .expect("set STATEHOUSE_BENCH_CLICKHOUSE_URL (bench/run does)");
    let mut failures = Vec::new();
    println!(
        "statehouse memory by shape: {SHAPE_BODIES} bodies of {} MiB written at once, then read back at once",
        SHAPE_BYTES / (1024 * 1024)
    );
    println!(
        "{:<28} {:>16} {:>16}",
        "shape", "writes: x bytes", "reads: x bytes"
    );
    for (name, doc) in shapes() {
        let (write, read) = shape_factors(&url, &doc, &mut failures).await;
        println!("{name:<28} {write:>16.2} {read:>16.2}");
    }
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
