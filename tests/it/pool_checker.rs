//! The pool checker (issue 37), as `lock_concurrency`'s is for locks: N
//! workers take a slot of one pool of limit K (POST with a wait), record the
//! interval they held it [after the 201, before the DELETE] and its fencing
//! token, and give it back. The check: no instant has more than K live
//! intervals, tokens are distinct and rise in grant order, holders did
//! overlap when K >= 2, and every cycle is there. One gateway, two (with
//! renewals through the other one), two in keeper mode on two ClickHouse
//! nodes, and two where the authority is killed.
//! (`scripts/test` runs these in keeper mode too.) What `pools` shares
//! with it is here too: a grant as the tests read it, and its checks.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;
use statehouse::config::parse_clickhouse_url;
use statehouse::domain::Coordination;

use crate::helpers::{
    Api, Reply, ask, clickhouse_url, node_b_url, peer_config, spawn_app, spawn_configured,
    spawn_peer_process, two_peers, unique_schema,
};
use crate::lock_faults::millis;

/// A pool lease as its 201 (or a renewal's 200) tells it.
#[derive(Clone, Debug)]
pub struct Grant {
    pub lease_id: String,
    pub token: u64,
    pub acquired_ms: i64,
    pub expires_ms: i64,
    pub body: Value,
}

impl Grant {
    pub fn from_reply(reply: &Reply, status: StatusCode) -> Self {
        reply.expect(status);
        let body = reply.json();
        let time = |field: &str| {
            millis(
                body[field]
                    .as_str()
                    .unwrap_or_else(|| panic!("{field} in {body}")),
            )
        };
        Self {
            lease_id: body["lease_id"].as_str().expect("lease_id").to_owned(),
            token: body["fencing_token"].as_u64().expect("fencing_token"),
            acquired_ms: time("acquired_at"),
            expires_ms: time("expires_at"),
            body,
        }
    }
}

/// Acquires with `body` or panics.
pub async fn take_with(api: &Api, name: &str, body: &Value) -> Grant {
    Grant::from_reply(&api.pool_acquire(name, body).await, StatusCode::CREATED)
}

pub async fn take(api: &Api, name: &str, owner: &str, limit: u64, ttl: u64, wait: f64) -> Grant {
    take_with(api, name, &ask(owner, limit, ttl, wait)).await
}

/// The 409 of an acquire on a full pool: checks its problem type, and that
/// no lease id (the key, or any of `leases`) is anywhere in it: a lease id
/// is what renews and releases, so only its holder may know it.
pub fn refused(reply: &Reply, kind: &str, leases: &[&Grant]) -> Value {
    problem(reply, StatusCode::CONFLICT, kind);
    let body = reply.json();
    assert_shows_no_lease_id(&body, leases);
    body
}

pub fn assert_shows_no_lease_id(body: &Value, leases: &[&Grant]) {
    fn has_key(value: &Value) -> bool {
        match value {
            Value::Object(map) => map.contains_key("lease_id") || map.values().any(has_key),
            Value::Array(items) => items.iter().any(has_key),
            _ => false,
        }
    }
    assert!(!has_key(body), "a lease_id is shown: {body}");
    let text = body.to_string();
    for lease in leases {
        assert!(
            !text.contains(&lease.lease_id),
            "{} shown: {text}",
            lease.lease_id
        );
    }
}

/// Releases `lease`, which must be current.
pub async fn give_back(api: &Api, name: &str, lease: &Grant) {
    let reply = api.pool_release(name, &lease.lease_id).await;
    reply.expect(StatusCode::NO_CONTENT);
}

/// Asserts an answer's status and problem type.
pub fn problem(reply: &Reply, status: StatusCode, kind: &str) {
    reply.expect(status);
    assert_eq!(reply.problem_type(), kind, "{}", reply.text);
}

/// What a worker saw of one slot: a sub-interval of its lease, so K leases
/// at most means K intervals at most, whatever the network did.
#[derive(Clone, Copy, Debug)]
pub struct Slot {
    /// Just before the POST: the grant came after this.
    pub asked: Instant,
    /// Just after the 201: the grant came before this.
    pub start: Instant,
    pub end: Instant,
    pub token: u64,
    /// The server's grant time (ms), for grant order among overlapping slots.
    pub acquired_ms: i64,
}

impl Slot {
    pub fn of(grant: &Grant, asked: Instant, start: Instant, end: Instant) -> Self {
        Self {
            asked,
            start,
            end,
            token: grant.token,
            acquired_ms: grant.acquired_ms,
        }
    }
}

pub type SlotLog = Arc<Mutex<Vec<Slot>>>;

/// The checker; answers the most slots live at once.
pub fn check_slots(log: &SlotLog, limit: usize, cycles: usize) -> usize {
    let slots = log.lock().unwrap().clone();
    assert_eq!(slots.len(), cycles, "every cycle recorded");

    // Sweep the starts and ends in time order; at a tie an end goes first
    // (-1 sorts before +1): the intervals are closed inside their leases.
    let mut events: Vec<(Instant, i32)> = slots
        .iter()
        .flat_map(|s| [(s.start, 1), (s.end, -1)])
        .collect();
    events.sort();
    let (mut live, mut peak) = (0_i32, 0_i32);
    for (at, step) in events {
        live += step;
        if live > limit as i32 {
            let holding: Vec<_> = slots
                .iter()
                .filter(|s| s.start <= at && at < s.end)
                .collect();
            panic!("{live} slots live at once, limit {limit}: {holding:#?}");
        }
        peak = peak.max(live);
    }
    if limit >= 2 {
        assert!(peak >= 2, "no two holders ever overlapped (limit {limit})");
    }

    // Grant order: the token order, which the server's grant times follow.
    let mut by_token = slots.clone();
    by_token.sort_by_key(|s| s.token);
    for pair in by_token.windows(2) {
        assert!(pair[0].token < pair[1].token, "a token twice: {:?}", pair);
        assert!(
            pair[0].acquired_ms <= pair[1].acquired_ms,
            "a greater token granted earlier: {pair:?}"
        );
    }
    // And what the workers saw: a slot asked for after another's 201 came
    // was granted after it, so it has the greater token. (Not "started
    // after": a 201 may arrive late, after a later grant's.)
    for a in &slots {
        for b in slots.iter().filter(|b| a.start < b.asked) {
            assert!(a.token < b.token, "token went backwards: {a:?} then {b:?}");
        }
    }
    peak as usize
}

/// One worker: takes a slot through `via`, holds it a moment (so that
/// holders overlap), renews it through `renew_via`, gives it back.
async fn worker(
    via: Api,
    renew_via: Api,
    pool: &'static str,
    limit: u64,
    owner: String,
    cycles: usize,
    log: SlotLog,
) {
    for _ in 0..cycles {
        let asked = Instant::now();
        let grant = take(&via, pool, &owner, limit, 30, 120.0).await;
        let start = Instant::now();
        tokio::time::sleep(Duration::from_millis(30)).await;
        let renewed = renew_via.pool_renew(pool, &grant.lease_id, 30).await;
        let renewed = Grant::from_reply(&renewed, StatusCode::OK);
        assert_eq!(
            (renewed.lease_id.as_str(), renewed.token),
            (grant.lease_id.as_str(), grant.token),
            "{owner}: the renewal is of the same lease"
        );
        let end = Instant::now();
        let released = via.pool_release(pool, &grant.lease_id).await;
        released.expect_because(StatusCode::NO_CONTENT, &owner);
        log.lock()
            .unwrap()
            .push(Slot::of(&grant, asked, start, end));
    }
}

/// Runs `workers` workers of `cycles` each, worker w through gateway
/// w % n and renewing through the next one, and checks them.
async fn run(gateways: &[Api], pool: &'static str, limit: u64, workers: usize, cycles: usize) {
    let log = SlotLog::default();
    let tasks: Vec<_> = (0..workers)
        .map(|w| {
            let via = gateways[w % gateways.len()].clone();
            let renew_via = gateways[(w + 1) % gateways.len()].clone();
            tokio::spawn(worker(
                via,
                renew_via,
                pool,
                limit,
                format!("worker-{w}"),
                cycles,
                log.clone(),
            ))
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    check_slots(&log, limit as usize, workers * cycles);
    // Every slot given back: nobody holds or waits.
    gateways[0]
        .pool_view(pool)
        .await
        .expect(StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_gateway_8_workers_on_3_slots() {
    let app = spawn_app().await;
    run(std::slice::from_ref(&app.api), "one-gateway", 3, 8, 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_gateway_6_workers_on_1_slot() {
    let app = spawn_app().await;
    run(std::slice::from_ref(&app.api), "one-slot", 1, 6, 5).await;
}

/// Acceptance 5: two gateways act as one pool, and a lease renews through
/// the gateway that did not grant it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_gateways_8_workers_on_2_slots_renewing_through_the_other() {
    let (a, b) = two_peers().await;
    run(&[a.api.clone(), b.api.clone()], "two-gateways", 2, 8, 5).await;
}

/// Keeper mode with the two gateways on different ClickHouse nodes: they
/// share only Keeper (as in keeper_locks.rs), and still act as one pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keeper_mode_gateways_on_two_clickhouse_nodes_share_one_pool() {
    let schema = unique_schema();
    let mut gateways = Vec::new();
    for url in [clickhouse_url(), node_b_url()] {
        let mut config = peer_config(&schema);
        config.clickhouse = parse_clickhouse_url(&url).unwrap();
        config.locks.coordination = Coordination::Keeper;
        gateways.push(spawn_configured(config).await);
    }
    let apis: Vec<Api> = gateways.iter().map(|g| g.api.clone()).collect();
    run(&apis, "two-nodes", 2, 8, 4).await;
}

/// Acquires through `api` with a wait, retrying while the dead authority's
/// claim has not lapsed (503); the 20 s is a give-up, not a bound under test.
/// Anything else is answered as it came, for the caller to explain.
async fn take_after_takeover(
    api: &Api,
    pool: &str,
    owner: &str,
    limit: u64,
) -> Result<Grant, Reply> {
    let give_up = Instant::now() + Duration::from_secs(20);
    loop {
        let reply = api.pool_acquire(pool, &ask(owner, limit, 30, 10.0)).await;
        match reply.status {
            StatusCode::CREATED => return Ok(Grant::from_reply(&reply, StatusCode::CREATED)),
            StatusCode::SERVICE_UNAVAILABLE if Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            _ => return Err(reply),
        }
    }
}

/// Acceptance 6: the authority holds both slots of a pool of 2 and is killed
/// -9. Its leases keep their slots until they would have expired: the
/// survivor grants the first slot no earlier than the first of them expires,
/// the second no earlier than the second, each with a greater token.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_authoritys_leases_keep_their_slots_until_they_expire() {
    let schema = unique_schema();
    let pool = "killed-authority";
    // A claim TTL (1 s) well below the leases' (3 s): once the survivor can
    // take the pool's claim, the dead leases still have time left, so a
    // survivor that forgot them would grant too early.
    let start = |gateway_id: String| {
        let schema = schema.clone();
        async move {
            let flags = [
                "--schema",
                &schema,
                "--gateway-id",
                &gateway_id,
                "--claim-ttl",
                "1s",
                "--claim-settle",
                "200ms",
            ];
            (
                gateway_id.clone(),
                spawn_peer_process(&clickhouse_url(), &flags).await,
            )
        }
    };
    let mut gateways = vec![
        start(uuid::Uuid::new_v4().to_string()).await,
        start(uuid::Uuid::new_v4().to_string()).await,
    ];
    let first = gateways[0].1.api();
    // Asked with a wait: with a 1 s claim TTL on a loaded machine, the
    // first claim attempt may not settle in time, and a free pool is then
    // answered 409 at once.
    let dead = [
        take(&first, pool, "dead-1", 2, 3, 30.0).await,
        take(&first, pool, "dead-2", 2, 3, 30.0).await,
    ];
    let view = first.pool_view(pool).await.json();
    let authority = view["holders"][0]["gateway_id"]
        .as_str()
        .expect("gateway_id")
        .to_owned();
    assert_eq!(
        view["holders"][1]["gateway_id"],
        authority.as_str(),
        "one authority: {view}"
    );
    let index = gateways
        .iter()
        .position(|(id, _)| *id == authority)
        .unwrap_or_else(|| panic!("the authority {authority} is one of ours"));
    // Killed at once: a pool lease's row is written before its grant is
    // answered (unlike a lock's, see lock_delay.rs), so nothing waits here,
    // and the claim lapses (1 s) long before the leases (3 s) expire.
    let (_, mut killed) = gateways.remove(index);
    killed.child.kill().await.expect("kill -9");
    let killed_at = Instant::now();
    let survivor = gateways[0].1.api();

    let mut grants = Vec::new();
    for owner in ["after-1", "after-2"] {
        match take_after_takeover(&survivor, pool, owner, 2).await {
            Ok(grant) => grants.push(grant),
            Err(reply) => {
                // A multi-process failure is explained by the survivor's log.
                let after = killed_at.elapsed();
                let (_, process) = gateways.remove(0);
                let logs = process.kill_and_collect_logs().await;
                let logs: Vec<_> = logs.iter().map(|l| String::from_utf8_lossy(l)).collect();
                panic!(
                    "{owner}: {} {} ({after:?} after the kill; dead leases {:?})\nsurvivor log:\n{}",
                    reply.status,
                    reply.text,
                    dead.iter().map(|d| &d.body).collect::<Vec<_>>(),
                    logs.join("\n")
                );
            }
        }
    }
    let [next, then] = <[Grant; 2]>::try_from(grants).unwrap();
    let first_expiry = dead.iter().map(|d| d.expires_ms).min().unwrap();
    let last_expiry = dead.iter().map(|d| d.expires_ms).max().unwrap();
    let last_token = dead.iter().map(|d| d.token).max().unwrap();
    assert!(
        next.acquired_ms >= first_expiry,
        "granted before a dead lease expired: {} while {:?} held",
        next.body,
        dead.iter().map(|d| &d.body).collect::<Vec<_>>()
    );
    assert!(
        then.acquired_ms >= last_expiry,
        "a second slot granted before both dead leases expired: {} while {:?} held",
        then.body,
        dead.iter().map(|d| &d.body).collect::<Vec<_>>()
    );
    assert!(
        next.token > last_token && then.token > next.token,
        "{} {} after {last_token}",
        next.token,
        then.token
    );
    // The survivor's two hold the pool: no third slot.
    let full = survivor.pool_acquire(pool, &ask("third", 2, 30, 0.0)).await;
    problem(&full, StatusCode::CONFLICT, "pool-full");
}

/// The checker itself can fail: more than K live, a token out of grant
/// order, and holders of a K >= 2 pool that never overlapped.
#[test]
fn the_checker_catches_each_violation() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    // [asked, start, end) in ms, token, server grant time in ms.
    let slot = |asked, start, end, token, acquired_ms| Slot {
        asked: at(asked),
        start: at(start),
        end: at(end),
        token,
        acquired_ms,
    };
    let fails = |slots: Vec<Slot>, limit: usize| {
        let n = slots.len();
        let log: SlotLog = Arc::new(Mutex::new(slots));
        std::panic::catch_unwind(|| check_slots(&log, limit, n)).is_err()
    };
    let good = vec![
        slot(0, 1, 10, 1, 1),
        slot(0, 2, 12, 2, 2),
        slot(11, 12, 20, 3, 12),
    ];
    assert!(!fails(good.clone(), 2));
    assert!(fails(good.clone(), 1), "two live, limit 1");
    // Consistent tokens and grant times: only the live count catches it.
    let mut three = good.clone();
    three[2].token = 4;
    three.push(slot(0, 3, 9, 3, 3));
    assert!(!fails(three.clone(), 3));
    assert!(fails(three, 2), "three live, limit 2");
    let mut backwards = good.clone();
    // Its grant time agrees with the token: only the workers' view catches it.
    (backwards[2].token, backwards[2].acquired_ms) = (0, 0);
    assert!(fails(backwards, 2), "asked after a 201, smaller token");
    let mut early = good.clone();
    early[1].acquired_ms = 0;
    assert!(
        fails(early, 2),
        "a greater token with an earlier grant time"
    );
    let apart = vec![slot(0, 1, 5, 1, 1), slot(6, 7, 9, 2, 7)];
    assert!(fails(apart, 2), "limit 2 and never two at once");
}
