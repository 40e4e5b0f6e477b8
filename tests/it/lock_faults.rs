//! Locks under faults: a write in flight when its lease ends, ClickHouse
//! latency in bursts, grants whose answers are lost between gateways, and
//! acquires that race on a fresh id. The rule checked throughout: the next
//! holder reads every acknowledged write.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::checker::{Held, Log, check};
use crate::helpers::{
    Api, Reply, TestApp, free_port, peer_config, raw_sql, spawn_configured, two_peers_with,
    unique_schema,
};
use crate::proxy::Proxy;

/// Two gateways on one database that forward to each other; the first
/// reaches ClickHouse through a proxy that the test can slow down.
async fn proxied_peers(
    adjust: impl Fn(&mut statehouse::config::Config),
) -> (TestApp, Proxy, TestApp) {
    let proxy = Proxy::to_clickhouse().await;
    let (a, b) = two_peers_with(|index, config| {
        if index == 0 {
            proxy.route(config);
        }
        adjust(config);
    })
    .await;
    (a, proxy, b)
}

/// The counter `n` of `id` as ClickHouse has it now, read past every gateway.
pub async fn stored_n(schema: &str, id: &str) -> Option<u64> {
    let row = raw_sql(&format!(
        "SELECT completed_state FROM `{schema}`.state FINAL WHERE state_id = '{id}' FORMAT JSONEachRow"
    ))
    .await;
    let row: Value = serde_json::from_str(row.lines().next()?).unwrap();
    let doc: Value = serde_json::from_str(row["completed_state"].as_str()?).unwrap();
    doc["n"].as_u64()
}

/// `n` as a gateway answers it.
pub async fn served_n(api: &Api, id: &str) -> Option<u64> {
    let read = api.get_state(id).await;
    match read.status {
        StatusCode::OK => read.json()["completed"]["n"].as_u64(),
        StatusCode::NOT_FOUND => None,
        other => panic!("read failed: {other} {}", read.text),
    }
}

#[derive(Clone, Copy, Debug)]
enum End {
    Expiry,
    Release,
    ForceUnlock,
}

/// Worker 1 writes `n = 1` under a 2 s lease while ClickHouse takes its time;
/// the lease ends (`end`) with the write on its way. Worker 2, waiting
/// through the same gateway or the other, is granted the lock and reads at
/// once. Either worker 1's write was refused and worker 2 reads nothing, or
/// it was acknowledged and worker 2 reads it: never a grant before an
/// acknowledged write has landed. With `served_first`, worker 2 asks its
/// gateway before ClickHouse, the moment it is granted, as a Meltano run does.
async fn write_in_flight_at_the_lease_end(end: End, next_through_peer: bool, served_first: bool) {
    let (a, proxy, b) = proxied_peers(|_| {}).await;
    let id = "in-flight";
    let (lease, _) = a.lease(id, "worker-1", 2, 0.0).await;
    let granted_at = Instant::now();
    // Read once, so that the write's own read is served from memory and its
    // INSERT is the one round trip the proxy slows down.
    assert_eq!(served_n(&a, id).await, None);

    let next = if next_through_peer {
        b.api.clone()
    } else {
        a.api.clone()
    };
    let schema = a.schema.clone();
    let worker_2 = tokio::spawn(async move {
        let (lease, _) = next.lease(id, "worker-2", 30, 20.0).await;
        if served_first {
            let served = served_n(&next, id).await;
            let stored = stored_n(&schema, id).await;
            return (lease, stored, served);
        }
        let stored = stored_n(&schema, id).await;
        let served = served_n(&next, id).await;
        (lease, stored, served)
    });
    // Worker 2 is in line before the write starts.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // With `served_first`, worker 3 waits behind worker 2, as soak_mixed's
    // workers do: the write's end wakes them both, and worker 2 is not the
    // last one woken (a task the runtime could not hand to another thread).
    let worker_3 = served_first.then(|| {
        let third = if next_through_peer {
            b.api.clone()
        } else {
            a.api.clone()
        };
        tokio::spawn(async move {
            let body = json!({"owner": "worker-3", "ttl_seconds": 1, "wait_seconds": 5});
            third.acquire(id, &body).await.status
        })
    });
    if served_first {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    if let End::Expiry = end {
        tokio::time::sleep_until((granted_at + Duration::from_millis(1500)).into()).await;
    }
    proxy.set_delay(Duration::from_millis(800));
    let writer = a.api.clone();
    let write_lease = lease.clone();
    let write = tokio::spawn(async move {
        writer
            .put_state_with_lease(id, &json!({"completed": {"n": 1}}), &write_lease)
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    match end {
        End::Expiry => {}
        End::Release => {
            a.release(id, &lease).await.expect_because(
                StatusCode::NO_CONTENT,
                "the release is answered while the write is on its way",
            );
        }
        End::ForceUnlock => {
            let unlock = a
                .request(Method::DELETE, &format!("/v1/locks/{id}"), None, &[])
                .await;
            unlock.expect(StatusCode::NO_CONTENT);
        }
    }
    let write = write.await.unwrap();
    proxy.set_delay(Duration::ZERO);
    let (_, stored, served) = worker_2.await.unwrap();
    if let Some(worker_3) = worker_3 {
        // Worker 2 holds the lock for its whole wait.
        assert_eq!(worker_3.await.unwrap(), StatusCode::CONFLICT);
    }
    match write.status {
        StatusCode::OK | StatusCode::CREATED => {
            assert_eq!(
                stored,
                Some(1),
                "{end:?}: worker 2 was granted before worker 1's acknowledged write landed"
            );
            assert_eq!(
                served,
                Some(1),
                "{end:?}: worker 2's gateway served the old state"
            );
        }
        StatusCode::CONFLICT => {
            assert_eq!(write.problem_type(), "lease-not-current");
            assert_eq!(stored, None, "{end:?}: a refused write landed");
            assert_eq!(served, None);
        }
        other => panic!("{end:?}: the write got {other}: {}", write.text),
    }
    assert_eq!(
        stored_n(&a.schema, id).await,
        stored,
        "nothing landed later"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_in_flight_at_expiry_lands_before_the_next_grant() {
    write_in_flight_at_the_lease_end(End::Expiry, false, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_in_flight_at_expiry_lands_before_a_grant_through_another_gateway() {
    write_in_flight_at_the_lease_end(End::Expiry, true, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_in_flight_at_release_lands_before_the_next_grant() {
    write_in_flight_at_the_lease_end(End::Release, false, false).await;
    write_in_flight_at_the_lease_end(End::Release, true, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_in_flight_at_force_unlock_lands_before_the_next_grant() {
    write_in_flight_at_the_lease_end(End::ForceUnlock, false, false).await;
    write_in_flight_at_the_lease_end(End::ForceUnlock, true, false).await;
}

/// The gateway that grants the next lease the moment a write under the last
/// one lands serves that write to the next holder's first read: what it
/// remembers of the id is current before the id is free (soak_mixed once
/// saw a lost update when it was not, under load).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_next_holders_first_read_through_the_granting_gateway_sees_the_landed_write() {
    write_in_flight_at_the_lease_end(End::Expiry, false, true).await;
    write_in_flight_at_the_lease_end(End::ForceUnlock, false, true).await;
}

#[derive(Default)]
struct Tally {
    /// Each cycle's interval: from the grant to the last instant the worker
    /// surely held the lease (the write's answer when the release was
    /// accepted after it, else when the write went out, since the lease may
    /// have run out while it was on its way).
    cycles: Log,
    acknowledged: AtomicU64,
    /// Writes whose outcome the worker cannot know (a 503).
    unknown: AtomicU64,
}

async fn burst_worker(api: Api, name: String, cycles: usize, tally: Arc<Tally>) {
    let id = "bursts";
    for _ in 0..cycles {
        let acquired = api
            .acquire(
                id,
                &json!({"owner": name, "ttl_seconds": 2, "wait_seconds": 120}),
            )
            .await;
        acquired.expect_because(StatusCode::CREATED, &name);
        let start = Instant::now();
        let lease = acquired.json()["lease_id"].as_str().unwrap().to_owned();
        let token = acquired.json()["fencing_token"].as_u64().unwrap();
        let read = api.get_state(id).await;
        let counter = match read.status {
            StatusCode::OK => read.json()["completed"]["counter"].as_u64().unwrap(),
            StatusCode::NOT_FOUND => 0,
            StatusCode::SERVICE_UNAVAILABLE => continue,
            other => panic!("{name}: read failed: {other} {}", read.text),
        };
        let sent = Instant::now();
        let write = api
            .put_state_with_lease(id, &json!({"completed": {"counter": counter + 1}}), &lease)
            .await;
        let answered = Instant::now();
        let acknowledged = write.status.is_success();
        match write.status {
            StatusCode::OK | StatusCode::CREATED => {
                tally.acknowledged.fetch_add(1, Ordering::SeqCst);
            }
            StatusCode::CONFLICT => assert_eq!(write.problem_type(), "lease-not-current"),
            StatusCode::SERVICE_UNAVAILABLE => {
                tally.unknown.fetch_add(1, Ordering::SeqCst);
            }
            other => panic!("{name}: write got {other}: {}", write.text),
        }
        // The lease surely ran until the write's answer if its release
        // worked, until the write was sent if the write was acknowledged
        // under it; a lease lost with its write refused or unknown may have
        // ended any time after its grant (a slow read outlives a 2 s lease).
        let released = api.release(id, &lease).await;
        let end = match (released.status == StatusCode::NO_CONTENT, acknowledged) {
            (true, _) => answered,
            (false, true) => sent,
            (false, false) => start,
        };
        tally
            .cycles
            .lock()
            .unwrap()
            .push(Held { start, end, token });
    }
}

/// Lock cycles from workers on two gateways with 2 s leases, while
/// ClickHouse's latency comes and goes in bursts, so that leases run out
/// with writes on their way. No two leases overlap, and the counter is the
/// number of acknowledged increments.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lock_cycles_through_latency_bursts_lose_no_acknowledged_increment() {
    let schema = unique_schema();
    let (proxy_a, proxy_b) = (Proxy::to_clickhouse().await, Proxy::to_clickhouse().await);
    let mut config_a = peer_config(&schema);
    proxy_a.route(&mut config_a);
    let mut config_b = peer_config(&schema);
    proxy_b.route(&mut config_b);
    let (a, b) = (
        spawn_configured(config_a).await,
        spawn_configured(config_b).await,
    );

    let done = Arc::new(AtomicBool::new(false));
    let proxies = Arc::new((proxy_a, proxy_b));
    let bursts = {
        let (done, proxies) = (done.clone(), proxies.clone());
        tokio::spawn(async move {
            let mut step = 0u64;
            while !done.load(Ordering::SeqCst) {
                // Bursts of 0.3 to 1.8 s per chunk, most of the time: a write
                // and its read take longer than a lease then.
                let delay =
                    Duration::from_millis([1200, 0, 1800, 300, 1500, 600][step as usize % 6]);
                proxies.0.set_delay(delay);
                proxies.1.set_delay(delay);
                step += 1;
                tokio::time::sleep(Duration::from_millis(1500)).await;
            }
            proxies.0.set_delay(Duration::ZERO);
            proxies.1.set_delay(Duration::ZERO);
        })
    };
    let tally = Arc::new(Tally::default());
    let workers: Vec<_> = (0..6)
        .map(|w| {
            let api = if w % 2 == 0 {
                a.api.clone()
            } else {
                b.api.clone()
            };
            tokio::spawn(burst_worker(api, format!("worker-{w}"), 3, tally.clone()))
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    done.store(true, Ordering::SeqCst);
    bursts.await.unwrap();

    let cycles = tally.cycles.lock().unwrap().len();
    check(&tally.cycles, cycles);
    let acknowledged = tally.acknowledged.load(Ordering::SeqCst);
    let unknown = tally.unknown.load(Ordering::SeqCst);
    let counter = stored_n_counter(&schema).await;
    assert!(acknowledged > 0, "no write got through at all");
    assert!(
        (acknowledged..=acknowledged + unknown).contains(&counter),
        "counter {counter} against {acknowledged} acknowledged increments ({unknown} unknown)"
    );
}

async fn stored_n_counter(schema: &str) -> u64 {
    let row = raw_sql(&format!(
        "SELECT completed_state FROM `{schema}`.state FINAL WHERE state_id = 'bursts' FORMAT JSONEachRow"
    ))
    .await;
    let row: Value = serde_json::from_str(row.lines().next().expect("a state")).unwrap();
    let doc: Value = serde_json::from_str(row["completed_state"].as_str().unwrap()).unwrap();
    doc["counter"].as_u64().unwrap()
}

/// A gateway whose peers reach it through a proxy, so that the test can lose
/// the answers it sends them.
async fn peer_behind_a_link(schema: &str) -> (TestApp, Proxy) {
    let mut config = peer_config(schema);
    let port = free_port();
    config.listen = SocketAddr::from(([127, 0, 0, 1], port));
    let link = Proxy::start(config.listen).await;
    config.locks.advertise_url = Some(format!("http://{}", link.addr));
    (spawn_configured(config).await, link)
}

/// A grant forwarded from another gateway whose answer never arrives there
/// leaves no lease that blocks the id for its TTL: it lapses within seconds,
/// since the forwarding gateway never confirmed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forwarded_grant_whose_answer_is_lost_does_not_hold_the_id_for_its_ttl() {
    let schema = unique_schema();
    let (authority, link) = peer_behind_a_link(&schema).await;
    let peer = spawn_configured(peer_config(&schema)).await;
    let id = "lost-answer";
    let (first, _) = authority.lease(id, "warm-up", 30, 0.0).await;
    authority
        .release(id, &first)
        .await
        .expect(StatusCode::NO_CONTENT);

    link.lose_answers_to(Some("/v1/locks/"));
    let lost = peer
        .acquire(
            id,
            &json!({"owner": "far-worker", "ttl_seconds": 600, "wait_seconds": 0}),
        )
        .await;
    lost.expect(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(lost.problem_type(), "authority-unreachable");
    link.lose_answers_to(None);

    // The lost grant ran on the authority, so the id is held for a moment;
    // a worker that waits 20 s gets it, where the lost lease's TTL is 600 s.
    let next = authority
        .acquire(
            id,
            &json!({"owner": "near-worker", "ttl_seconds": 30, "wait_seconds": 20}),
        )
        .await;
    next.expect(StatusCode::CREATED);
}

/// A forwarded grant that arrives is confirmed: its holder gets the TTL it
/// asked for, and every gateway shows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forwarded_grant_lives_the_ttl_its_client_asked_for() {
    let (a, _proxy, b) = proxied_peers(|_| {}).await;
    let id = "confirmed";
    let (warm, _) = a.lease(id, "warm-up", 30, 0.0).await;
    a.release(id, &warm).await.expect(StatusCode::NO_CONTENT);
    let granted = b
        .acquire(id, &json!({"owner": "far-worker", "ttl_seconds": 60}))
        .await;
    granted.expect(StatusCode::CREATED);
    let lease = granted.json()["lease_id"].as_str().unwrap().to_owned();
    let expires = granted.json()["expires_at"].as_str().unwrap().to_owned();
    let acquired = granted.json()["acquired_at"].as_str().unwrap().to_owned();
    let ttl = millis(&expires) - millis(&acquired);
    assert!(ttl >= 59_000, "the lease lives its 60 s, not {ttl} ms");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let write = b
        .put_state_with_lease(id, &json!({"completed": {"n": 1}}), &lease)
        .await;
    assert!(
        write.status.is_success(),
        "still held after 4 s: {}",
        write.text
    );
}

pub fn millis(rfc3339: &str) -> i64 {
    epoch_millis(rfc3339).expect("an RFC 3339 time")
}

/// ms since the epoch of `YYYY-MM-DDTHH:MM:SS.mmmZ` (the API's own form).
fn epoch_millis(text: &str) -> Option<i64> {
    let (date, time) = text.strip_suffix('Z')?.split_once('T')?;
    let mut ymd = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, d) = (ymd.next()??, ymd.next()??, ymd.next()??);
    let (hms, ms) = time.split_once('.')?;
    let mut parts = hms.split(':').map(|p| p.parse::<i64>().ok());
    let (h, mi, s) = (parts.next()??, parts.next()??, parts.next()??);
    // Days from the civil date (Howard Hinnant's algorithm).
    let (y, m) = if m <= 2 { (y - 1, m + 9) } else { (y, m - 3) };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * m + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 24 + h) * 60 + mi) * 60_000 + s * 1000 + ms.parse::<i64>().ok()?)
}

/// Two acquires on a fresh id at once, each trying once: one wins, and the
/// other's 409 names the winner, whose lease is moments old.
async fn race(first: &Api, second: &Api, id: &str) {
    let body = |owner: &str| json!({"owner": owner, "ttl_seconds": 30, "wait_seconds": 0});
    let (body_one, body_two) = (body("first"), body("second"));
    let (one, two): (Reply, Reply) =
        tokio::join!(first.acquire(id, &body_one), second.acquire(id, &body_two));
    let (winner, loser) = match (one.status, two.status) {
        (StatusCode::CREATED, StatusCode::CONFLICT) => (one, two),
        (StatusCode::CONFLICT, StatusCode::CREATED) => (two, one),
        other => panic!(
            "{id}: not one winner: {other:?}: {} / {}",
            one.text, two.text
        ),
    };
    assert_eq!(loser.problem_type(), "lock-held");
    let holder = &loser.json()["holder"];
    assert_eq!(
        holder["owner"],
        winner.json()["owner"],
        "{id}: the 409 names the holder: {}",
        loser.text
    );
    assert_eq!(holder["fencing_token"], winner.json()["fencing_token"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_acquires_racing_on_a_fresh_id_name_the_winner_on_one_gateway() {
    let (a, _proxy, _b) = proxied_peers(|_| {}).await;
    for n in 0..5 {
        race(&a, &a, &format!("race-one-{n}")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_acquires_racing_on_a_fresh_id_name_the_winner_across_gateways() {
    let (a, _proxy, b) = proxied_peers(|_| {}).await;
    for n in 0..5 {
        race(&a, &b, &format!("race-peers-{n}")).await;
    }
    // Gateways that cannot forward to each other: the loser reads the holder
    // from the lease rows, which the winner writes behind its grant.
    let (c, _proxy, d) = proxied_peers(|config| config.locks.advertise_url = None).await;
    for n in 0..5 {
        race(&c, &d, &format!("race-unforwarded-{n}")).await;
    }
}
