//! What recording a run adds to a `statehouse lock` cycle: `statehouse lock
//! ID -- true` (the runner's process, its lease, the run's POST and PATCH,
//! the release) beside the same with `--no-run`, interleaved on one gateway
//! so that both see the same noise, median and p90 side by side; then the
//! gateway's ClickHouse statements per cycle of each, by operation.
//!
//! Run with `bench/run runs` (it starts the local ClickHouse and builds the
//! release binary); or set STATEHOUSE_BENCH_CLICKHOUSE_URL (and
//! STATEHOUSE_BIN) and run `cargo bench --bench runs`.

use std::collections::{BTreeSet, HashMap};
use std::process::Command;
use std::time::{Duration, Instant};

use statehouse::store::History;

mod statements;
mod support;

const CYCLES: usize = 100;
/// Cycles of each kind whose statements are counted (one kind at a time).
const COUNTED: usize = 10;

/// One `statehouse lock ID [FLAGS] -- true`, timed from spawn to exit.
fn cycle(binary: &str, base: &str, id: &str, flags: &[&str]) -> Duration {
    let t = Instant::now();
    let status = Command::new(binary)
        .args(["lock", "--url", base])
        .args(flags)
        .args([id, "--", "true"])
        .env_remove("STATEHOUSE_TOKEN")
        .env_remove("MELTANO_STATE_BACKEND_URI")
        .status()
        .expect("the release binary exists (bench/run builds it)");
    let took = t.elapsed();
    assert!(status.success(), "statehouse lock {flags:?}: {status}");
    took
}

fn percentile_ms(samples: &mut [Duration], p: f64) -> f64 {
    samples.sort();
    let rank = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[rank].as_secs_f64() * 1000.0
}

/// The statements per cycle of `COUNTED` cycles with `flags`, by operation.
async fn statements_per_cycle(
    http: &reqwest::Client,
    binary: &str,
    base: &str,
    flags: &'static [&'static str],
) -> HashMap<String, f64> {
    let before = statements::by_operation(http, base).await;
    let (binary, base_owned) = (binary.to_owned(), base.to_owned());
    tokio::task::spawn_blocking(move || {
        for _ in 0..COUNTED {
            cycle(&binary, &base_owned, "job", flags);
        }
    })
    .await
    .unwrap();
    let after = statements::by_operation(http, base).await;
    after
        .into_iter()
        .map(|(op, n)| {
            let per = (n - before.get(&op).copied().unwrap_or(0.0)) / COUNTED as f64;
            (op, per)
        })
        .filter(|(_, per)| *per > 0.0)
        .collect()
}

#[tokio::main]
async fn main() {
    let binary =
        std::env::var("STATEHOUSE_BIN").unwrap_or_else(|_| "target/release/statehouse".into());
    let gateway = support::start_gateway_in(&support::new_schema(), false, &[]).await;
    // A run's record reads history (its versions and bookmarks moved).
    let history = match gateway.config.history {
        History::Off => "off",
        History::Kept(_) => "on",
    };
    let base = gateway.base;
    // The runner is a process of its own: run it off the gateway's threads.
    let (timed_binary, timed_base) = (binary.clone(), base.clone());
    let (mut recorded, mut quiet) = tokio::task::spawn_blocking(move || {
        // The id's claim and tables are warm before anything is timed.
        cycle(&timed_binary, &timed_base, "job", &[]);
        let (mut recorded, mut quiet) = (Vec::new(), Vec::new());
        for _ in 0..CYCLES {
            recorded.push(cycle(&timed_binary, &timed_base, "job", &[]));
            quiet.push(cycle(&timed_binary, &timed_base, "job", &["--no-run"]));
        }
        (recorded, quiet)
    })
    .await
    .unwrap();
    let (r50, r90) = (
        percentile_ms(&mut recorded, 0.5),
        percentile_ms(&mut recorded, 0.9),
    );
    let (q50, q90) = (
        percentile_ms(&mut quiet, 0.5),
        percentile_ms(&mut quiet, 0.9),
    );
    println!(
        "statehouse lock ID -- true, one gateway (history {history}), {CYCLES} cycles each, interleaved"
    );
    println!("{:<34} {:>9} {:>9}", "cycle", "p50 ms", "p90 ms");
    println!("{:<34} {q50:>9.2} {q90:>9.2}", "--no-run (no run recorded)");
    println!("{:<34} {r50:>9.2} {r90:>9.2}", "run recorded (the default)");
    println!(
        "recorded / --no-run: p50 {:.2}x ({:+.2} ms), p90 {:.2}x ({:+.2} ms)",
        r50 / q50,
        r50 - q50,
        r90 / q90,
        r90 - q90
    );

    let http = reqwest::Client::new();
    let quiet = statements_per_cycle(&http, &binary, &base, &["--no-run"]).await;
    let recorded = statements_per_cycle(&http, &binary, &base, &[]).await;
    let operations: BTreeSet<&String> = quiet.keys().chain(recorded.keys()).collect();
    println!();
    println!("ClickHouse statements per cycle, {COUNTED} cycles of each");
    println!("{:<34} {:>9} {:>9}", "operation", "--no-run", "recorded");
    for op in operations {
        let (q, r) = (
            quiet.get(op).copied().unwrap_or(0.0),
            recorded.get(op).copied().unwrap_or(0.0),
        );
        println!("{op:<34} {q:>9.1} {r:>9.1}");
    }
    println!(
        "{:<34} {:>9.1} {:>9.1}",
        "all",
        quiet.values().sum::<f64>(),
        recorded.values().sum::<f64>()
    );
}
