//! Every lock claim, checked by concurrent workers and a checker: each worker
//! loops acquire → read counter → write counter+1 with its lease → renew →
//! release.
//! The final counter must equal the number of cycles, and no two leases may
//! overlap (from intervals recorded inside each lease).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::{
    Api, GatewayProcess, clickhouse_url, spawn_app, spawn_gateway_process, unique_schema,
};

/// What a worker saw while it held a lease: a sub-interval of the lease.
#[derive(Clone, Copy, Debug)]
pub struct Held {
    pub start: Instant,
    pub end: Instant,
    pub token: u64,
}

pub type Log = Arc<Mutex<Vec<Held>>>;

pub async fn worker(api: Api, id: &'static str, name: String, cycles: usize, log: Log) {
    for _ in 0..cycles {
        let (lease, token) = api.lease(id, &name, 30, 240.0).await;
        let start = Instant::now();
        increment(&api, id, &lease, &name).await;
        let renewed = api.renew(id, &lease, 30).await;
        assert_eq!(renewed.status, StatusCode::OK, "{name}: {}", renewed.text);
        let end = Instant::now();
        let released = api.release(id, &lease).await;
        assert_eq!(
            released.status,
            StatusCode::NO_CONTENT,
            "{name}: {}",
            released.text
        );
        log.lock().unwrap().push(Held { start, end, token });
    }
}

/// Reads the counter and writes it + 1 under `lease`, which must hold.
pub async fn increment(api: &Api, id: &str, lease: &str, who: &str) {
    let read = api.get_state(id).await;
    let counter = match read.status {
        StatusCode::OK => read.json()["completed"]["counter"].as_u64().unwrap(),
        StatusCode::NOT_FOUND => 0,
        other => panic!("{who}: read failed: {other} {}", read.text),
    };
    let write = api
        .put_state_with_lease(id, &json!({"completed": {"counter": counter + 1}}), lease)
        .await;
    assert!(write.status.is_success(), "{who}: {}", write.text);
}

/// The checker: intervals never overlap and tokens grow in lease order.
pub fn check(log: &Log, expected_cycles: usize) {
    let mut held = log.lock().unwrap().clone();
    assert_eq!(held.len(), expected_cycles);
    held.sort_by_key(|h| h.start);
    for pair in held.windows(2) {
        assert!(
            pair[0].end <= pair[1].start,
            "two leases overlapped: {:?} and {:?}",
            pair[0],
            pair[1]
        );
        assert!(
            pair[0].token < pair[1].token,
            "fencing tokens went backwards: {:?} then {:?}",
            pair[0],
            pair[1]
        );
    }
}

pub async fn final_counter(api: &Api, id: &str) -> u64 {
    api.get_state(id).await.json()["completed"]["counter"]
        .as_u64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_gateway_32_workers_25_cycles() {
    let app = spawn_app().await;
    let log: Log = Arc::default();
    let workers: Vec<_> = (0..32)
        .map(|w| {
            tokio::spawn(worker(
                app.api.clone(),
                "counter",
                format!("worker-{w}"),
                25,
                log.clone(),
            ))
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    assert_eq!(final_counter(&app, "counter").await, 800);
    check(&log, 800);
}

/// Claim timings short enough that hand-overs between the gateways happen
/// many times in one test; the mechanism is the one production runs.
const FAST_CLAIMS: [&str; 4] = ["--claim-settle", "200ms", "--claim-idle", "1s"];

/// Two gateway processes on one ClickHouse database, with claims of
/// `claim_ttl`: short where a gateway dies and its claims must lapse within
/// the test, else the production TTL (10 s), since on a loaded 2-core
/// machine a claim renewal alone can take a second or two.
async fn two_gateways(claim_ttl: &str) -> (GatewayProcess, GatewayProcess) {
    let schema = unique_schema();
    let mut args = vec!["--schema", schema.as_str(), "--claim-ttl", claim_ttl];
    args.extend(FAST_CLAIMS);
    let url = clickhouse_url();
    let a = spawn_gateway_process(&url, &args).await;
    let b = spawn_gateway_process(&url, &args).await;
    (a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_gateway_processes_share_one_clickhouse() {
    let (a, b) = two_gateways("10s").await;
    let log: Log = Arc::default();
    let mut workers = Vec::new();
    for w in 0..16 {
        let api = if w % 2 == 0 { a.api() } else { b.api() };
        workers.push(tokio::spawn(worker(
            api,
            "shared",
            format!("worker-{w}"),
            10,
            log.clone(),
        )));
    }
    for w in workers {
        w.await.unwrap();
    }
    assert_eq!(final_counter(&a.api(), "shared").await, 160);
    assert_eq!(final_counter(&b.api(), "shared").await, 160);
    check(&log, 160);
}

/// Without --advertise-url a gateway cannot be forwarded to; a crashed one's
/// claim still lapses and the other takes over, above its fencing tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_gateways_claim_expires_and_the_other_takes_over() {
    let (mut a, b) = two_gateways("3s").await;

    let (lease, token) = a.api().lease("job", "worker-on-a", 3, 0.0).await;
    let write = a
        .api()
        .put_state_with_lease("job", &json!({"completed": {"counter": 41}}), &lease)
        .await;
    assert!(write.status.is_success());
    a.child.kill().await.expect("kill -9");

    let (next, next_token) = b.api().lease("job", "worker-on-b", 30, 60.0).await;
    assert!(next_token > token, "{next_token} after {token}");
    assert_eq!(final_counter(&b.api(), "job").await, 41, "state intact");
    let late = b
        .api()
        .put_state_with_lease("job", &json!({"completed": {"counter": 0}}), &lease)
        .await;
    assert_eq!(
        late.problem_type(),
        "lease-not-current",
        "the dead gateway's lease ended with it"
    );
    let write = b
        .api()
        .put_state_with_lease("job", &json!({"completed": {"counter": 42}}), &next)
        .await;
    assert!(write.status.is_success());
    assert_eq!(final_counter(&b.api(), "job").await, 42);
}

#[tokio::test]
async fn a_worker_that_stops_renewing_loses_its_lease_and_its_late_write() {
    let app = spawn_app().await;
    app.put_state("job", &json!({"completed": {"counter": 7}}))
        .await;
    let (lease, _) = app.lease("job", "slow-worker", 1, 0.0).await;
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let late = app
        .put_state_with_lease("job", &json!({"completed": {"counter": 8}}), &lease)
        .await;
    assert_eq!(late.status, StatusCode::CONFLICT);
    assert_eq!(late.problem_type(), "lease-not-current");
    assert_eq!(
        final_counter(&app, "job").await,
        7,
        "the late write changed nothing"
    );
    let (next, _) = app.lease("job", "next-worker", 30, 0.0).await;
    let write = app
        .put_state_with_lease("job", &json!({"completed": {"counter": 8}}), &next)
        .await;
    assert!(write.status.is_success());
}
