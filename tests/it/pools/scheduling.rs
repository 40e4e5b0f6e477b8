//! Pool scheduling (issue 57): leases of several slots, waiters' priorities
//! and the strict line, through one gateway and two, and a killed
//! authority's slots kept. (`scripts/test` runs these in keeper mode too.)

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use super::{listed, no_slot, until_waiting};
use crate::helpers::{
    Api, clickhouse_url, spawn_app, spawn_peer_process, two_peers, unique_schema,
};
use crate::pool_checker::{Grant, give_back, problem, take_with};

/// An acquire of `slots` of a pool of `limit` at `priority`, waiting `wait`.
fn asking(owner: &str, limit: u64, slots: u64, priority: i64, wait: f64) -> Value {
    json!({
        "owner": owner, "limit": limit, "slots": slots, "priority": priority,
        "ttl_seconds": 60, "wait_seconds": wait,
    })
}

/// A waiter's acquire, spawned: it is in line once the pool shows it.
fn waiting(api: &Api, name: &'static str, body: Value) -> tokio::task::JoinHandle<Grant> {
    let api = api.clone();
    tokio::spawn(async move { take_with(&api, name, &body).await })
}

/// The pool's view, which must exist.
async fn view(api: &Api, name: &str) -> Value {
    let view = api.pool_view(name).await;
    view.expect(StatusCode::OK);
    view.json()
}

/// The slots of a view's holders, oldest first.
fn holder_slots(view: &Value) -> Vec<u64> {
    view["holders"]
        .as_array()
        .unwrap_or_else(|| panic!("holders in {view}"))
        .iter()
        .map(|h| h["slots"].as_u64().expect("a holder's slots"))
        .collect()
}

/// The priorities of a view's waiters, in the order they will be granted.
fn priorities(view: &Value) -> Vec<i64> {
    view["waiters"]
        .as_array()
        .unwrap_or_else(|| panic!("waiters in {view}"))
        .iter()
        .map(|w| w["priority"].as_i64().expect("a waiter's priority"))
        .collect()
}

/// Acceptance 1: holders of 3 and 1 slots fill a pool of 4 (used 4), and a
/// 2-slot waiter is granted only once the 3-slot holder has gone: a narrow
/// release leaves it waiting, and the pool still turns others away.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn holders_of_3_and_1_slots_fill_4_and_a_2_slot_waiter_waits_for_the_3() {
    let app = spawn_app().await;
    let name = "mixed-widths";
    let three = take_with(&app, name, &asking("three", 4, 3, 0, 0.0)).await;
    let one = take_with(&app, name, &asking("one", 4, 1, 0, 0.0)).await;
    assert_eq!(
        (three.body["slots"].as_u64(), one.body["slots"].as_u64()),
        (Some(3), Some(1))
    );
    let shown = view(&app, name).await;
    assert_eq!(
        (shown["used"].as_u64(), shown["limit"].as_u64()),
        (Some(4), Some(4)),
        "{shown}"
    );
    assert_eq!(holder_slots(&shown), [3, 1], "{shown}");
    let full = no_slot(&app, name, 4, "pool-full", &[&three, &one]).await;
    assert_eq!(full["used"], 4, "{full}");

    let two = waiting(&app, name, asking("two", 4, 2, 0, 30.0));
    until_waiting(&app, name, 1).await;
    give_back(&app, name, &one).await;
    // 3 + 2 is over 4: it still waits, and a 1-slot acquire that would fit
    // is refused behind it.
    let behind = no_slot(&app, name, 4, "pool-full", &[&three]).await;
    assert_eq!(
        (behind["used"].as_u64(), behind["waiting"].as_u64()),
        (Some(3), Some(1)),
        "{behind}"
    );
    assert!(!two.is_finished(), "granted beside the 3-slot holder");
    give_back(&app, name, &three).await;
    let two = two.await.unwrap();
    assert!(two.token > one.token, "{} after {}", two.token, one.token);
    let shown = view(&app, name).await;
    assert_eq!(
        (shown["used"].as_u64(), holder_slots(&shown)),
        (Some(2), vec![2]),
        "{shown}"
    );
    give_back(&app, name, &two).await;
}

/// What a worker saw of its lease: a sub-interval of it, and its width.
#[derive(Clone, Copy, Debug)]
struct Held {
    start: Instant,
    end: Instant,
    slots: u64,
}

/// The checker: the slots live at no instant exceed `limit`; answers the
/// most live at once.
fn check_widths(log: &[Held], limit: u64) -> u64 {
    // Ends before starts at a tie: the intervals are inside their leases.
    let mut events: Vec<(Instant, i64)> = log
        .iter()
        .flat_map(|h| [(h.start, h.slots as i64), (h.end, -(h.slots as i64))])
        .collect();
    events.sort();
    let (mut live, mut peak) = (0_i64, 0_i64);
    for (at, step) in events {
        live += step;
        assert!(
            live <= limit as i64,
            "{live} slots live at {at:?}, limit {limit}: {log:#?}"
        );
        peak = peak.max(live);
    }
    peak as u64
}

/// Workers of widths 1 to 3 on a pool of 4, through `gateways` in turn,
/// each at a priority of its own: never more than 4 slots held at once.
async fn widths_never_exceed_the_limit(gateways: &[Api], name: &'static str) {
    let log: Arc<Mutex<Vec<Held>>> = Arc::default();
    let tasks: Vec<_> = [3_u64, 1, 2, 1, 2, 3]
        .into_iter()
        .enumerate()
        .map(|(w, slots)| {
            let (api, log) = (gateways[w % gateways.len()].clone(), log.clone());
            tokio::spawn(async move {
                for cycle in 0..3 {
                    let owner = format!("worker-{w}-{cycle}");
                    let priority = (w as i64 % 3) - 1;
                    let grant =
                        take_with(&api, name, &asking(&owner, 4, slots, priority, 60.0)).await;
                    let start = Instant::now();
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    let end = Instant::now();
                    give_back(&api, name, &grant).await;
                    log.lock().unwrap().push(Held { start, end, slots });
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let log = log.lock().unwrap().clone();
    assert_eq!(log.len(), 18, "every cycle recorded");
    assert!(check_widths(&log, 4) >= 2, "holders never overlapped");
    gateways[0]
        .pool_view(name)
        .await
        .expect(StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_of_mixed_widths_never_hold_more_than_the_limit() {
    let app = spawn_app().await;
    widths_never_exceed_the_limit(std::slice::from_ref(&app.api), "checked-widths").await;
}

/// The checker itself fails on more slots live than the limit.
#[test]
fn the_width_checker_catches_too_many_slots() {
    let t0 = Instant::now();
    let held = |start: u64, end: u64, slots| Held {
        start: t0 + Duration::from_millis(start),
        end: t0 + Duration::from_millis(end),
        slots,
    };
    let log = [held(0, 10, 3), held(10, 20, 2), held(12, 15, 2)];
    assert_eq!(check_widths(&log, 4), 4);
    let over = [held(0, 10, 3), held(9, 20, 2)];
    assert!(std::panic::catch_unwind(|| check_widths(&over, 4)).is_err());
}

/// Acceptance 2: 0 slots, more than the limit, a fraction, and a priority
/// outside -1000..1000 are 400; the bounds themselves are taken. A lock
/// takes neither.
#[tokio::test]
async fn slots_and_priorities_out_of_range_are_refused() {
    let app = spawn_app().await;
    let name = "ranges";
    let bad = [
        json!({"slots": 0}),
        json!({"slots": 5}),
        json!({"slots": 1.5}),
        json!({"slots": -1}),
        json!({"priority": -1001}),
        json!({"priority": 1001}),
        json!({"priority": 0.5}),
        json!({"priority": "high"}),
    ];
    for extra in bad {
        let mut body = json!({"owner": "w", "limit": 4, "ttl_seconds": 60});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let reply = app.pool_acquire(name, &body).await;
        reply.expect_because(StatusCode::BAD_REQUEST, body.to_string());
        assert!(
            reply.problem_type().starts_with("invalid"),
            "{}",
            reply.text
        );
    }
    app.pool_view(name).await.expect(StatusCode::NOT_FOUND);
    for (slots, priority) in [(4, -1000), (1, 1000)] {
        let held = take_with(&app, name, &asking("w", 4, slots, priority, 0.0)).await;
        assert_eq!(held.body["slots"], slots);
        give_back(&app, name, &held).await;
    }
    let lock = app.acquire(name, &json!({"owner": "w", "slots": 1})).await;
    problem(&lock, StatusCode::BAD_REQUEST, "invalid-body");
}

/// Grants waiters of `priorities`, in arrival order through `via` in turn,
/// on a held pool of 1; answers their indexes in grant (token) order.
async fn grant_order(
    holder_api: &Api,
    via: &[Api],
    name: &'static str,
    priorities_in: &[i64],
) -> Vec<usize> {
    let holder = take_with(holder_api, name, &asking("holder", 1, 1, 0, 0.0)).await;
    let mut waiters = Vec::new();
    for (i, &priority) in priorities_in.iter().enumerate() {
        let api = via[i % via.len()].clone();
        let body = asking(&format!("waiter-{i}"), 1, 1, priority, 30.0);
        waiters.push(tokio::spawn(async move {
            let grant = take_with(&api, name, &body).await;
            give_back(&api, name, &grant).await;
            (i, grant.token)
        }));
        // Arrival is what the authority saw: it has this one in line.
        until_waiting(holder_api, name, i as u64 + 1).await;
    }
    let mut sorted = priorities_in.to_vec();
    sorted.sort_by(|a, b| b.cmp(a));
    assert_eq!(
        priorities(&view(holder_api, name).await),
        sorted,
        "the line's order"
    );
    give_back(holder_api, name, &holder).await;
    let mut granted = Vec::new();
    for waiter in waiters {
        granted.push(waiter.await.unwrap());
    }
    granted.sort_by_key(|(_, token)| *token);
    granted.into_iter().map(|(i, _)| i).collect()
}

/// Acceptance 3: waiters of priorities 0, 10, 5, 10 on a pool of 1 are
/// granted 10, 10, 5, 0, the two 10s in arrival order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_are_granted_by_priority_then_arrival() {
    let app = spawn_app().await;
    let order = grant_order(
        &app,
        std::slice::from_ref(&app.api),
        "by-priority",
        &[0, 10, 5, 10],
    )
    .await;
    assert_eq!(order, [1, 3, 2, 0]);
}

/// Acceptance 4: no barging. On a pool of 2 with a 1-slot holder, a 2-slot
/// waiter W1 waits, and a later 1-slot waiter W2 (which would fit) is not
/// granted before it; nor is a 1-slot acquire that cannot wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_later_narrow_waiter_does_not_pass_a_wide_one() {
    let app = spawn_app().await;
    let name = "no-barging";
    let holder = take_with(&app, name, &asking("holder", 2, 1, 0, 0.0)).await;
    let w1 = waiting(&app, name, asking("w1", 2, 2, 0, 30.0));
    until_waiting(&app, name, 1).await;
    let w2 = waiting(&app, name, asking("w2", 2, 1, 0, 30.0));
    until_waiting(&app, name, 2).await;
    let turned_away = no_slot(&app, name, 2, "pool-full", &[&holder]).await;
    assert_eq!(turned_away["used"], 1, "a slot was free: {turned_away}");
    let shown = view(&app, name).await;
    assert_eq!(
        (shown["used"].as_u64(), holder_slots(&shown)),
        (Some(1), vec![1]),
        "{shown}"
    );
    give_back(&app, name, &holder).await;
    let w1 = w1.await.unwrap();
    assert!(!w2.is_finished(), "W2 granted beside W1's 2 of 2 slots");
    give_back(&app, name, &w1).await;
    let w2 = w2.await.unwrap();
    assert!(
        w1.token < w2.token,
        "W1 {} before W2 {}",
        w1.token,
        w2.token
    );
    give_back(&app, name, &w2).await;
}

/// Acceptance 5: through a second gateway the pool is the same one: widths
/// never exceed the limit, and waiters coming through either are granted
/// by priority, then arrival.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_gateways_schedule_one_pool() {
    let (a, b) = two_peers().await;
    let both = [a.api.clone(), b.api.clone()];
    widths_never_exceed_the_limit(&both, "across-widths").await;
    let order = grant_order(
        &a.api,
        &[b.api.clone(), a.api.clone()],
        "across-priority",
        &[0, 10, 5, 10],
    )
    .await;
    assert_eq!(order, [1, 3, 2, 0]);
}

/// Acceptance 5 (authority deaths): the authority holds 3 slots of 4 and is
/// killed -9. The survivor grants the 1 free slot, and 2 more only once the
/// dead 3-slot lease would have expired, with greater tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_authoritys_slots_are_kept_until_its_lease_would_have_expired() {
    let schema = unique_schema();
    let name = "killed-widths";
    // A claim TTL (1 s) well below the lease's (4 s): a survivor that forgot
    // the dead lease's slots could grant them long before it expires.
    let flags = [
        "--schema",
        &schema,
        "--claim-ttl",
        "1s",
        "--claim-settle",
        "200ms",
    ];
    let mut first = spawn_peer_process(&clickhouse_url(), &flags).await;
    let survivor = spawn_peer_process(&clickhouse_url(), &flags).await;
    let body = json!({"owner": "dead", "limit": 4, "slots": 3, "ttl_seconds": 4});
    let dead = take_with(&first.api(), name, &body).await;
    first.child.kill().await.expect("kill -9");
    let api = survivor.api();
    let after = |owner: &str, slots| json!({"owner": owner, "limit": 4, "slots": slots, "ttl_seconds": 30, "wait_seconds": 10});
    let one = take_after_takeover(&api, name, &after("one", 1)).await;
    assert!(one.token > dead.token, "{} after {}", one.token, dead.token);
    let two = take_after_takeover(&api, name, &after("two", 2)).await;
    assert!(
        two.acquired_ms >= dead.expires_ms,
        "2 slots granted beside the dead lease's 3: {} while {} held",
        two.body,
        dead.body
    );
    assert!(two.token > one.token);
    let shown = view(&api, name).await;
    assert_eq!(shown["used"], 3, "{shown}");
}

/// The authority holding both slots of a pool is killed -9: until its lease
/// would have expired, the survivor's 409 `pool-full` counts it in `used` and
/// names it among the `holders`, with its dead authority's `gateway_id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_pool_names_a_killed_authoritys_lease_as_a_holder() {
    let schema = unique_schema();
    let name = "killed-holder";
    let flags = [
        "--schema",
        &schema,
        "--claim-ttl",
        "3s",
        "--claim-settle",
        "200ms",
    ];
    let mut first = spawn_peer_process(&clickhouse_url(), &flags).await;
    let survivor = spawn_peer_process(&clickhouse_url(), &flags).await;
    // Longer than the take-over (the claim TTL) takes on a loaded machine.
    let info = json!({"host": "runner-1"});
    let body = json!({"owner": "dead", "limit": 2, "slots": 2, "ttl_seconds": 20, "info": info});
    let dead = take_with(&first.api(), name, &body).await;
    let authority = view(&first.api(), name).await["holders"][0]["gateway_id"].clone();
    // A pool lease's row is written before its grant is answered.
    first.child.kill().await.expect("kill -9");

    let ask = json!({"owner": "next", "limit": 2, "ttl_seconds": 30, "wait_seconds": 1});
    let give_up = Instant::now() + Duration::from_secs(60);
    let full = loop {
        let reply = survivor.api().pool_acquire(name, &ask).await;
        if reply.status != StatusCode::SERVICE_UNAVAILABLE {
            break reply;
        }
        assert!(Instant::now() < give_up, "{}", reply.text);
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    problem(&full, StatusCode::CONFLICT, "pool-full");
    let shown = full.json();
    assert_eq!(shown["used"], 2, "{shown}");
    let holders = shown["holders"].as_array().expect("holders");
    assert_eq!(holders.len(), 1, "{shown}");
    let holder = &holders[0];
    assert_eq!(holder["owner"], "dead");
    assert_eq!(holder["fencing_token"], dead.token);
    assert_eq!(holder["expires_at"], dead.body["expires_at"]);
    assert_eq!(holder["slots"], 2);
    assert_eq!(holder["info"], info);
    assert_eq!(holder["gateway_id"], authority, "its authority, now dead");
    // GET shows it as the 409 does, alone and in the list, until it would
    // have expired; then none holds or waits.
    let api = survivor.api();
    let got = view(&api, name).await;
    assert_eq!(
        (&got["used"], &got["holders"]),
        (&shown["used"], &shown["holders"])
    );
    assert_eq!(listed(&api, name).await, Some(got));
    let gone = loop {
        let reply = api.pool_view(name).await;
        if reply.status != StatusCode::OK {
            break reply;
        }
        assert!(Instant::now() < give_up, "{}", reply.text);
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    gone.expect(StatusCode::NOT_FOUND);
    assert_eq!(listed(&api, name).await, None);
}

/// Acquires `body` through `api`, retrying while the dead authority's claim
/// has not lapsed (503); the 20 s is a give-up, not a bound under test.
async fn take_after_takeover(api: &Api, name: &str, body: &Value) -> Grant {
    let give_up = Instant::now() + Duration::from_secs(20);
    loop {
        let reply = api.pool_acquire(name, body).await;
        if reply.status == StatusCode::SERVICE_UNAVAILABLE && Instant::now() < give_up {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        return Grant::from_reply(&reply, StatusCode::CREATED);
    }
}
