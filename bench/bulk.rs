//! Bulk state against a gateway process with production defaults: an import
//! of 100,000 states in batches (POST /v1/states) and their export in pages
//! (GET /v1/states?include=documents), in states/s beside single PUTs, with
//! the gateway's resident memory before and after and at its peak.
//!
//! Run with `bench/run bulk`.

use std::time::Instant;

use serde_json::{Value, json};

mod process;

const STATES: usize = 100_000;
const BATCH: usize = 5_000;
const SINGLE_PUTS: usize = 500;

fn entry(n: usize) -> Value {
    json!({
        "state_id": format!("bulk:{n:06}"),
        "completed": {"singer_state": {"bookmarks": {
            "orders": {"replication_key": "updated_at", "replication_key_value": format!("2026-11-{:02}T00:00:00Z", n % 28 + 1)},
            "customers": {"replication_key": "id", "replication_key_value": n}
        }}},
        "partial": {}
    })
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

#[tokio::main]
async fn main() {
    let url = std::env::var("STATEHOUSE_BENCH_CLICKHOUSE_URL")
        .expect("set STATEHOUSE_BENCH_CLICKHOUSE_URL (bench/run does)");
    let gateway = process::GatewayProcess::start(&url, &["--query-timeout", "60s"]).await;
    let http = reqwest::Client::new();
    let base = gateway.base.clone();
    let start_rss = gateway.rss_kib();

    let started = Instant::now();
    for first in (0..STATES).step_by(BATCH) {
        let batch: Vec<Value> = (first..(first + BATCH).min(STATES)).map(entry).collect();
        let reply = http
            .post(format!("{base}/v1/states"))
            .json(&batch)
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), 200, "{}", reply.text().await.unwrap());
    }
    let import_secs = started.elapsed().as_secs_f64();
    let after_import_rss = gateway.rss_kib();
    // The export's own peak, apart from the import's.
    let import_peak = gateway.peak_rss_kib();
    gateway.reset_peak();

    let started = Instant::now();
    let mut exported = 0;
    let mut cursor: Option<String> = None;
    loop {
        let mut request = http.get(format!("{base}/v1/states")).query(&[
            ("pattern", "bulk:*"),
            ("include", "documents"),
            ("limit", "1000"),
        ]);
        if let Some(cursor) = &cursor {
            request = request.query(&[("cursor", cursor)]);
        }
        let page: Value = request.send().await.unwrap().json().await.unwrap();
        exported += page["states"].as_array().unwrap().len();
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    let export_secs = started.elapsed().as_secs_f64();
    assert_eq!(exported, STATES, "the export saw every state once");

    let started = Instant::now();
    for n in 0..SINGLE_PUTS {
        let mut doc = entry(n);
        doc.as_object_mut().unwrap().remove("state_id");
        let reply = http
            .put(format!("{base}/v1/states/single:{n:06}"))
            .json(&doc)
            .send()
            .await
            .unwrap();
        assert!(reply.status().is_success());
    }
    let put_secs = started.elapsed().as_secs_f64();

    let import_rate = STATES as f64 / import_secs;
    let export_rate = STATES as f64 / export_secs;
    let put_rate = SINGLE_PUTS as f64 / put_secs;
    println!("statehouse bulk bench: {STATES} states, gateway process with production defaults");
    println!(
        "{:<42} {:>9} {:>11} {:>9}",
        "", "seconds", "states/s", "x PUTs"
    );
    println!(
        "{:<42} {import_secs:>9.2} {import_rate:>11.0} {:>9.1}",
        format!("import, POST /v1/states of {BATCH}"),
        import_rate / put_rate
    );
    println!(
        "{:<42} {export_secs:>9.2} {export_rate:>11.0} {:>9.1}",
        "export, include=documents pages of 1000",
        export_rate / put_rate
    );
    println!(
        "{:<42} {put_secs:>9.2} {put_rate:>11.0} {:>9.1}",
        format!("{SINGLE_PUTS} single PUTs, one client"),
        1.0
    );
    println!(
        "gateway RSS: {:.1} MiB at start, {:.1} MiB after the import (peak {:.1} MiB), {:.1} MiB after the export (peak {:.1} MiB)",
        mib(start_rss),
        mib(after_import_rss),
        mib(import_peak),
        mib(gateway.rss_kib()),
        mib(gateway.peak_rss_kib())
    );
}
