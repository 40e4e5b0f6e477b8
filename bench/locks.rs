//! Lock cycles (acquire + release) through the gateway: the first acquire on a
//! state_id (which runs the ClickHouse claim and its settle time) beside
//! the first acquire in keeper mode (a claim in Keeper, no settle) and
//! repeat acquires on the same gateway (which need no claim), the same repeat
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

const FIRST_ACQUIRES: usize = 8;
const REPEAT_CYCLES: usize = 300;
const PARALLEL_FOR: Duration = Duration::from_secs(4);

async fn cycle(http: &reqwest::Client, base: &str, id: &str) {
    let reply = http
        .post(format!("{base}/v1/locks/{id}"))
        .json(&json!({"owner": "bench", "ttl_seconds": 30, "wait_seconds": 30}))
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 201);
    let lease: Value = reply.json().await.unwrap();
    let lease_id = lease["lease_id"].as_str().unwrap();
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

#[tokio::main]
async fn main() {
    let gateway = support::start_gateway_in(&support::new_schema(), false, &[]).await;
    let (base, settle) = (gateway.base, gateway.config.locks.settle);
    let keeper =
        support::start_gateway_in(&support::new_schema(), false, &["--coordination", "keeper"])
            .await;
    let http = reqwest::Client::new();

    let mut first = Vec::new();
    let mut first_keeper = Vec::new();
    let mut repeat = Vec::new();
    for n in 0..FIRST_ACQUIRES {
        let id = format!("first-{n}");
        let t = Instant::now();
        cycle(&http, &base, &id).await;
        first.push(t.elapsed());
        let t = Instant::now();
        cycle(&http, &keeper.base, &id).await;
        first_keeper.push(t.elapsed());
        // Interleave: repeat cycles on the state_id whose claim is now held.
        for _ in 0..REPEAT_CYCLES / FIRST_ACQUIRES {
            let t = Instant::now();
            cycle(&http, &base, &id).await;
            repeat.push(t.elapsed());
        }
    }
    let (f50, f99) = (
        percentile_ms(&mut first, 0.5),
        percentile_ms(&mut first, 0.99),
    );
    let (k50, k99) = (
        percentile_ms(&mut first_keeper, 0.5),
        percentile_ms(&mut first_keeper, 0.99),
    );
    let (r50, r99) = (
        percentile_ms(&mut repeat, 0.5),
        percentile_ms(&mut repeat, 0.99),
    );

    println!("statehouse lock bench: acquire+release cycles, claim settle {settle:?}");
    println!("{:<34} {:>7} {:>9} {:>9}", "cycle", "n", "p50 ms", "p99 ms");
    println!(
        "{:<34} {:>7} {f50:>9.2} {f99:>9.2}",
        "first acquire, --coordination table",
        first.len()
    );
    println!(
        "{:<34} {:>7} {k50:>9.2} {k99:>9.2}",
        "first acquire, --coordination keeper",
        first_keeper.len()
    );
    println!(
        "{:<34} {:>7} {r50:>9.2} {r99:>9.2}",
        "repeat acquire, same gateway",
        repeat.len()
    );
    println!(
        "first / repeat p50: {:.1}x (the seed plugin pays its 1 s settle on every acquire)",
        f50 / r50
    );
    println!(
        "first acquire keeper / table p50: {:.3}x (goal: at most 0.25x; Keeper needs no settle)",
        k50 / f50
    );

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
