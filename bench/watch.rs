//! Watching against polling: 1,000 clients over three gateways on one
//! ClickHouse follow 50 states while a writer changes one of them every
//! 200 ms, through each gateway in turn. First as long-polls
//! (`?wait=30s` with `If-None-Match`), then as clients that GET once a
//! second. Prints, side by side from one run, the delay from a write's
//! answer to each client seeing its ETag (p50, p90, p99; the contract says
//! 1 s at p90 across gateways, which no test asserts) and the ClickHouse
//! statements per second of the three gateways together (the writer's
//! included, the same in both).
//!
//! Run with `bench/run watch` (it starts the local ClickHouse); or set
//! STATEHOUSE_BENCH_CLICKHOUSE_URL and run `cargo bench --bench watch`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;

mod statements;
mod support;

/// Clients following states, spread over the gateways.
const CLIENTS: usize = 1000;
/// States they follow: twenty clients each.
const IDS: usize = 50;
/// How often the writer changes a state.
const WRITE_EVERY: Duration = Duration::from_millis(200);
/// How long each way of following runs.
const FOR: Duration = Duration::from_secs(15);
/// How often a polling client asks.
const POLL_EVERY: Duration = Duration::from_secs(1);

/// What one way of following saw.
struct Run {
    /// From a write's answer to a client seeing its ETag, one per sighting.
    delays: Vec<Duration>,
    /// ClickHouse statements per second, all gateways.
    statements: f64,
    /// Answers that were neither 200 nor 304.
    errors: usize,
}

/// When each (state, ETag) was written, and when clients saw them: joined
/// at the end, since a client may see a change before its writer's answer
/// arrives.
#[derive(Default)]
struct Sightings {
    written: HashMap<(usize, String), Instant>,
    seen: Vec<(usize, String, Instant)>,
    errors: usize,
}

impl Sightings {
    fn delays(&self) -> Vec<Duration> {
        let mut delays: Vec<Duration> = self
            .seen
            .iter()
            .filter_map(|(id, etag, at)| {
                let written = self.written.get(&(*id, etag.clone()))?;
                Some(at.saturating_duration_since(*written))
            })
            .collect();
        delays.sort();
        delays
    }
}

fn state_id(n: usize) -> String {
    format!("watch-bench-{n}")
}

fn document(n: usize) -> serde_json::Value {
    json!({"completed": {"singer_state": {"bookmarks": {"orders": {
        "replication_key": "updated_at", "replication_key_value": n}}}}})
}

fn etag_of(reply: &reqwest::Response) -> String {
    reply.headers()["etag"].to_str().unwrap().to_owned()
}

/// Every statement the gateways have sent ClickHouse so far.
async fn statements(http: &reqwest::Client, bases: &[String]) -> f64 {
    let mut total = 0.0;
    for base in bases {
        total += statements::by_operation(http, base)
            .await
            .values()
            .sum::<f64>();
    }
    total
}

/// Changes one state every `WRITE_EVERY` for `FOR`, through each gateway
/// in turn, noting when each ETag was answered. A refused write (503) is
/// counted and sent again, as every client does.
async fn write(http: reqwest::Client, bases: Arc<Vec<String>>, log: Arc<Mutex<Sightings>>) {
    let started = Instant::now();
    let mut n = 0;
    while started.elapsed() < FOR {
        let (id, base) = (n % IDS, &bases[n % bases.len()]);
        let reply = http
            .put(format!("{base}/v1/states/{}", state_id(id)))
            .json(&document(n))
            .send()
            .await
            .unwrap();
        let status = reply.status();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            log.lock().unwrap().errors += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        assert!(
            status.is_success(),
            "{status}: {}",
            reply.text().await.unwrap()
        );
        let etag = etag_of(&reply);
        log.lock()
            .unwrap()
            .written
            .insert((id, etag), Instant::now());
        n += 1;
        tokio::time::sleep_until((started + WRITE_EVERY * n as u32).into()).await;
    }
}

/// One client: long-polls its state until `FOR` has passed (each wait
/// lasting to the end, so a client asks again only after a change), noting each
/// new ETag. Clients start spread over the first second; a refused first
/// read is counted and asked again.
async fn long_poll(
    http: reqwest::Client,
    url: String,
    id: usize,
    offset: Duration,
    log: Arc<Mutex<Sightings>>,
) {
    let started = Instant::now();
    tokio::time::sleep(offset).await;
    let mut etag = loop {
        let reply = http.get(&url).send().await.unwrap();
        if reply.status() == StatusCode::OK {
            break etag_of(&reply);
        }
        log.lock().unwrap().errors += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    while let Some(left) = FOR.checked_sub(started.elapsed()) {
        let reply = http
            .get(format!("{url}?wait={}ms", left.as_millis().max(1)))
            .header("if-none-match", &etag)
            .send()
            .await
            .unwrap();
        match reply.status() {
            StatusCode::OK => {
                etag = etag_of(&reply);
                log.lock()
                    .unwrap()
                    .seen
                    .push((id, etag.clone(), Instant::now()));
            }
            StatusCode::NOT_MODIFIED => {}
            _ => {
                log.lock().unwrap().errors += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// One client: GETs its state once a second until `FOR` has passed,
/// noting each new ETag. Clients start spread over the first second.
async fn poll(
    http: reqwest::Client,
    url: String,
    id: usize,
    offset: Duration,
    log: Arc<Mutex<Sightings>>,
) {
    let started = Instant::now();
    tokio::time::sleep(offset).await;
    let mut etag = String::new();
    let mut tick = tokio::time::interval(POLL_EVERY);
    while started.elapsed() < FOR {
        tick.tick().await;
        let reply = http.get(&url).send().await.unwrap();
        if reply.status() != StatusCode::OK {
            log.lock().unwrap().errors += 1;
            continue;
        }
        let now = etag_of(&reply);
        if now != etag && !etag.is_empty() {
            log.lock()
                .unwrap()
                .seen
                .push((id, now.clone(), Instant::now()));
        }
        etag = now;
    }
}

/// Runs the writer beside `CLIENTS` clients made by `client`.
async fn follow<F, Fut>(http: &reqwest::Client, bases: &Arc<Vec<String>>, client: F) -> Run
where
    F: Fn(String, usize, Duration, Arc<Mutex<Sightings>>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let log = Arc::new(Mutex::new(Sightings::default()));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (id, base) = (c % IDS, &bases[c % bases.len()]);
            let url = format!("{base}/v1/states/{}", state_id(id));
            let offset = POLL_EVERY * (c as u32) / CLIENTS as u32;
            tokio::spawn(client(url, id, offset, log.clone()))
        })
        .collect();
    // Every client has made its first read before anything changes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = statements(http, bases).await;
    let started = Instant::now();
    write(http.clone(), bases.clone(), log.clone()).await;
    for client in clients {
        client.await.unwrap();
    }
    let statements = (statements(http, bases).await - before) / started.elapsed().as_secs_f64();
    let log = log.lock().unwrap();
    Run {
        delays: log.delays(),
        statements,
        errors: log.errors,
    }
}

fn percentile_ms(delays: &[Duration], p: f64) -> f64 {
    if delays.is_empty() {
        return f64::NAN;
    }
    let rank = ((delays.len() as f64 - 1.0) * p).round() as usize;
    delays[rank].as_secs_f64() * 1000.0
}

#[tokio::main]
async fn main() {
    let schema = support::new_schema();
    let mut bases = Vec::new();
    let mut endpoint = String::new();
    for _ in 0..3 {
        let gateway = support::start_gateway_in(&schema, true, &[]).await;
        endpoint = gateway.config.clickhouse.endpoint().to_string();
        bases.push(gateway.base);
    }
    let bases = Arc::new(bases);
    let http = reqwest::Client::new();
    for id in 0..IDS {
        let reply = http
            .put(format!("{}/v1/states/{}", bases[0], state_id(id)))
            .json(&document(0))
            .send()
            .await
            .unwrap();
        assert!(reply.status().is_success(), "{}", reply.status());
    }

    let watched = follow(&http, &bases, |url, id, offset, log| {
        long_poll(http.clone(), url, id, offset, log)
    })
    .await;
    let polled = follow(&http, &bases, |url, id, offset, log| {
        poll(http.clone(), url, id, offset, log)
    })
    .await;

    println!(
        "statehouse watch bench: {CLIENTS} clients on {IDS} states over 3 gateways, \
         a write every {WRITE_EVERY:?} for {FOR:?}, on {endpoint}"
    );
    println!(
        "{:<28} {:>10} {:>10} {:>10} {:>10} {:>11} {:>7}",
        "clients", "sightings", "p50 ms", "p90 ms", "p99 ms", "stmts/s", "errors"
    );
    for (name, run) in [
        ("long-poll (?wait=)", &watched),
        ("GET once a second", &polled),
    ] {
        println!(
            "{name:<28} {:>10} {:>10.0} {:>10.0} {:>10.0} {:>11.1} {:>7}",
            run.delays.len(),
            percentile_ms(&run.delays, 0.5),
            percentile_ms(&run.delays, 0.9),
            percentile_ms(&run.delays, 0.99),
            run.statements,
            run.errors
        );
    }
    println!(
        "stmts/s: ClickHouse statements per second of the three gateways together, \
         the writer's {:.0}/s included; long-poll over polling: {:.2}x the statements",
        1.0 / WRITE_EVERY.as_secs_f64(),
        watched.statements / polled.statements
    );
}
