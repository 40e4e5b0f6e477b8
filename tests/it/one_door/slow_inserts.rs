//! A slow ClickHouse costs time, not writes: INSERTs that take most of the
//! query timeout still succeed when many writers queue behind each other,
//! and an INSERT the gateway gave up on is seen by the next holder if it
//! lands after all.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;

use super::{ANY_INSERT, STATE_INSERT, served, stored};
use crate::proxy::spawn_app_behind_proxy;

/// Every other statement (routing reads, claims) must fit in it however
/// loaded the machine: with 2 s, beside other suites on 2 cores, a routing
/// read did not, and the test failed a product that was right.
const QUERY_TIMEOUT: Duration = Duration::from_secs(8);
/// The query timeout an INSERT is held past: long enough for the other
/// statements on a loaded machine, short enough to keep the test short.
const LATE_QUERY_TIMEOUT: Duration = Duration::from_secs(4);
const WRITERS: usize = 32;
const WRITES: u64 = 3;

/// One writer's id, with the lease it writes under (if any).
struct Writer {
    id: String,
    lease: Option<String>,
}

/// 32 writers, each on an id of its own, write n = 1, 2, 3 in a row while
/// every INSERT takes 0.6× the query timeout. A single write takes less
/// than the timeout, so each of them must succeed however long it queued.
async fn writers_behind_slow_inserts(leased: bool) {
    let (app, proxy) = spawn_app_behind_proxy(|config| {
        config.query_timeout = QUERY_TIMEOUT;
        // A write is admitted with the query timeout's worth of claim left:
        // the claim TTL keeps the production ratio to the timeout (10 s to 2 s).
        config.locks.claim_ttl = QUERY_TIMEOUT * 5;
    })
    .await;
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let id = format!("slow-{w}");
        // Longer than the writes take however loaded the machine (95 s
        // was seen beside other suites): the test releases them at the end.
        let lease = if leased {
            Some(app.lease(&id, &format!("writer-{w}"), 600, 0.0).await.0)
        } else {
            None
        };
        writers.push(Writer { id, lease });
    }

    proxy.hold_requests_containing(Some((ANY_INSERT, QUERY_TIMEOUT * 6 / 10)));
    let t0 = Instant::now();
    let tasks: Vec<_> = writers
        .iter()
        .map(|writer| {
            let (api, id, lease) = (app.api.clone(), writer.id.clone(), writer.lease.clone());
            tokio::spawn(async move {
                let mut replies = Vec::new();
                for n in 1..=WRITES {
                    let body = json!({"completed": {"n": n}});
                    let reply = match &lease {
                        Some(lease) => api.put_state_with_lease(&id, &body, lease).await,
                        None => api.put_state(&id, &body).await,
                    };
                    replies.push((n, reply));
                }
                replies
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.unwrap());
    }
    let took = t0.elapsed();
    proxy.hold_requests_containing(None);

    let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
    let mut first_failure = None;
    let mut unreadable = Vec::new();
    for (writer, replies) in writers.iter().zip(&outcomes) {
        let mut last_acknowledged = None;
        for (n, reply) in replies {
            *statuses.entry(reply.status.as_u16()).or_default() += 1;
            if reply.status.is_success() {
                last_acknowledged = Some(*n);
            } else if first_failure.is_none() {
                first_failure = Some(format!("{} write {n}: {}", writer.id, reply.text));
            }
        }
        // A later write of the same writer may replace an acknowledged
        // value, an earlier one never may.
        let stored_n = stored(&app.schema, &writer.id)
            .await
            .map(|c| c["n"].clone());
        let served_n = served(&app, &writer.id).await.map(|c| c["n"].clone());
        if let Some(acknowledged) = last_acknowledged {
            let holds = |n: &Option<serde_json::Value>| {
                n.as_ref()
                    .and_then(serde_json::Value::as_u64)
                    .is_some_and(|n| (acknowledged..=WRITES).contains(&n))
            };
            if !holds(&stored_n) || !holds(&served_n) {
                unreadable.push(format!(
                    "{}: acknowledged {acknowledged}, stored {stored_n:?}, served {served_n:?}",
                    writer.id
                ));
            }
        }
        if let Some(lease) = &writer.lease {
            let released = app.release(&writer.id, lease).await;
            released.expect(StatusCode::NO_CONTENT);
        }
    }
    let acknowledged: usize = statuses
        .iter()
        .filter(|(status, _)| (200..300).contains(*status))
        .map(|(_, count)| count)
        .sum();
    let mode = if leased { "under leases" } else { "unlocked" };
    println!(
        "{WRITERS} writers x {WRITES} {mode}, INSERTs held {:?} of a {QUERY_TIMEOUT:?} timeout: \
         {acknowledged} of {} acknowledged in {took:?}; statuses {statuses:?}; \
         {} acknowledged value(s) missing",
        QUERY_TIMEOUT * 6 / 10,
        WRITERS as u64 * WRITES,
        unreadable.len()
    );
    assert!(
        unreadable.is_empty(),
        "acknowledged values missing: {unreadable:?}"
    );
    assert_eq!(
        acknowledged as u64,
        WRITERS as u64 * WRITES,
        "statuses {statuses:?}; first failure: {}",
        first_failure.unwrap_or_default()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_write_of_32_unlocked_writers_succeeds_when_each_insert_takes_most_of_the_timeout() {
    writers_behind_slow_inserts(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_write_of_32_leased_writers_succeeds_when_each_insert_takes_most_of_the_timeout() {
    writers_behind_slow_inserts(true).await;
}

/// Worker 1's write under its lease reaches ClickHouse, whose INSERT then
/// waits for its rows 1.5× the query timeout: the gateway answers 503 and
/// the INSERT may still land. Worker 1 releases at once, and worker 2,
/// waiting through the same gateway (the authority), is granted. Whatever
/// worker 2 reads at its grant is what ClickHouse holds once everything has
/// settled: never an older state that a late INSERT replaces under it.
///
/// Only the body is held, so a real ClickHouse has the query (and its
/// query_id) from the start. The local ClickHouse reads a whole body before
/// it runs anything, so there the INSERT starts only when its rows arrive,
/// after the gateway gave up: a `max_execution_time` counted from the send
/// does not bound when it lands, which is the case this test is about.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_insert_that_times_out_at_the_gateway_and_lands_later_is_read_by_the_next_holder() {
    let (app, proxy) =
        spawn_app_behind_proxy(|config| config.query_timeout = LATE_QUERY_TIMEOUT).await;
    let id = "late";
    let seeded = app.put_state(id, &json!({"completed": {"n": 0}})).await;
    assert!(seeded.status.is_success(), "{}", seeded.text);
    let (lease, _) = app.lease(id, "worker-1", 30, 0.0).await;
    let t0 = Instant::now();
    let worker_2 = {
        let (api, schema) = (app.api.clone(), app.schema.clone());
        tokio::spawn(async move {
            let (lease, _) = api.lease(id, "worker-2", 30, 60.0).await;
            let granted = t0.elapsed();
            let read_stored = stored(&schema, id).await;
            let read_served = served(&api, id).await;
            (lease, granted, read_stored, read_served)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    let hold = LATE_QUERY_TIMEOUT * 3 / 2;
    proxy.hold_bodies_of_requests_containing(Some((STATE_INSERT, hold)));
    let write = app
        .put_state_with_lease(id, &json!({"completed": {"n": 1}}), &lease)
        .await;
    let answered = t0.elapsed();
    let released = app.release(id, &lease).await.status;
    let (_, granted, read_stored, read_served) = worker_2.await.unwrap();
    // The held INSERT has reached ClickHouse whole by now, and landed or not.
    tokio::time::sleep(hold + Duration::from_secs(2)).await;
    proxy.hold_bodies_of_requests_containing(None);
    let finally = stored(&app.schema, id).await;
    println!(
        "timed-out INSERT: write {} at {answered:?}; release {released}; worker 2 granted at \
         {granted:?} read {read_stored:?} (served {read_served:?}); ClickHouse finally holds {finally:?}",
        write.status
    );
    write.expect_because(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("the INSERT held {hold:?} was meant to time out at the gateway"),
    );
    assert_eq!(
        read_stored, finally,
        "worker 2 was granted before the timed-out INSERT's outcome was known"
    );
    assert_eq!(
        read_served, finally,
        "the authority served worker 2 a state that ClickHouse no longer holds"
    );
}
