//! A lease outlives a coordination outage shorter than itself: Keeper down,
//! or the authority's link to ClickHouse cut, for 14 s, longer than the
//! production claim TTL (10 s, used here as it is). The authority lives on,
//! so its claim lapses but nobody else claims the id: its renewals and
//! writes answer 503 meanwhile, never 409, and once coordination is back it
//! re-wins the claim and the lease renews, writes and releases. A competitor
//! through the other gateway is never granted in between. If the other
//! gateway did claim the id (the authority out of its reach too), the old
//! lease is dead: 409, and its late write is refused.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;
use statehouse::config::parse_clickhouse_url;
use statehouse::domain::Coordination;

use crate::api::{retried, retried_for};
use crate::checker::{Held, Log, check, final_counter};
use crate::helpers::{
    Api, ClosedPort, TestApp, clickhouse_url, peer_config, spawn_configured, unique_schema,
};
use crate::keeper_loss::KeeperNode;
use crate::proxy::Proxy;

/// Longer than the claim TTL, shorter than the lease's.
const OUTAGE: Duration = Duration::from_secs(14);
const LEASE_TTL: u64 = 60;
/// How long after the outage the lease must renew again.
const RECOVERY: Duration = Duration::from_secs(40);

/// A gateway with the production claim TTL, advertising its address (or,
/// with `unreachable`, a port nobody listens on: a gateway its peers cannot
/// reach).
async fn gateway(
    schema: &str,
    coordination: Coordination,
    clickhouse: &str,
    proxy: Option<&Proxy>,
    unreachable: Option<&ClosedPort>,
) -> TestApp {
    let mut config = peer_config(schema);
    config.clickhouse = parse_clickhouse_url(clickhouse).unwrap();
    config.locks.coordination = coordination;
    config.locks.claim_ttl = Duration::from_secs(10);
    if let Some(proxy) = proxy {
        proxy.route(&mut config);
    }
    if let Some(closed) = unreachable {
        config.locks.advertise_url = Some(closed.url());
    }
    spawn_configured(config).await
}

/// Two gateways on the test ClickHouse, the first behind a proxy that can
/// cut its link (and, with `unreachable`, out of its peer's reach).
async fn cut_pair(
    coordination: Coordination,
    unreachable: Option<&ClosedPort>,
) -> (Proxy, TestApp, TestApp) {
    let schema = unique_schema();
    let proxy = Proxy::to_clickhouse().await;
    let url = clickhouse_url();
    let a = gateway(&schema, coordination, &url, Some(&proxy), unreachable).await;
    let b = gateway(&schema, coordination, &url, None, None).await;
    (proxy, a, b)
}

fn counter(n: u64) -> serde_json::Value {
    json!({"completed": {"counter": n}})
}

/// Acquires through `competitor` again and again until stopped; fails the
/// test on a grant. Answers how many answers it saw.
fn compete(
    competitor: Api,
    id: &'static str,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<usize> {
    tokio::spawn(async move {
        let mut answers = 0;
        while !stop.load(Ordering::SeqCst) {
            let reply = competitor
                .acquire(
                    id,
                    &json!({"owner": "competitor", "ttl_seconds": 30, "wait_seconds": 1}),
                )
                .await;
            assert!(
                matches!(
                    reply.status,
                    StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE
                ),
                "the competitor must not be granted while the lease lives: {} {}",
                reply.status,
                reply.text
            );
            answers += 1;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        answers
    })
}

/// Holds a lease through `holder` across an outage that `begin` starts and
/// `end` ends, with a competitor acquiring through `competitor` all along.
async fn ride_out(
    holder: &Api,
    competitor: &Api,
    id: &'static str,
    begin: impl FnOnce(),
    end: impl FnOnce(),
) {
    assert!(holder.put_state(id, &counter(0)).await.status.is_success());
    let (lease, token) = holder.lease(id, "holder", LEASE_TTL, 0.0).await;
    let write = holder.put_state_with_lease(id, &counter(1), &lease).await;
    assert!(write.status.is_success(), "{}", write.text);

    let stop = Arc::new(AtomicBool::new(false));
    let competing = compete(competitor.clone(), id, stop.clone());
    begin();
    let cut = Instant::now();
    let mut during = Vec::new();
    while cut.elapsed() < OUTAGE {
        let renewal = holder.renew(id, &lease, LEASE_TTL).await;
        assert!(
            matches!(
                renewal.status,
                StatusCode::OK | StatusCode::SERVICE_UNAVAILABLE
            ),
            "a renewal during the outage ({:?} in): {} {}",
            cut.elapsed(),
            renewal.status,
            renewal.text
        );
        during.push(renewal.status);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // The gateway still answers for the id: the kept lease is its holder.
    let shown = holder.get(&format!("/v1/locks/{id}")).await;
    assert_eq!(shown.status, StatusCode::OK, "{}", shown.text);
    assert_eq!(shown.json()["owner"], "holder");
    assert_eq!(shown.json()["fencing_token"], token);
    end();
    let back = Instant::now();
    assert!(
        during.contains(&StatusCode::SERVICE_UNAVAILABLE),
        "the claim lapsed during the outage: {during:?}"
    );
    loop {
        let renewal = holder.renew(id, &lease, LEASE_TTL).await;
        if renewal.status == StatusCode::OK {
            break;
        }
        assert_eq!(
            renewal.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{:?} after the outage: {}",
            back.elapsed(),
            renewal.text
        );
        assert!(
            back.elapsed() < RECOVERY,
            "the lease renews within {RECOVERY:?} of the outage: {}",
            renewal.text
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let write = holder.put_state_with_lease(id, &counter(2), &lease).await;
    assert!(write.status.is_success(), "{}", write.text);
    stop.store(true, Ordering::SeqCst);
    let answers = competing.await.expect("the competitor saw no grant");
    assert!(answers > 0);
    let released = holder.release(id, &lease).await;
    assert_eq!(released.status, StatusCode::NO_CONTENT, "{}", released.text);
    // Two ClickHouse nodes share no state table: read where it was written.
    assert_eq!(final_counter(holder, id).await, 2);
    let (_, _) = competitor.lease(id, "competitor", 30, 10.0).await;
}

/// Acceptance 1: keeper mode, two gateways on two ClickHouse nodes that
/// share only ZooKeeper, which is SIGKILLed for 14 s and restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_outlives_a_keeper_outage_longer_than_the_claim_ttl() {
    let keeper = tokio::task::spawn_blocking(KeeperNode::start)
        .await
        .unwrap();
    let node_b = keeper.start_second_node();
    let schema = unique_schema();
    let a = gateway(&schema, Coordination::Keeper, &keeper.url, None, None).await;
    let b = gateway(&schema, Coordination::Keeper, &node_b.url, None, None).await;
    ride_out(
        &a,
        &b,
        "dev:keeper-outage",
        || keeper.kill_zookeeper(),
        || keeper.start_zookeeper(),
    )
    .await;
}

/// Acceptance 2: table mode, the authority's link to ClickHouse cut for 14 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_outlives_a_cut_to_clickhouse_in_table_mode() {
    cut_link_ride_out(Coordination::Table, "dev:table-cut").await;
}

/// Keeper mode, the authority's link to its ClickHouse node (and so to
/// Keeper) cut for 14 s while the other gateway reaches both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_outlives_a_cut_to_clickhouse_in_keeper_mode() {
    cut_link_ride_out(Coordination::Keeper, "dev:keeper-cut").await;
}

async fn cut_link_ride_out(coordination: Coordination, id: &'static str) {
    let (proxy, a, b) = cut_pair(coordination, None).await;
    ride_out(
        &a,
        &b,
        id,
        || proxy.set_down(true),
        || proxy.set_down(false),
    )
    .await;
}

/// Acceptance 3: the other gateway claims the id while the authority is cut
/// off from ClickHouse and out of its peers' reach: the old lease is dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_claimed_elsewhere_during_a_cut_is_dead_in_table_mode() {
    taken_over_during_a_cut(Coordination::Table, "dev:table-taken").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_claimed_elsewhere_during_a_cut_is_dead_in_keeper_mode() {
    taken_over_during_a_cut(Coordination::Keeper, "dev:keeper-taken").await;
}

async fn taken_over_during_a_cut(coordination: Coordination, id: &'static str) {
    let closed = ClosedPort::bind();
    let (proxy, a, b) = cut_pair(coordination, Some(&closed)).await;
    // Before the cut, a loaded machine (another test starting ZooKeeper's
    // JVM) may still answer 503 or make a claim wait: asked again, as a
    // client does.
    let zero = counter(0);
    let first = retried(|| a.put_state(id, &zero)).await;
    assert!(first.status.is_success(), "{}", first.text);
    let (lease, token) = granted(&a, id, "holder", Instant::now() + HANG).await;

    proxy.set_down(true);
    let cut = Instant::now();
    // Once the claim lapses, the other gateway finds the authority out of
    // reach and claims the id itself. It grants at once if the lease's row
    // had not landed before the cut; if it had (a loaded machine is slow to
    // cut), the lease keeps its place until it would have expired.
    let bound = cut + Duration::from_secs(LEASE_TTL) + Duration::from_secs(40);
    let (next, next_token) = granted(&b, id, "next", bound).await;
    assert!(next_token > token, "{next_token} after {token}");
    let write = b.put_state_with_lease(id, &counter(7), &next).await;
    assert!(write.status.is_success(), "{}", write.text);
    proxy.set_down(false);
    let back = Instant::now();

    // The old authority learns the claim is gone: its lease gets 409, 503
    // only until then.
    loop {
        let renewal = a.renew(id, &lease, LEASE_TTL).await;
        if renewal.status == StatusCode::CONFLICT {
            break;
        }
        assert_eq!(
            renewal.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "the old lease never renews again: {}",
            renewal.text
        );
        assert!(back.elapsed() < RECOVERY, "{}", renewal.text);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let late = a.put_state_with_lease(id, &counter(1), &lease).await;
    assert_eq!(late.status, StatusCode::CONFLICT, "{}", late.text);
    assert_eq!(late.problem_type(), "lease-not-current");
    assert_eq!(
        final_counter(&b, id).await,
        7,
        "the late write changed nothing"
    );
}

/// How long an acquire may go ungranted before the test calls it a hang:
/// far past what the rule needs (a few patiences), as a machine twice as
/// slow queues twelve checker cycles.
const HANG: Duration = Duration::from_secs(600);

/// A worker that rides an outage out: each step of its cycle (acquire, read
/// the counter, write it + 1 with the lease, renew, release) is asked again
/// while it answers 503, through the outage and the recovery, and must then
/// succeed: a 409 on its own lease fails the test. What it held goes to the
/// checker.
async fn patient_worker(api: Api, id: &'static str, name: String, cycles: usize, log: Log) {
    let patience = OUTAGE + RECOVERY;
    for _ in 0..cycles {
        // Only a hang: under load the other workers' cycles ahead of this
        // one each take up to a patience.
        let (lease, token) = granted(&api, id, &name, Instant::now() + HANG).await;
        let start = Instant::now();
        let read = retried_for(patience, || api.get_state(id)).await;
        let counter = match read.status {
            StatusCode::OK => read.json()["completed"]["counter"].as_u64().unwrap(),
            _ => {
                read.expect_because(StatusCode::NOT_FOUND, format!("{name} read"));
                0
            }
        };
        // Written again on a 503: the same value, under the same lease.
        let next = self::counter(counter + 1);
        let write = retried_for(patience, || api.put_state_with_lease(id, &next, &lease)).await;
        assert!(write.status.is_success(), "{name} write: {}", write.text);
        retried_for(patience, || api.renew(id, &lease, LEASE_TTL))
            .await
            .expect_because(StatusCode::OK, format!("{name} renew"));
        let end = Instant::now();
        retried_for(patience, || api.release(id, &lease))
            .await
            .expect_because(StatusCode::NO_CONTENT, format!("{name} release"));
        log.lock().unwrap().push(Held { start, end, token });
    }
}

/// Acquires `id` for `owner` through `api`, asking again while the answer is
/// 409 (held, the wait ran out) or 503, until `give_up`: its lease and token.
async fn granted(api: &Api, id: &str, owner: &str, give_up: Instant) -> (String, u64) {
    loop {
        let reply = api
            .acquire(
                id,
                &json!({"owner": owner, "ttl_seconds": LEASE_TTL, "wait_seconds": 5}),
            )
            .await;
        if reply.status == StatusCode::CREATED {
            let body = reply.json();
            return (
                body["lease_id"].as_str().unwrap().to_owned(),
                body["fencing_token"].as_u64().unwrap(),
            );
        }
        assert!(
            matches!(
                reply.status,
                StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE
            ),
            "{owner} acquire: {}",
            reply.text
        );
        assert!(
            Instant::now() < give_up,
            "{owner} not granted: {}",
            reply.text
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// The lock checker through an outage: 4 workers, 3 cycles each, through
/// two gateways, while `begin` .. `end` takes coordination away from the
/// first for 14 s. Every cycle counts once and no two leases overlap.
async fn checker_through_an_outage(
    a: &Api,
    b: &Api,
    id: &'static str,
    begin: impl FnOnce(),
    end: impl FnOnce(),
) {
    let log: Log = Arc::default();
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let api = if w % 2 == 0 { a.clone() } else { b.clone() };
            tokio::spawn(patient_worker(
                api,
                id,
                format!("worker-{w}"),
                3,
                log.clone(),
            ))
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    begin();
    tokio::time::sleep(OUTAGE).await;
    end();
    for worker in workers {
        worker.await.unwrap();
    }
    assert_eq!(final_counter(b, id).await, 12);
    check(&log, 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_lock_checker_holds_through_a_cut_to_clickhouse_in_table_mode() {
    let (proxy, a, b) = cut_pair(Coordination::Table, None).await;
    checker_through_an_outage(
        &a,
        &b,
        "dev:checked-cut",
        || proxy.set_down(true),
        || proxy.set_down(false),
    )
    .await;
}

/// Keeper mode, both gateways on one ClickHouse node whose ZooKeeper is
/// SIGKILLed for 14 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_lock_checker_holds_through_a_keeper_outage() {
    let keeper = tokio::task::spawn_blocking(KeeperNode::start)
        .await
        .unwrap();
    let schema = unique_schema();
    let a = gateway(&schema, Coordination::Keeper, &keeper.url, None, None).await;
    let b = gateway(&schema, Coordination::Keeper, &keeper.url, None, None).await;
    checker_through_an_outage(
        &a,
        &b,
        "dev:checked-keeper",
        || keeper.kill_zookeeper(),
        || keeper.start_zookeeper(),
    )
    .await;
}
