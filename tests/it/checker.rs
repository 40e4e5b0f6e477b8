//! The lock checker that the concurrency tests share: N workers loop
//! acquire → (read the counter, write it + 1 with the lease) → renew →
//! release, each recording the interval it held the lease [after the 201,
//! before the DELETE]. The check: every cycle is there, no two intervals
//! overlap, fencing tokens rise in lease order, and the counter equals the
//! number of cycles. Other tests with workers of their own (lock_delay,
//! lock_faults, soak_mixed) record into the same log and run the same check.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use reqwest::StatusCode;
use serde_json::json;

use crate::api::retried;
use crate::helpers::Api;

/// What a worker saw while it held a lease: a sub-interval of the lease.
#[derive(Clone, Copy, Debug)]
pub struct Held {
    pub start: Instant,
    pub end: Instant,
    pub token: u64,
}

pub type Log = Arc<Mutex<Vec<Held>>>;

/// What a worker does while it holds the lease, besides renewing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    /// Read the counter and write it + 1: the gateways share one state table.
    Counter,
    /// Nothing: gateways on different ClickHouse nodes share only the locks.
    Nothing,
}

/// Runs `workers` workers of `cycles` cycles each on `id`, worker w through
/// `api_for(w)`, and checks them: with [`Work::Counter`] the counter, read
/// through `api_for(0)`, must be the number of cycles.
pub async fn run(
    api_for: impl Fn(usize) -> Api,
    id: &'static str,
    workers: usize,
    cycles: usize,
    work: Work,
) {
    let log: Log = Arc::default();
    let tasks: Vec<_> = (0..workers)
        .map(|w| {
            tokio::spawn(worker(
                api_for(w),
                id,
                format!("worker-{w}"),
                cycles,
                work,
                log.clone(),
            ))
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    if work == Work::Counter {
        assert_eq!(
            final_counter(&api_for(0), id).await,
            (workers * cycles) as u64
        );
    }
    check(&log, workers * cycles);
}

async fn worker(api: Api, id: &'static str, name: String, cycles: usize, work: Work, log: Log) {
    for _ in 0..cycles {
        // The wait is a give-up for a loaded machine, not a bound under test.
        let (lease, token) = api.lease(id, &name, 30, 240.0).await;
        let start = Instant::now();
        if work == Work::Counter {
            increment(&api, id, &lease, &name).await;
        }
        retried(|| api.renew(id, &lease, 30))
            .await
            .expect_because(StatusCode::OK, &name);
        let end = Instant::now();
        retried(|| api.release(id, &lease))
            .await
            .expect_because(StatusCode::NO_CONTENT, &name);
        log.lock().unwrap().push(Held { start, end, token });
    }
}

/// Reads the counter and writes it + 1 under `lease`, which must hold:
/// a 503 is asked again, a 409 fails.
pub async fn increment(api: &Api, id: &str, lease: &str, who: &str) {
    let read = retried(|| api.get_state(id)).await;
    let counter = match read.status {
        StatusCode::OK => read.json()["completed"]["counter"].as_u64().unwrap(),
        StatusCode::NOT_FOUND => 0,
        other => panic!("{who}: read failed: {other} {}", read.text),
    };
    let next = json!({"completed": {"counter": counter + 1}});
    let write = retried(|| api.put_state_with_lease(id, &next, lease)).await;
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
