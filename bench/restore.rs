//! A restore of 5,000 states to an instant (POST /v1/restore) against a
//! gateway process with production defaults: its time, its INSERT
//! statements (at most 50: the writes go as batches, as bulk import's do,
//! not one INSERT an id) and every statement it sent, beside its dry run
//! and a repeat (which writes nothing), with the gateway's peak memory.
//!
//! Run with `bench/run restore`.

use std::time::{Duration, Instant, SystemTime};

use serde_json::{Value, json};

mod process;
mod statements;

const STATES: usize = 5_000;
/// Fewer INSERTs than this, or the restore is not batched.
const MAX_INSERTS: f64 = 50.0;

fn entry(n: usize, round: usize) -> Value {
    json!({
        "state_id": format!("restore:{n:05}"),
        "completed": {"singer_state": {"bookmarks": {
            "orders": {"replication_key": "id", "replication_key_value": n * 10 + round}
        }}},
        "partial": {}
    })
}

async fn import(http: &reqwest::Client, base: &str, round: usize) {
    let batch: Vec<Value> = (0..STATES).map(|n| entry(n, round)).collect();
    let reply = http
        .post(format!("{base}/v1/states"))
        .json(&batch)
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 200, "{}", reply.text().await.unwrap());
}

/// Every statement and the INSERTs among them, so far.
async fn sent(http: &reqwest::Client, base: &str) -> (f64, f64) {
    let counts = statements::by_operation(http, base).await;
    let inserts = ["history_record", "put"]
        .iter()
        .filter_map(|op| counts.get(*op))
        .sum();
    (counts.values().sum(), inserts)
}

/// One restore: its answer, its time and the statements it sent.
async fn restore(
    http: &reqwest::Client,
    base: &str,
    at: &str,
    dry_run: bool,
) -> (Value, f64, f64, f64) {
    let (before_all, before_inserts) = sent(http, base).await;
    let started = Instant::now();
    let reply = http
        .post(format!("{base}/v1/restore"))
        .json(&json!({"pattern": "restore:*", "at": at, "dry_run": dry_run, "reason": "bench"}))
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 200);
    let answer: Value = reply.json().await.unwrap();
    let secs = started.elapsed().as_secs_f64();
    let (all, inserts) = sent(http, base).await;
    (answer, secs, all - before_all, inserts - before_inserts)
}

#[tokio::main]
async fn main() {
    let url = std::env::var("STATEHOUSE_BENCH_CLICKHOUSE_URL")
        .expect("set STATEHOUSE_BENCH_CLICKHOUSE_URL (bench/run does)");
    let gateway = process::GatewayProcess::start(&url, &["--query-timeout", "60s"]).await;
    let http = reqwest::Client::new();
    let base = gateway.base.clone();
    import(&http, &base, 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let at = humantime::format_rfc3339_millis(SystemTime::now()).to_string();
    tokio::time::sleep(Duration::from_millis(50)).await;
    import(&http, &base, 2).await;

    for (name, dry_run) in [("dry run", true), ("restore", false), ("repeat", false)] {
        gateway.reset_peak();
        let (answer, secs, all, inserts) = restore(&http, &base, &at, dry_run).await;
        println!(
            "restore {STATES} ids, {name}: {secs:.2} s, {inserts} INSERTs, {all} statements in all \
             (restored {}, unchanged {}); gateway RSS peak {:.0} MiB, now {:.0} MiB",
            answer["restored"],
            answer["unchanged"],
            gateway.peak_rss_kib() as f64 / 1024.0,
            gateway.rss_kib() as f64 / 1024.0,
        );
        if !dry_run {
            assert!(inserts <= MAX_INSERTS, "{inserts} INSERTs: not batched");
        }
    }
}
