//! A mixed soak (issue 28): three gateways on one database, each reaching
//! ClickHouse through a proxy whose latency comes in bursts, and six
//! workers that run lock cycles on one counter (lock, read, write +1 under
//! the lease, unlock) with PUT, PATCH and bulk imports, through the gateway
//! that granted or another. Some leases are left to expire, and an admin
//! force-unlocks every few seconds. The checker: no two acknowledged
//! holders wrote the same value or held the lock at once, and the counter
//! ends between the acknowledged increments and those plus the ambiguous.
//!
//! `STATEHOUSE_SOAK_SECONDS` sets how long it runs: 20 s by default, ten
//! rounds of the force-unlocks and latency bursts, so that `scripts/test`
//! stays within CI's time; a longer soak is one variable away.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use statehouse::domain::Coordination;

use crate::checker::{Held, Log, check};
use crate::helpers::{
    Api, Reply, TestApp, encode_id, peer_config, raw_sql, spawn_configured, unique_schema,
};
use crate::one_door::STATE_INSERT;
use crate::proxy::Proxy;

const ID: &str = "soak";
const GATEWAYS: usize = 3;
const WORKERS: usize = 6;
/// ClickHouse latency, one step every 1.5 s, each proxy a step apart from
/// the others: a delay on every chunk (reads and lock traffic too) ...
const DELAY_MS: [u64; 6] = [0, 100, 0, 300, 50, 0];
/// ... and a longer one on state INSERTs alone, so that leases end, by
/// expiry or force-unlock, with writes on their way.
const INSERT_HOLD_MS: [u64; 6] = [0, 800, 0, 1500, 300, 1000];
const FORCE_UNLOCK_EVERY: Duration = Duration::from_secs(2);

fn soak_duration() -> Duration {
    let seconds = std::env::var("STATEHOUSE_SOAK_SECONDS")
        .ok()
        .map(|s| s.parse().expect("STATEHOUSE_SOAK_SECONDS is whole seconds"))
        .unwrap_or(20);
    Duration::from_secs(seconds)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Put,
    Patch,
    Import,
}

/// One acknowledged write: the value it wrote, who wrote it, and a stretch
/// of time inside its lease (from the grant's answer to the write's send,
/// or to its answer when a release accepted after it shows the lease stood).
struct Ack {
    value: u64,
    worker: usize,
    kind: Kind,
    held: Held,
}

#[derive(Default)]
struct Record {
    acks: Mutex<Vec<Ack>>,
    cycles: AtomicU64,
    refused: AtomicU64,
    /// Writes answered 5xx: they may have landed.
    ambiguous: AtomicU64,
    left_to_expire: AtomicU64,
    force_unlocks: AtomicU64,
}

/// Three gateways on one database, each behind its own proxy.
async fn cluster(coordination: Coordination) -> (Vec<TestApp>, Vec<Proxy>, String) {
    let schema = unique_schema();
    let (mut apps, mut proxies) = (Vec::new(), Vec::new());
    for _ in 0..GATEWAYS {
        let proxy = Proxy::to_clickhouse().await;
        let mut config = peer_config(&schema);
        proxy.route(&mut config);
        config.locks.coordination = coordination;
        apps.push(spawn_configured(config).await);
        proxies.push(proxy);
    }
    (apps, proxies, schema)
}

async fn write(api: &Api, kind: Kind, value: u64, lease: &str) -> Reply {
    let path = format!("/v1/states/{}", encode_id(ID));
    let doc = json!({"completed": {"counter": value}}).to_string();
    match kind {
        Kind::Put => {
            api.request(Method::PUT, &path, Some(&doc), &[("lease-id", lease)])
                .await
        }
        Kind::Patch => {
            api.request(Method::PATCH, &path, Some(&doc), &[("lease-id", lease)])
                .await
        }
        Kind::Import => {
            let batch =
                json!([{"state_id": ID, "completed": {"counter": value}, "lease_id": lease}]);
            api.request(Method::POST, "/v1/states", Some(&batch.to_string()), &[])
                .await
        }
    }
}

/// Lock cycles until `until`. Cycle n is granted by gateway (w + n) % 3;
/// imports, and every other PUT and PATCH, go through the next gateway.
async fn worker(apis: Vec<Api>, w: usize, until: Instant, record: Arc<Record>) {
    let mut n = 0usize;
    while Instant::now() < until {
        n += 1;
        let granting = &apis[(w + n) % GATEWAYS];
        let other = &apis[(w + n + 1) % GATEWAYS];
        // Every seventh lease is short and never released: it expires.
        let leave_to_expire = n % 7 == 3;
        let ttl = if leave_to_expire { 1 } else { 3 };
        let acquired = granting
            .acquire(
                ID,
                &json!({"owner": format!("worker-{w}"), "ttl_seconds": ttl, "wait_seconds": 20}),
            )
            .await;
        match acquired.status {
            StatusCode::CREATED => {}
            // Waited out, or the authority was out of reach for a moment.
            StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            other => panic!("worker-{w}: acquire got {other}: {}", acquired.text),
        }
        let start = Instant::now();
        record.cycles.fetch_add(1, Ordering::SeqCst);
        let body = acquired.json();
        let lease = body["lease_id"].as_str().unwrap().to_owned();
        let token = body["fencing_token"].as_u64().unwrap();
        let read = granting.get_state(ID).await;
        let counter = match read.status {
            StatusCode::OK => read.json()["completed"]["counter"].as_u64(),
            StatusCode::NOT_FOUND => Some(0),
            StatusCode::SERVICE_UNAVAILABLE => None,
            other => panic!("worker-{w}: read got {other}: {}", read.text),
        };
        let mut written = None;
        if let Some(counter) = counter {
            let kind = [Kind::Put, Kind::Patch, Kind::Import][n % 3];
            let through = if kind == Kind::Import || n.is_multiple_of(2) {
                other
            } else {
                granting
            };
            let sent = Instant::now();
            let reply = write(through, kind, counter + 1, &lease).await;
            let answered = Instant::now();
            if reply.status.is_success() {
                written = Some((kind, counter + 1, sent, answered));
            } else if reply.status == StatusCode::CONFLICT {
                record.refused.fetch_add(1, Ordering::SeqCst);
            } else if reply.status.is_server_error() {
                record.ambiguous.fetch_add(1, Ordering::SeqCst);
            } else {
                panic!("worker-{w}: {kind:?} got {}: {}", reply.status, reply.text);
            }
        }
        let released = if leave_to_expire {
            record.left_to_expire.fetch_add(1, Ordering::SeqCst);
            false
        } else {
            granting.release(ID, &lease).await.status == StatusCode::NO_CONTENT
        };
        if let Some((kind, value, sent, answered)) = written {
            let end = if released { answered } else { sent };
            record.acks.lock().unwrap().push(Ack {
                value,
                worker: w,
                kind,
                held: Held { start, end, token },
            });
        }
    }
}

/// Ends the lease on the counter, whoever holds it, every few seconds,
/// through each gateway in turn.
async fn admin(apis: Vec<Api>, until: Instant, record: Arc<Record>) {
    let path = format!("/v1/locks/{}", encode_id(ID));
    let mut n = 0;
    while Instant::now() + FORCE_UNLOCK_EVERY < until {
        tokio::time::sleep(FORCE_UNLOCK_EVERY).await;
        let unlocked = apis[n % GATEWAYS]
            .request(Method::DELETE, &path, None, &[])
            .await;
        assert!(
            unlocked.status == StatusCode::NO_CONTENT
                || unlocked.status == StatusCode::SERVICE_UNAVAILABLE,
            "force-unlock got {}: {}",
            unlocked.status,
            unlocked.text
        );
        record.force_unlocks.fetch_add(1, Ordering::SeqCst);
        n += 1;
    }
}

/// The counter as ClickHouse holds it, read past every gateway.
async fn stored_counter(schema: &str) -> u64 {
    let row = raw_sql(&format!(
        "SELECT completed_state FROM `{schema}`.state FINAL WHERE state_id = '{ID}' FORMAT JSONEachRow"
    ))
    .await;
    let Some(line) = row.lines().next() else {
        return 0;
    };
    let row: Value = serde_json::from_str(line).unwrap();
    let doc: Value = serde_json::from_str(row["completed_state"].as_str().unwrap()).unwrap();
    doc["counter"].as_u64().unwrap()
}

async fn soak(coordination: Coordination) {
    let (apps, proxies, schema) = cluster(coordination).await;
    let apis: Vec<Api> = apps.iter().map(|app| app.api.clone()).collect();
    let length = soak_duration();
    let until = Instant::now() + length;
    let record = Arc::new(Record::default());

    let done = Arc::new(AtomicBool::new(false));
    let proxies = Arc::new(proxies);
    let bursts = {
        let (done, proxies) = (done.clone(), proxies.clone());
        tokio::spawn(async move {
            let mut step = 0;
            while !done.load(Ordering::SeqCst) {
                for (p, proxy) in proxies.iter().enumerate() {
                    let at = (step + p) % DELAY_MS.len();
                    proxy.set_delay(Duration::from_millis(DELAY_MS[at]));
                    let hold = Duration::from_millis(INSERT_HOLD_MS[at]);
                    proxy.hold_requests_containing(
                        (!hold.is_zero()).then_some((STATE_INSERT, hold)),
                    );
                }
                step += 1;
                tokio::time::sleep(Duration::from_millis(1500)).await;
            }
            for proxy in proxies.iter() {
                proxy.set_delay(Duration::ZERO);
                proxy.hold_requests_containing(None);
            }
        })
    };
    let admin = tokio::spawn(admin(apis.clone(), until, record.clone()));
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| tokio::spawn(worker(apis.clone(), w, until, record.clone())))
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    admin.await.unwrap();
    done.store(true, Ordering::SeqCst);
    bursts.await.unwrap();
    // Leases left to expire, and writes whose outcome was unknown, settle.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let counter = stored_counter(&schema).await;
    let acks = std::mem::take(&mut *record.acks.lock().unwrap());
    let acknowledged = acks.len() as u64;
    let ambiguous = record.ambiguous.load(Ordering::SeqCst);
    let mut by_kind: BTreeMap<Kind, usize> = BTreeMap::new();
    let mut by_value: BTreeMap<u64, Vec<&Ack>> = BTreeMap::new();
    for ack in &acks {
        *by_kind.entry(ack.kind).or_default() += 1;
        by_value.entry(ack.value).or_default().push(ack);
    }
    let doubled: Vec<String> = by_value
        .iter()
        .filter(|(_, acks)| acks.len() > 1)
        .map(|(value, acks)| {
            let writers: Vec<_> = acks
                .iter()
                .map(|a| format!("worker-{} {:?} token {}", a.worker, a.kind, a.held.token))
                .collect();
            format!("{value} by {}", writers.join(" and "))
        })
        .collect();
    println!(
        "soak {coordination:?} for {length:?}: {} cycles, {acknowledged} acknowledged {by_kind:?}, \
         {} refused, {ambiguous} ambiguous, {} left to expire, {} force-unlocks; counter {counter}; \
         {} value(s) written by two acknowledged holders",
        record.cycles.load(Ordering::SeqCst),
        record.refused.load(Ordering::SeqCst),
        record.left_to_expire.load(Ordering::SeqCst),
        record.force_unlocks.load(Ordering::SeqCst),
        doubled.len(),
    );
    assert!(acknowledged > 0, "no write got through at all");
    assert!(
        doubled.is_empty(),
        "values written by two acknowledged holders (lost updates): {:?}",
        &doubled[..doubled.len().min(3)]
    );
    assert!(
        (acknowledged..=acknowledged + ambiguous).contains(&counter),
        "counter {counter} against {acknowledged} acknowledged increments ({ambiguous} ambiguous)"
    );
    let held: Log = Arc::new(Mutex::new(acks.iter().map(|ack| ack.held).collect()));
    check(&held, acks.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mixed_soak_in_table_mode_loses_no_acknowledged_increment() {
    soak(Coordination::Table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mixed_soak_in_keeper_mode_loses_no_acknowledged_increment() {
    soak(Coordination::Keeper).await;
}
