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
//! The paths take turns: each round runs every path's window once, each
//! round starting one path later, and a ratio is taken within a round, of
//! windows seconds apart. On a shared machine a straight INSERT's p50 was
//! measured from 4.1 to 21.8 ms across runs: a ratio of windows minutes
//! apart measures the machine as much as the paths. The table shows each
//! path's windows pooled, and the median of the rounds' ratios.
//!
//! Run with `bench/run fleet` (it starts the local ClickHouse); or set
//! STATEHOUSE_BENCH_CLICKHOUSE_URL and run `cargo bench --bench fleet`.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clickhouse::Client;
use serde::Serialize;
use serde_json::Value;

mod statements;
mod support;

/// How long each cell runs, unless `STATEHOUSE_BENCH_SECONDS` says.
const FOR: Duration = Duration::from_secs(4);
/// How many turns each path takes, unless `STATEHOUSE_BENCH_ROUNDS` says.
const ROUNDS: usize = 3;

fn rounds() -> usize {
    std::env::var("STATEHOUSE_BENCH_ROUNDS")
        .map(|s| s.trim().parse().expect("STATEHOUSE_BENCH_ROUNDS: a count"))
        .unwrap_or(ROUNDS)
}

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

struct Cell {
    latencies: Vec<Duration>,
    took: Duration,
    inserts: f64,
    /// Every statement the gateway sent meanwhile.
    statements: f64,
}

impl Cell {
    fn percentile_ms(&self, p: f64) -> f64 {
        let mut latencies = self.latencies.clone();
        latencies.sort();
        let rank = ((latencies.len() as f64 - 1.0) * p).round() as usize;
        latencies[rank].as_secs_f64() * 1000.0
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

/// What the gateway has sent so far, from one read of its /metrics: its
/// INSERT statements (versions, which carry the states; states alone; lease
/// rows), and every statement of any kind (routing and row reads as well).
async fn sent(http: &reqwest::Client, base: &str) -> (f64, f64) {
    let counts = statements::by_operation(http, base).await;
    let inserts = ["history_record", "put", "lease_write"]
        .iter()
        .filter_map(|op| counts.get(*op))
        .sum();
    (inserts, counts.values().sum())
}

/// One write of a path: `write(writer, n)`.
type Write = Arc<dyn Fn(usize, usize) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

fn write_with<F, Fut>(write: F) -> Write
where
    F: Fn(usize, usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    Arc::new(move |w, n| Box::pin(write(w, n)))
}

/// A way to write, measured in turns.
struct Path {
    name: &'static str,
    write: Write,
    /// The gateway whose statements the path's writes cost, if any (else
    /// one statement per write).
    gateway: Option<String>,
    /// Each round's window.
    windows: Vec<Cell>,
}

impl Path {
    fn new(name: &'static str, write: Write, gateway: Option<&str>) -> Self {
        Path {
            name,
            write,
            gateway: gateway.map(str::to_owned),
            windows: Vec::new(),
        }
    }

    /// One window of `writers` writing for `length`, with what it cost.
    async fn turn(&mut self, http: &reqwest::Client, writers: usize, length: Duration) {
        let cell = match &self.gateway {
            Some(base) => {
                let (inserts_before, statements_before) = sent(http, base).await;
                let mut cell = run(writers, length, self.write.clone()).await;
                let (inserts, statements) = sent(http, base).await;
                cell.inserts = inserts - inserts_before;
                cell.statements = statements - statements_before;
                cell
            }
            None => {
                let mut cell = run(writers, length, self.write.clone()).await;
                cell.inserts = cell.latencies.len() as f64;
                cell.statements = cell.inserts;
                cell
            }
        };
        self.windows.push(cell);
    }

    /// Every window as one.
    fn pooled(&self) -> Cell {
        Cell {
            latencies: self
                .windows
                .iter()
                .flat_map(|w| w.latencies.iter().copied())
                .collect(),
            took: self.windows.iter().map(|w| w.took).sum(),
            inserts: self.windows.iter().map(|w| w.inserts).sum(),
            statements: self.windows.iter().map(|w| w.statements).sum(),
        }
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// `writers` loops of `write(writer, n)` for `cell`, all at once.
async fn run(writers: usize, cell: Duration, write: Write) -> Cell {
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
        "{:<8} {:<22} {:>9} {:>9} {:>9} {:>11} {:>9} {:>10} {:>10}",
        "writers",
        "path",
        "writes/s",
        "p50 ms",
        "p99 ms",
        "INSERT/wr",
        "stmt/wr",
        "x direct",
        "p50 x dir"
    );
    let fleet: Vec<usize> = std::env::var("STATEHOUSE_BENCH_WRITERS")
        .map(|w| w.split(',').map(|n| n.trim().parse().unwrap()).collect())
        .unwrap_or_else(|_| vec![1, 8, 64]);
    for writers in fleet {
        let unlocked = {
            let (http, base) = (http.clone(), base.clone());
            write_with(move |w: usize, n: usize| {
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
            write_with(move |w: usize, n: usize| {
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
            write_with(move |w: usize, n: usize| {
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
            write_with(move |w: usize, n: usize| {
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
            write_with(move |w: usize, n: usize| {
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
        // The ratios divide by the straight INSERTs, the fourth path.
        let mut paths = [
            Path::new("gateway, unlocked", unlocked, Some(&base)),
            Path::new("gateway, under lease", held, Some(&base)),
            Path::new("unlocked, history off", unlocked_quiet, Some(&quiet)),
            Path::new("straight INSERT", straight, None),
            Path::new("straight, into history", straight_history, None),
        ];
        let rounds = rounds();
        for round in 0..rounds {
            for turn in 0..paths.len() {
                let at = (round + turn) % paths.len();
                paths[at].turn(&http, writers, cell).await;
            }
        }
        let straight_windows = &paths[3].windows;
        let direct_rates: Vec<f64> = straight_windows.iter().map(Cell::per_second).collect();
        let direct_p50s: Vec<f64> = straight_windows
            .iter()
            .map(|w| w.percentile_ms(0.5))
            .collect();
        for path in &paths {
            let pooled = path.pooled();
            let rate_ratio = median(
                path.windows
                    .iter()
                    .zip(&direct_rates)
                    .map(|(w, direct)| w.per_second() / direct)
                    .collect(),
            );
            let p50_ratio = median(
                path.windows
                    .iter()
                    .zip(&direct_p50s)
                    .map(|(w, direct)| w.percentile_ms(0.5) / direct)
                    .collect(),
            );
            println!(
                "{writers:<8} {:<22} {:>9.0} {:>9.1} {:>9.1} {:>11.3} {:>9.3} {:>10.2} {:>10.2}",
                path.name,
                pooled.per_second(),
                pooled.percentile_ms(0.5),
                pooled.percentile_ms(0.99),
                pooled.inserts_per_write(),
                pooled.statements_per_write(),
                rate_ratio,
                p50_ratio,
            );
        }
    }
    println!(
        "INSERT/wr: ClickHouse INSERT statements per acknowledged write (lease rows included)"
    );
    println!("stmt/wr: every ClickHouse statement the gateway sent per acknowledged write");
    println!(
        "x direct, p50 x direct: writes/s and p50 against the straight single-row INSERTs of as many writers, in the same round (the median of {} rounds)",
        rounds()
    );
    println!(
        "straight, into history: the same INSERTs into the history table, as the gateway writes (three tables)"
    );
}
