//! Gateway vs direct ClickHouse: p50/p99 latency and requests/s for reading and
//! writing one state, side by side in one run; PUT with history on beside a
//! gateway with history off; and listing the history of a state with 10,000
//! versions; GET over kept-alive HTTPS beside HTTP. Rounds interleave the workloads so that noise on a shared
//! machine hits all of them alike.
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
    let gateway = support::start_gateway_in(&support::new_schema(), false, &[]).await;
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
    let state_url = format!("{base}/v1/states/bench");
    http.put(&state_url).body(document(0)).send().await.unwrap();

    let gateway_get = get_op(&http, state_url.clone());
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
    let gateway_put = put_op(&http, state_url.clone());
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

    history_costs(&http, &base, &direct, &schema).await;
    https_costs(&http, &state_url, &schema).await;
}

/// GET one state over a kept-alive HTTPS connection beside plain HTTP: the
/// same state, a gateway with `--tls-cert-file` on the same database.
async fn https_costs(http: &reqwest::Client, state_url: &str, schema: &str) {
    let certs =
        std::env::temp_dir().join(format!("statehouse-bench-certs-{}", uuid::Uuid::new_v4()));
    let made =
        std::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/make-certs"))
            .arg(&certs)
            .status()
            .expect("scripts/make-certs runs (it needs openssl)");
    assert!(made.success());
    let file = |name: &str| certs.join(name).display().to_string();
    let (cert, key) = (file("gateway.pem"), file("gateway.key"));
    let tls = support::start_gateway_in(
        schema,
        false,
        &["--tls-cert-file", &cert, "--tls-key-file", &key],
    )
    .await;
    let ca = reqwest::Certificate::from_pem(&std::fs::read(file("ca.pem")).unwrap()).unwrap();
    let https = reqwest::Client::builder()
        .add_root_certificate(ca)
        .build()
        .unwrap();
    let get_http = get_op(http, state_url.to_owned());
    let get_https = get_op(&https, format!("{}/v1/states/bench", tls.base));
    // The handshake happens once, before measuring: the connection is kept alive.
    get_https(0).await;
    let (mut plain, mut secure) = (Samples::new(), Samples::new());
    for _ in 0..ROUNDS {
        measure(&mut plain, 1, PER_ROUND, get_http.clone()).await;
        measure(&mut secure, 1, PER_ROUND, get_https.clone()).await;
    }
    let _ = std::fs::remove_dir_all(&certs);
    let (p50, p99, s50, s99) = (
        plain.percentile_ms(0.5),
        plain.percentile_ms(0.99),
        secure.percentile_ms(0.5),
        secure.percentile_ms(0.99),
    );
    println!();
    println!(
        "GET one state, 1 client, kept-alive connection, {} each in {ROUNDS} interleaved rounds",
        ROUNDS * PER_ROUND
    );
    println!("{:<20} {:>9} {:>9}", "transport", "p50 ms", "p99 ms");
    println!("{:<20} {p50:>9.2} {p99:>9.2}", "HTTP");
    println!("{:<20} {s50:>9.2} {s99:>9.2}", "HTTPS (TLS 1.3)");
    println!("HTTPS / HTTP: p50 {:.2}x, p99 {:.2}x", s50 / p50, s99 / p99);
}

/// A PUT with history on beside one on a gateway with `--history=false`, and
/// history listings of a state with 10,000 versions.
async fn history_costs(http: &reqwest::Client, base: &str, direct: &Client, schema: &str) {
    let off = support::start_gateway_in(&support::new_schema(), false, &["--history=false"]).await;
    let put_on = put_op(http, format!("{base}/v1/states/history-on"));
    let put_off = put_op(http, format!("{}/v1/states/history-off", off.base));
    let (mut on, mut without) = (Samples::new(), Samples::new());
    for _ in 0..ROUNDS {
        measure(&mut on, 1, PER_ROUND, put_on.clone()).await;
        measure(&mut without, 1, PER_ROUND, put_off.clone()).await;
    }
    let (on50, on99) = (on.percentile_ms(0.5), on.percentile_ms(0.99));
    let (off50, off99) = (without.percentile_ms(0.5), without.percentile_ms(0.99));
    println!();
    println!(
        "PUT one state, 1 client, {} each in {ROUNDS} interleaved rounds",
        ROUNDS * PER_ROUND
    );
    println!("{:<20} {:>9} {:>9}", "history", "p50 ms", "p99 ms");
    println!("{:<20} {on50:>9.2} {on99:>9.2}", "on (one INSERT + view)");
    println!("{:<20} {off50:>9.2} {off99:>9.2}", "off (--history=false)");
    println!(
        "on / off: p50 {:.2}x, p99 {:.2}x",
        on50 / off50,
        on99 / off99
    );

    const VERSIONS: i64 = 10_000;
    let id = "deep-history";
    let reply = http
        .put(format!("{base}/v1/states/{id}"))
        .body(document(0))
        .send()
        .await
        .unwrap();
    assert!(reply.status().is_success());
    // The older versions go in at once, straight into the table, a second
    // apart before now (inside the retention, which drops older ones).
    let oldest_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
        - VERSIONS * 1000;
    let fill = format!(
        "INSERT INTO `{schema}`.`state_history` (state_id, version, operation, deleted, completed_state, partial_state, changed_streams, actor)
         SELECT {{id:String}}, fromUnixTimestamp64Milli(toInt64({{oldest:Int64}} + number * 1000)), 'put', 0, {{doc:String}}, '{{}}', ['stream_0'], 'bench'
         FROM numbers({{n:UInt64}})"
    );
    direct
        .query(&fill)
        .param("id", id)
        .param("doc", document(1))
        .param("oldest", oldest_ms)
        .param("n", VERSIONS - 1)
        .execute()
        .await
        .unwrap();
    let first_page = format!("{base}/v1/states/{id}/history?limit=100");
    let page: serde_json::Value = http
        .get(&first_page)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let cursor = page["next_cursor"].as_str().expect("more pages").to_owned();
    let pages = [
        ("newest 100", first_page.clone()),
        ("next 100 (cursor)", format!("{first_page}&cursor={cursor}")),
        (
            "newest 1000",
            format!("{base}/v1/states/{id}/history?limit=1000"),
        ),
    ];
    println!();
    println!(
        "history of a state with {VERSIONS} versions, 1 client, {} listings each",
        ROUNDS * 5
    );
    println!("{:<20} {:>9} {:>9}", "page", "p50 ms", "p99 ms");
    let mut cells: Vec<Samples> = pages.iter().map(|_| Samples::new()).collect();
    for _ in 0..ROUNDS {
        for ((_, url), cell) in pages.iter().zip(cells.iter_mut()) {
            measure(cell, 1, 5, get_op(http, url.clone())).await;
        }
    }
    for ((name, _), cell) in pages.iter().zip(cells.iter_mut()) {
        println!(
            "{name:<20} {:>9.2} {:>9.2}",
            cell.percentile_ms(0.5),
            cell.percentile_ms(0.99)
        );
    }
}

fn put_op(
    http: &reqwest::Client,
    url: String,
) -> Arc<impl Fn(usize) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync + 'static>
{
    let (http, url) = (http.clone(), Arc::new(url));
    Arc::new(move |n: usize| {
        let (http, url) = (http.clone(), url.clone());
        Box::pin(async move {
            let reply = http
                .put(url.as_str())
                .body(document(n))
                .send()
                .await
                .unwrap();
            assert!(reply.status().is_success());
            reply.bytes().await.unwrap();
        }) as std::pin::Pin<Box<dyn Future<Output = ()> + Send>>
    })
}

fn get_op(
    http: &reqwest::Client,
    url: String,
) -> Arc<impl Fn(usize) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync + 'static>
{
    let (http, url) = (http.clone(), Arc::new(url));
    Arc::new(move |_n: usize| {
        let (http, url) = (http.clone(), url.clone());
        Box::pin(async move {
            let reply = http.get(url.as_str()).send().await.unwrap();
            assert_eq!(reply.status(), 200);
            reply.bytes().await.unwrap();
        }) as std::pin::Pin<Box<dyn Future<Output = ()> + Send>>
    })
}
