//! Gateway vs direct ClickHouse: p50/p99 latency and requests/s for reading and
//! writing one state, side by side in one run. Rounds interleave the workloads
//! so that noise on a shared machine hits all of them alike.
//!
//! Run with `bench/run` (it starts the local ClickHouse); or set
//! STATEHOUSE_BENCH_CLICKHOUSE_URL and run `cargo bench --bench gateway`.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clickhouse::Client;
use serde::{Deserialize, Serialize};

mod support;

const ROUNDS: usize = 10;
const PER_ROUND: usize = 50;
const CONCURRENCY: usize = 8;

#[derive(clickhouse::Row, Deserialize)]
struct Row {
    partial_state: Option<String>,
    completed_state: Option<String>,
    updated_at_ms: i64,
}

#[derive(clickhouse::Row, Serialize)]
struct RowOut {
    state_id: String,
    partial_state: Option<String>,
    completed_state: Option<String>,
    updated_at: i64,
}

struct Samples {
    latencies: Vec<Duration>,
    busy: Duration,
}

impl Samples {
    fn new() -> Self {
        Self {
            latencies: Vec::new(),
            busy: Duration::ZERO,
        }
    }

    fn percentile_ms(&mut self, p: f64) -> f64 {
        self.latencies.sort();
        let rank = ((self.latencies.len() as f64 - 1.0) * p).round() as usize;
        self.latencies[rank].as_secs_f64() * 1000.0
    }

    fn per_second(&self) -> f64 {
        self.latencies.len() as f64 / self.busy.as_secs_f64()
    }
}

/// Runs `op` `count` times from `clients` concurrent callers; records each latency.
async fn measure<F, Fut>(samples: &mut Samples, clients: usize, count: usize, op: Arc<F>)
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|client| {
            let op = op.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                for n in (client..count).step_by(clients) {
                    let t = Instant::now();
                    op(n).await;
                    latencies.push(t.elapsed());
                }
                latencies
            })
        })
        .collect();
    for task in tasks {
        samples.latencies.extend(task.await.unwrap());
    }
    samples.busy += started.elapsed();
}

fn document(n: usize) -> String {
    let streams: Vec<String> = (0..20)
        .map(|s| format!(r#""stream_{s}":{{"replication_key":"updated_at","replication_key_value":"2026-11-{:02}T00:00:{:02}Z"}}"#, s % 28 + 1, n % 60))
        .collect();
    format!(
        r#"{{"completed":{{"singer_state":{{"bookmarks":{{{}}}}}}}}}"#,
        streams.join(",")
    )
}

#[tokio::main]
async fn main() {
    let gateway = support::start_gateway_in(&support::new_schema(), false).await;
    let (base, target) = (gateway.base, gateway.config.clickhouse);
    let schema = gateway.config.schema.as_str().to_owned();
    let http = reqwest::Client::new();
    let direct = Client::default()
        .with_url(target.endpoint())
        .with_user(&target.user)
        .with_password(&target.password)
        .with_setting("async_insert", "0");
    let table = format!("`{schema}`.`state`");
    let select = Arc::new(format!(
        "SELECT partial_state, completed_state, toUnixTimestamp64Milli(updated_at) AS updated_at_ms FROM {table} FINAL WHERE state_id = {{id:String}} LIMIT 1"
    ));
    let state_url = Arc::new(format!("{base}/v1/states/bench"));
    http.put(state_url.as_str())
        .body(document(0))
        .send()
        .await
        .unwrap();

    let gateway_get = Arc::new({
        let (http, url) = (http.clone(), state_url.clone());
        move |_n: usize| {
            let (http, url) = (http.clone(), url.clone());
            async move {
                let reply = http.get(url.as_str()).send().await.unwrap();
                assert_eq!(reply.status(), 200);
                reply.bytes().await.unwrap();
            }
        }
    });
    let direct_get = Arc::new({
        let (direct, select) = (direct.clone(), select.clone());
        move |_n: usize| {
            let (direct, select) = (direct.clone(), select.clone());
            async move {
                let row = direct
                    .query(&select)
                    .param("id", "bench")
                    .fetch_optional::<Row>()
                    .await
                    .unwrap();
                let row = row.expect("the state exists");
                assert!(row.completed_state.is_some() && row.partial_state.is_some());
            }
        }
    });
    let gateway_put = Arc::new({
        let (http, url) = (http.clone(), state_url.clone());
        move |n: usize| {
            let (http, url) = (http.clone(), url.clone());
            async move {
                let reply = http
                    .put(url.as_str())
                    .body(document(n))
                    .send()
                    .await
                    .unwrap();
                assert!(reply.status().is_success());
                reply.bytes().await.unwrap();
            }
        }
    });
    // What a PUT costs in ClickHouse: read the current version, insert the next.
    let direct_put = Arc::new({
        let (direct, select, table) = (direct.clone(), select.clone(), table.clone());
        move |n: usize| {
            let (direct, select, table) = (direct.clone(), select.clone(), table.clone());
            async move {
                let current = direct
                    .query(&select)
                    .param("id", "direct")
                    .fetch_optional::<Row>()
                    .await
                    .unwrap();
                let version = current.map_or(0, |row| row.updated_at_ms + 1);
                let mut insert = direct.insert_unescaped::<RowOut>(&table).await.unwrap();
                insert
                    .write(&RowOut {
                        state_id: "direct".into(),
                        partial_state: Some("{}".into()),
                        completed_state: Some(document(n)),
                        updated_at: version.max(1),
                    })
                    .await
                    .unwrap();
                insert.end().await.unwrap();
            }
        }
    });

    let names = ["GET one state", "PUT one state"];
    let mut results: Vec<[[Samples; 2]; 2]> = Vec::new();
    for clients in [1, CONCURRENCY] {
        let mut cell = [
            [Samples::new(), Samples::new()],
            [Samples::new(), Samples::new()],
        ];
        for _ in 0..ROUNDS {
            measure(&mut cell[0][0], clients, PER_ROUND, gateway_get.clone()).await;
            measure(&mut cell[0][1], clients, PER_ROUND, direct_get.clone()).await;
            measure(&mut cell[1][0], clients, PER_ROUND, gateway_put.clone()).await;
            measure(&mut cell[1][1], clients, PER_ROUND, direct_put.clone()).await;
        }
        results.push(cell);
    }

    println!(
        "statehouse bench: {} ops per cell in {ROUNDS} interleaved rounds; ClickHouse at {}",
        ROUNDS * PER_ROUND,
        target.endpoint()
    );
    println!(
        "{:<15} {:>7} | {:>9} {:>9} {:>9} | {:>9} {:>9} {:>9} | {:>9} {:>9}",
        "workload",
        "clients",
        "gw p50ms",
        "gw p99ms",
        "gw req/s",
        "ch p50ms",
        "ch p99ms",
        "ch req/s",
        "p50 x",
        "req/s x"
    );
    for (cell, clients) in results.iter_mut().zip([1, CONCURRENCY]) {
        for (row, name) in cell.iter_mut().zip(names) {
            let [gateway, direct] = row;
            let (g50, g99, gps) = (
                gateway.percentile_ms(0.5),
                gateway.percentile_ms(0.99),
                gateway.per_second(),
            );
            let (d50, d99, dps) = (
                direct.percentile_ms(0.5),
                direct.percentile_ms(0.99),
                direct.per_second(),
            );
            println!(
                "{name:<15} {clients:>7} | {g50:>9.2} {g99:>9.2} {gps:>9.0} | {d50:>9.2} {d99:>9.2} {dps:>9.0} | {:>9.2} {:>9.2}",
                g50 / d50,
                gps / dps
            );
        }
    }
    println!(
        "gw = through statehouse over HTTP; ch = the same queries sent straight to ClickHouse"
    );
    println!("(PUT direct = read the current version + insert, what the gateway does for a PUT)");
    println!("p50 x = gateway p50 / direct p50; req/s x = gateway req/s / direct req/s");
}
