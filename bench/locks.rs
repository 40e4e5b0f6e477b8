//! Lock cycles (acquire + release) through the gateway: the first acquire on a
//! fresh state_id (which makes the claim) in table and keeper mode, with one
//! gateway and with a second one joined, beside a single-row INSERT into the
//! same ClickHouse, and repeat acquires on the same gateway (which need no
//! claim); the same repeat
//! cycles on the id's authority beside those sent through a peer gateway
//! that forwards them (one hop more), and cycles/s with 1, 8 and 64
//! state_ids locked in parallel.
//!
//! Run with `bench/run` (it starts the local ClickHouse); or set
//! STATEHOUSE_BENCH_CLICKHOUSE_URL and run `cargo bench --bench locks`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod support;

const FIRST_ACQUIRES: usize = 20;
const REPEAT_CYCLES: usize = 300;
const PARALLEL_FOR: Duration = Duration::from_secs(4);

async fn cycle(http: &reqwest::Client, base: &str, id: &str) {
    let lease_id = acquire(http, base, id).await;
    release(http, base, id, &lease_id).await;
}

/// Acquires `id`, answering the lease's id.
async fn acquire(http: &reqwest::Client, base: &str, id: &str) -> String {
    let reply = http
        .post(format!("{base}/v1/locks/{id}"))
        .json(&json!({"owner": "bench", "ttl_seconds": 30, "wait_seconds": 30}))
        .send()
        .await
        .unwrap();
    let status = reply.status();
    let lease: Value = reply.json().await.unwrap();
    assert_eq!(status, 201, "{id}: {lease}");
    lease["lease_id"].as_str().unwrap().to_owned()
}

async fn release(http: &reqwest::Client, base: &str, id: &str, lease_id: &str) {
    let released = http
        .delete(format!("{base}/v1/locks/{id}/{lease_id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(released.status(), 204);
}

fn percentile_ms(samples: &mut [Duration], p: f64) -> f64 {
    samples.sort();
    let rank = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[rank].as_secs_f64() * 1000.0
}

/// Cycles/s with one looping worker per state_id, all at once.
async fn parallel(http: &reqwest::Client, base: &str, run: &str, ids: usize) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    // Each state_id's claim is taken first, so the figure is the steady state.
    for n in 0..ids {
        cycle(http, base, &format!("{run}-{ids}-{n}")).await;
    }
    let started = Instant::now();
    let workers: Vec<_> = (0..ids)
        .map(|n| {
            let (http, base, done) = (http.clone(), base.to_owned(), done.clone());
            let id = format!("{run}-{ids}-{n}");
            tokio::spawn(async move {
                while started.elapsed() < PARALLEL_FOR {
                    cycle(&http, &base, &id).await;
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

/// Repeat cycles on one id, alternating between its authority and a peer
/// that forwards to it, so that both see the same noise.
async fn authority_and_peer(http: &reqwest::Client) -> (Vec<Duration>, Vec<Duration>) {
    let schema = support::new_schema();
    let authority = support::start_gateway_in(&schema, true, &[]).await;
    let peer = support::start_gateway_in(&schema, true, &[]).await;
    let id = "forwarded";
    // The first cycle, through the authority, makes it the id's authority.
    cycle(http, &authority.base, id).await;
    let (mut direct, mut forwarded) = (Vec::new(), Vec::new());
    for _ in 0..REPEAT_CYCLES {
        let t = Instant::now();
        cycle(http, &authority.base, id).await;
        direct.push(t.elapsed());
        let t = Instant::now();
        cycle(http, &peer.base, id).await;
        forwarded.push(t.elapsed());
    }
    (direct, forwarded)
}

/// The latencies of one row of the first-acquire table.
#[derive(Default)]
struct Line(Vec<Duration>);

impl Line {
    fn print(&mut self, name: &str) {
        let (p50, p99) = (
            percentile_ms(&mut self.0, 0.5),
            percentile_ms(&mut self.0, 0.99),
        );
        println!("{name:<44} {:>5} {p50:>9.2} {p99:>9.2}", self.0.len());
    }

    fn median_ms(&mut self) -> f64 {
        percentile_ms(&mut self.0, 0.5)
    }
}

/// One first acquire on a fresh id, timed, and its release (untimed: the
/// authority answers it from memory).
async fn first_cycle(http: &reqwest::Client, base: &str, id: &str, line: &mut Line) {
    let t = Instant::now();
    let lease_id = acquire(http, base, id).await;
    line.0.push(t.elapsed());
    release(http, base, id, &lease_id).await;
}

/// A single-row INSERT straight into ClickHouse, timed: the floor a first
/// acquire is measured against.
async fn insert(direct: &clickhouse::Client, table: &str, n: usize, line: &mut Line) {
    let t = Instant::now();
    direct
        .query(&format!("INSERT INTO {table} VALUES ('insert-{n}')"))
        .execute()
        .await
        .unwrap();
    line.0.push(t.elapsed());
}

/// The first acquire on fresh ids through gateway `a` of each mode, and a
/// single-row INSERT, interleaved so that all see the same noise.
async fn first_acquires(
    http: &reqwest::Client,
    (table, keeper): (&str, &str),
    direct: &clickhouse::Client,
    (insert_table, run): (&str, &str),
) -> (Line, Line, Line) {
    let (mut t, mut k, mut i) = (Line::default(), Line::default(), Line::default());
    for n in 0..FIRST_ACQUIRES {
        let id = format!("first-{run}-{n}");
        first_cycle(http, table, &id, &mut t).await;
        first_cycle(http, keeper, &id, &mut k).await;
        insert(direct, insert_table, n, &mut i).await;
    }
    (t, k, i)
}

#[tokio::main]
async fn main() {
    let (table_schema, keeper_schema) = (support::new_schema(), support::new_schema());
    let gateway = support::start_gateway_in(&table_schema, false, &[]).await;
    let (base, settle, target) = (
        gateway.base,
        gateway.config.locks.settle,
        gateway.config.clickhouse,
    );
    let keeper_flags = ["--coordination", "keeper"];
    let keeper = support::start_gateway_in(&keeper_schema, false, &keeper_flags).await;
    let http = reqwest::Client::new();
    let direct = clickhouse::Client::default()
        .with_url(target.endpoint())
        .with_user(&target.user)
        .with_password(&target.password)
        .with_setting("async_insert", "0");
    let insert_table = format!("`{table_schema}`.`bench_insert`");
    direct
        .query(&format!(
            "CREATE TABLE {insert_table} (id String) ENGINE = MergeTree ORDER BY id"
        ))
        .execute()
        .await
        .unwrap();
    // A gateway makes no claim for one settle after it joins (docs/gateways.md).
    tokio::time::sleep(settle * 2).await;

    let (mut t1, mut k1, mut i1) = first_acquires(
        &http,
        (&base, &keeper.base),
        &direct,
        (&insert_table, "alone"),
    )
    .await;
    // A second gateway on each mode's tables, joined before the next round.
    let _second_table = support::start_gateway_in(&table_schema, false, &[]).await;
    let _second_keeper = support::start_gateway_in(&keeper_schema, false, &keeper_flags).await;
    tokio::time::sleep(settle * 2).await;
    let (mut t2, mut k2, mut i2) = first_acquires(
        &http,
        (&base, &keeper.base),
        &direct,
        (&insert_table, "two"),
    )
    .await;

    println!(
        "statehouse lock bench: acquires (each released after, untimed), claim settle {settle:?}"
    );
    println!("{:<44} {:>5} {:>9} {:>9}", "cycle", "n", "p50 ms", "p99 ms");
    i1.0.append(&mut i2.0);
    i1.print("single-row INSERT into ClickHouse");
    t1.print("first acquire, table, one gateway");
    t2.print("first acquire, table, two gateways");
    k1.print("first acquire, keeper, one gateway");
    k2.print("first acquire, keeper, two gateways");
    println!(
        "first acquire / INSERT p50, one gateway: table {:.1}x, keeper {:.1}x",
        t1.median_ms() / i1.median_ms(),
        k1.median_ms() / i1.median_ms()
    );

    let mut repeat = Line::default();
    for n in 0..REPEAT_CYCLES {
        let id = format!("first-two-{}", n % FIRST_ACQUIRES);
        first_cycle(&http, &base, &id, &mut repeat).await;
    }
    repeat.print("repeat acquire, same gateway (table)");

    let (mut direct, mut forwarded) = authority_and_peer(&http).await;
    let (d50, d99) = (
        percentile_ms(&mut direct, 0.5),
        percentile_ms(&mut direct, 0.99),
    );
    let (p50, p99) = (
        percentile_ms(&mut forwarded, 0.5),
        percentile_ms(&mut forwarded, 0.99),
    );
    println!();
    println!("two gateways on one ClickHouse, repeat cycles on one state_id, interleaved");
    println!("{:<34} {:>7} {:>9} {:>9}", "cycle", "n", "p50 ms", "p99 ms");
    println!(
        "{:<34} {:>7} {d50:>9.2} {d99:>9.2}",
        "on the authority",
        direct.len()
    );
    println!(
        "{:<34} {:>7} {p50:>9.2} {p99:>9.2}",
        "through a peer (forwarded)",
        forwarded.len()
    );
    println!(
        "forwarded / authority p50: {:.2}x ({:+.2} ms for the hop: 2 requests, each forwarded once)",
        p50 / d50,
        p50 - d50
    );

    println!();
    println!("{:<34} {:>9}", "state_ids locked in parallel", "cycles/s");
    for ids in [1, 8, 64] {
        let rate = parallel(&http, &base, "par", ids).await;
        println!("{ids:<34} {rate:>9.1}");
    }
}
