//! Soak: mixed GET / PUT / lock-cycle traffic from many clients against a
//! gateway process for a fixed time (60 s by default, SOAK_SECONDS), on
//! loopback only. Prints throughput and latency per kind, errors, and the
//! gateway's resident memory over the run; exits non-zero on any unexpected
//! answer or if memory keeps growing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod process;

const CLIENTS: usize = 32;
const STATE_IDS: usize = 50;
const LOCK_IDS: usize = 10;

#[derive(Default)]
struct Tally {
    latencies: HashMap<&'static str, Vec<Duration>>,
    expected_refusals: HashMap<&'static str, usize>,
    unexpected: Vec<String>,
}

async fn client(
    http: reqwest::Client,
    base: String,
    n: usize,
    until: Instant,
    tally: Arc<Mutex<Tally>>,
) {
    let mut i = n;
    while Instant::now() < until {
        i += CLIENTS;
        let started = Instant::now();
        let (kind, outcome) = match i % 10 {
            0..=4 => {
                let r = http
                    .get(format!("{base}/v1/states/s{}", i % STATE_IDS))
                    .send()
                    .await;
                (
                    "GET state",
                    r.map(|r| {
                        (
                            r.status().as_u16(),
                            matches!(r.status().as_u16(), 200 | 404),
                        )
                    }),
                )
            }
            5..=7 => {
                let r = http
                    .put(format!("{base}/v1/states/s{}", (i / 10) % STATE_IDS))
                    .json(&json!({"completed": {"singer_state": {"n": i}}}))
                    .send()
                    .await;
                (
                    "PUT state",
                    r.map(|r| {
                        (
                            r.status().as_u16(),
                            matches!(r.status().as_u16(), 200 | 201),
                        )
                    }),
                )
            }
            _ => (
                "lock cycle",
                lock_cycle(&http, &base, i % LOCK_IDS, i).await,
            ),
        };
        let elapsed = started.elapsed();
        let mut tally = tally.lock().unwrap();
        match outcome {
            Ok((_, true)) => tally.latencies.entry(kind).or_default().push(elapsed),
            // An acquire that waited its 5 s out behind other clients: expected under contention.
            Ok((409, false)) if kind == "lock cycle" => {
                *tally.expected_refusals.entry(kind).or_default() += 1
            }
            Ok((status, false)) => tally.unexpected.push(format!("{kind}: {status}")),
            Err(err) => tally.unexpected.push(format!("{kind}: {err}")),
        }
    }
}

/// Acquire, write with the lease, release; answers the first status that is not a success.
async fn lock_cycle(
    http: &reqwest::Client,
    base: &str,
    lock: usize,
    i: usize,
) -> Result<(u16, bool), reqwest::Error> {
    let id = format!("locked-{lock}");
    let acquired = http
        .post(format!("{base}/v1/locks/{id}"))
        .json(&json!({"owner": format!("client-{i}"), "ttl_seconds": 30, "wait_seconds": 5}))
        .send()
        .await?;
    if acquired.status() != 201 {
        return Ok((acquired.status().as_u16(), false));
    }
    let lease: Value = acquired.json().await?;
    let lease_id = lease["lease_id"].as_str().unwrap_or_default().to_owned();
    let wrote = http
        .put(format!("{base}/v1/states/{id}"))
        .header("lease-id", &lease_id)
        .json(&json!({"completed": {"n": i}}))
        .send()
        .await?;
    let released = http
        .delete(format!("{base}/v1/locks/{id}/{lease_id}"))
        .send()
        .await?;
    match (wrote.status().as_u16(), released.status().as_u16()) {
        (200 | 201, 204) => Ok((204, true)),
        (200 | 201, other) | (other, _) => Ok((other, false)),
    }
}

fn percentile_ms(samples: &mut [Duration], p: f64) -> f64 {
    samples.sort();
    let rank = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples.get(rank).map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

#[tokio::main]
async fn main() {
    let url = std::env::var("STATEHOUSE_BENCH_CLICKHOUSE_URL")
        .expect("set STATEHOUSE_BENCH_CLICKHOUSE_URL (bench/run does)");
    let seconds: u64 = std::env::var("SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let gateway = process::GatewayProcess::start(&url, &[]).await;
    let base = gateway.base.clone();
    let http = reqwest::Client::new();
    // The high-water mark of the soak alone, from the memory resident once ready.
    gateway.reset_peak();

    let started = Instant::now();
    let until = started + Duration::from_secs(seconds);
    let tally = Arc::new(Mutex::new(Tally::default()));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|n| tokio::spawn(client(http.clone(), base.clone(), n, until, tally.clone())))
        .collect();
    let mut rss = vec![gateway.rss_kib()];
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_secs(5).min(until - Instant::now())).await;
        rss.push(gateway.rss_kib());
    }
    for c in clients {
        c.await.unwrap();
    }
    let elapsed = started.elapsed().as_secs_f64();
    // The samples can miss a short spike; the kernel's high-water mark cannot.
    let high_water = gateway.peak_rss_kib();
    drop(gateway);

    let mut tally = tally.lock().unwrap();
    println!(
        "statehouse soak: {CLIENTS} clients, {seconds} s, {STATE_IDS} state ids, {LOCK_IDS} lock ids"
    );
    println!(
        "{:<12} {:>8} {:>9} {:>9} {:>9}",
        "kind", "ok", "per s", "p50 ms", "p99 ms"
    );
    let mut kinds: Vec<_> = tally.latencies.keys().copied().collect();
    kinds.sort();
    for kind in kinds {
        let samples = tally.latencies.get_mut(kind).unwrap();
        let (count, p50, p99) = (
            samples.len(),
            percentile_ms(samples, 0.5),
            percentile_ms(samples, 0.99),
        );
        println!(
            "{kind:<12} {count:>8} {:>9.1} {p50:>9.2} {p99:>9.2}",
            count as f64 / elapsed
        );
    }
    for (kind, n) in &tally.expected_refusals {
        println!("{kind}: {n} acquires waited their 5 s out (409, expected under contention)");
    }
    let (first, peak, last) = (rss[0], *rss.iter().max().unwrap(), *rss.last().unwrap());
    println!(
        "gateway RSS KiB: start {first}, peak {peak}, end {last}, high-water mark {high_water}; samples {rss:?}"
    );
    println!("unexpected answers: {}", tally.unexpected.len());
    for line in tally.unexpected.iter().take(10) {
        println!("  {line}");
    }
    // Bounded: the second half of the run must not keep climbing past its first half's peak by much.
    let half = rss.len() / 2;
    let first_half_peak = *rss[..half.max(1)].iter().max().unwrap();
    let bounded = peak <= first_half_peak + first_half_peak / 4 + 8 * 1024;
    println!("RSS bounded: {bounded}");
    if !tally.unexpected.is_empty() || !bounded {
        std::process::exit(1);
    }
}
