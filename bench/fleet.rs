//! A fleet of writers, each on its own state_id: W = 1, 8 and 64 writers
//! through the gateway, unlocked and under a lease held on the gateway, and
//! unlocked through a gateway with `--history=false`,
//! beside the same writers sending single-row INSERTs straight to
//! ClickHouse: into the state table, and into the history table as the
//! gateway writes it (whose views write the state table and the change
//! feed: three tables). Prints writes/s, p50/p99 and ClickHouse INSERT statements
//! per acknowledged write (from the gateway's own /metrics), with the
//! ratios, all from one run.
//!
//! Run with `bench/run fleet` (it starts the local ClickHouse); or set
//! STATEHOUSE_BENCH_CLICKHOUSE_URL and run `cargo bench --bench fleet`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clickhouse::Client;
use serde::Serialize;
use serde_json::Value;

mod statements;
mod support;

/// How long each cell runs, unless `STATEHOUSE_BENCH_SECONDS` says.
const FOR: Duration = Duration::from_secs(4);

fn cell_length() -> Duration {
    std::env::var("STATEHOUSE_BENCH_SECONDS")
        .map(|s| {
            Duration::from_secs(
                s.trim()
                    .parse()
                    .expect("STATEHOUSE_BENCH_SECONDS: whole seconds"),
            )
        })
        .unwrap_or(FOR)
}

#[derive(clickhouse::Row, Serialize)]
struct RowOut {
    state_id: String,
    partial_state: Option<String>,
    completed_state: Option<String>,
    updated_at: i64,
}

/// A history row as the gateway writes one (`store::history_table`).
#[derive(clickhouse::Row, Serialize)]
struct HistoryRowOut {
    state_id: String,
    version: i64,
    operation: &'static str,
    deleted: u8,
    completed_state: Option<String>,
    partial_state: Option<String>,
    changed_streams: Vec<String>,
    regressed_streams: Vec<String>,
    lost_streams: Vec<String>,
    actor: &'static str,
    lease_owner: &'static str,
    fencing_token: u64,
    request_id: String,
    user_agent: &'static str,
}

#[derive(Default)]
struct Cell {
    latencies: Vec<Duration>,
    took: Duration,
    inserts: f64,
    /// Every statement the gateway sent meanwhile.
    statements: f64,
}

impl Cell {
    fn percentile_ms(&mut self, p: f64) -> f64 {
        self.latencies.sort();
        let rank = ((self.latencies.len() as f64 - 1.0) * p).round() as usize;
        self.latencies[rank].as_secs_f64() * 1000.0
    }

    fn per_second(&self) -> f64 {
        self.latencies.len() as f64 / self.took.as_secs_f64()
    }

    fn inserts_per_write(&self) -> f64 {
        self.inserts / self.latencies.len() as f64
    }

    fn statements_per_write(&self) -> f64 {
        self.statements / self.latencies.len() as f64
    }
}

fn document(n: usize) -> String {
    format!(
        r#"{{"completed": {{"singer_state": {{"bookmarks": {{"orders": {{"replication_key": "updated_at", "replication_key_value": "{n}"}}}}}}}}}}"#
    )
}

/// INSERT statements the gateway has sent so far: versions (which carry
/// the states), states alone, and lease rows.
async fn inserts(http: &reqwest::Client, base: &str) -> f64 {
    let counts = statements::by_operation(http, base).await;
    ["history_record", "put", "lease_write"]
        .iter()
        .filter_map(|op| counts.get(*op))
        .sum()
}

/// Every ClickHouse statement the gateway has sent so far, of any kind:
/// reads (routing, the current row) as well as INSERTs.
async fn statements(http: &reqwest::Client, base: &str) -> f64 {
    statements::by_operation(http, base).await.values().sum()
}

/// `writers` loops of `write(writer, n)` for `cell`, all at once.
async fn run<F, Fut>(writers: usize, cell: Duration, write: Arc<F>) -> Cell
where
    F: Fn(usize, usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let (write, latencies) = (write.clone(), latencies.clone());
            tokio::spawn(async move {
                let mut n = 0;
                while started.elapsed() < cell {
                    let t = Instant::now();
                    write(w, n).await;
                    latencies.lock().unwrap().push(t.elapsed());
                    n += 1;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let latencies = std::mem::take(&mut *latencies.lock().unwrap());
    Cell {
        latencies,
        took: started.elapsed(),
        inserts: 0.0,
        statements: 0.0,
    }
}

#[tokio::main]
async fn main() {
    let gateway = support::start_gateway_in(&support::new_schema(), false, &[]).await;
    // The same unlocked writes with no history: one table written, as the
    // straight INSERTs write (history's view is a second).
    let quiet = support::start_gateway_in(&support::new_schema(), false, &["--history=false"])
        .await
        .base;
    let (base, target) = (gateway.base, gateway.config.clickhouse);
    let schema = gateway.config.schema.as_str().to_owned();
    let http = reqwest::Client::new();
    let direct = Client::default()
        .with_url(target.endpoint())
        .with_user(&target.user)
        .with_password(&target.password)
        .with_setting("async_insert", "0");
    let table = format!("`{schema}`.`state`");
    let history_table = format!("`{schema}`.`state_history`");

    let cell = cell_length();
    println!("statehouse fleet bench: each writer on its own state_id, {cell:?} per cell");
    println!(
        "{:<8} {:<22} {:>9} {:>9} {:>9} {:>11} {:>9} {:>10}",
        "writers", "path", "writes/s", "p50 ms", "p99 ms", "INSERT/wr", "stmt/wr", "x direct"
    );
    let fleet: Vec<usize> = std::env::var("STATEHOUSE_BENCH_WRITERS")
        .map(|w| w.split(',').map(|n| n.trim().parse().unwrap()).collect())
        .unwrap_or_else(|_| vec![1, 8, 64]);
    for writers in fleet {
        let unlocked = {
            let (http, base) = (http.clone(), base.clone());
            Arc::new(move |w: usize, n: usize| {
                let (http, url) = (
                    http.clone(),
                    format!("{base}/v1/states/fleet-open-{writers}-{w}"),
                );
                async move {
                    let reply = http.put(url).body(document(n)).send().await.unwrap();
                    assert!(reply.status().is_success(), "{}", reply.status());
                }
            })
        };
        let unlocked_quiet = {
            let (http, base) = (http.clone(), quiet.clone());
            Arc::new(move |w: usize, n: usize| {
                let (http, url) = (
                    http.clone(),
                    format!("{base}/v1/states/fleet-quiet-{writers}-{w}"),
                );
                async move {
                    let reply = http.put(url).body(document(n)).send().await.unwrap();
                    assert!(reply.status().is_success(), "{}", reply.status());
                }
            })
        };
        // Each writer holds a lease on its id, as a pipeline under
        // `statehouse lock` does, and writes with it.
        let mut leases = Vec::new();
        for w in 0..writers {
            let reply: Value = http
                .post(format!("{base}/v1/locks/fleet-held-{writers}-{w}"))
                .json(&serde_json::json!({"owner": "bench", "ttl_seconds": 600}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let lease = reply["lease_id"].as_str();
            leases.push(
                lease
                    .unwrap_or_else(|| panic!("no lease: {reply}"))
                    .to_owned(),
            );
        }
        let leases = Arc::new(leases);
        let held = {
            let (http, base) = (http.clone(), base.clone());
            Arc::new(move |w: usize, n: usize| {
                let (http, leases) = (http.clone(), leases.clone());
                let url = format!("{base}/v1/states/fleet-held-{writers}-{w}");
                async move {
                    let reply = http
                        .put(url)
                        .header("lease-id", leases[w].as_str())
                        .body(document(n))
                        .send()
                        .await
                        .unwrap();
                    assert!(reply.status().is_success(), "{}", reply.status());
                }
            })
        };
        let straight = {
            let (direct, table) = (direct.clone(), table.clone());
            Arc::new(move |w: usize, n: usize| {
                let (direct, table) = (direct.clone(), table.clone());
                async move {
                    let mut insert = direct.insert_unescaped::<RowOut>(&table).await.unwrap();
                    insert
                        .write(&RowOut {
                            state_id: format!("fleet-direct-{writers}-{w}"),
                            partial_state: Some("{}".into()),
                            completed_state: Some(document(n)),
                            updated_at: i64::try_from(n).unwrap() + 1,
                        })
                        .await
                        .unwrap();
                    insert.end().await.unwrap();
                }
            })
        };
        let straight_history = {
            let (direct, table) = (direct.clone(), history_table.clone());
            Arc::new(move |w: usize, n: usize| {
                let (direct, table) = (direct.clone(), table.clone());
                async move {
                    let mut insert = direct
                        .insert_unescaped::<HistoryRowOut>(&table)
                        .await
                        .unwrap();
                    insert
                        .write(&HistoryRowOut {
                            state_id: format!("fleet-direct-history-{writers}-{w}"),
                            // Now, as the gateway stamps: the history's TTL
                            // would find an early version long expired.
                            version: i64::try_from(
                                std::time::SystemTime::UNIX_EPOCH
                                    .elapsed()
                                    .unwrap()
                                    .as_millis(),
                            )
                            .unwrap(),
                            operation: "put",
                            deleted: 0,
                            completed_state: Some(document(n)),
                            partial_state: Some("{}".into()),
                            changed_streams: vec!["orders".into()],
                            regressed_streams: Vec::new(),
                            lost_streams: Vec::new(),
                            actor: "bench",
                            lease_owner: "",
                            fencing_token: 0,
                            request_id: format!("{w}-{n}"),
                            user_agent: "bench",
                        })
                        .await
                        .unwrap();
                    insert.end().await.unwrap();
                }
            })
        };
        let before = (inserts(&http, &base).await, statements(&http, &base).await);
        let mut open = run(writers, cell, unlocked).await;
        let middle = (inserts(&http, &base).await, statements(&http, &base).await);
        let mut leased = run(writers, cell, held).await;
        let after = (inserts(&http, &base).await, statements(&http, &base).await);
        (open.inserts, open.statements) = (middle.0 - before.0, middle.1 - before.1);
        (leased.inserts, leased.statements) = (after.0 - middle.0, after.1 - middle.1);
        let quiet_before = (
            inserts(&http, &quiet).await,
            statements(&http, &quiet).await,
        );
        let mut open_quiet = run(writers, cell, unlocked_quiet).await;
        (open_quiet.inserts, open_quiet.statements) = (
            inserts(&http, &quiet).await - quiet_before.0,
            statements(&http, &quiet).await - quiet_before.1,
        );
        let mut direct_cell = run(writers, cell, straight).await;
        direct_cell.inserts = direct_cell.latencies.len() as f64;
        direct_cell.statements = direct_cell.inserts;
        let direct_rate = direct_cell.per_second();
        let mut history_cell = run(writers, cell, straight_history).await;
        history_cell.inserts = history_cell.latencies.len() as f64;
        history_cell.statements = history_cell.inserts;
        for (name, cell) in [
            ("gateway, unlocked", &mut open),
            ("gateway, under lease", &mut leased),
            ("unlocked, history off", &mut open_quiet),
            ("straight INSERT", &mut direct_cell),
            ("straight, into history", &mut history_cell),
        ] {
            let (p50, p99, rate) = (
                cell.percentile_ms(0.5),
                cell.percentile_ms(0.99),
                cell.per_second(),
            );
            println!(
                "{writers:<8} {name:<22} {rate:>9.0} {p50:>9.1} {p99:>9.1} {:>11.3} {:>9.3} {:>10.2}",
                cell.inserts_per_write(),
                cell.statements_per_write(),
                rate / direct_rate
            );
        }
    }
    println!(
        "INSERT/wr: ClickHouse INSERT statements per acknowledged write (lease rows included)"
    );
    println!("stmt/wr: every ClickHouse statement the gateway sent per acknowledged write");
    println!("x direct: writes/s against the straight single-row INSERTs of as many writers");
    println!(
        "straight, into history: the same INSERTs into the history table, as the gateway writes (three tables)"
    );
}
