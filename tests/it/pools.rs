//! Pools (issue 37) through one gateway: up to `limit` leases at a time,
//! FIFO for the rest, a 409 that says who holds the slots, limits that
//! must agree, info shown wherever a holder is, token scopes, renew,
//! release, the admin's end of a pool, a lock-delay that keeps its slot, and
//! the pool gauges on /metrics.
//! (`scripts/test` runs these in keeper mode too.)

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use statehouse::auth::Tokens;

use crate::helpers::{Api, Reply, ask, pool_path, spawn_app, spawn_app_with};
use crate::lock_faults::millis;
use crate::pool_checker::{
    Grant, Slot, SlotLog, assert_shows_no_lease_id, check_slots, give_back, problem, refused, take,
    take_with,
};

/// An acquire that cannot wait, refused with `kind` (see [`refused`]).
async fn no_slot(api: &Api, name: &str, limit: u64, kind: &str, leases: &[&Grant]) -> Value {
    refused(
        &api.pool_acquire(name, &ask("turned-away", limit, 60, 0.0))
            .await,
        kind,
        leases,
    )
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|n| (*n).to_owned()).collect()
}

/// The owners of a view's (or a 409's) holders.
fn owners(body: &Value) -> BTreeSet<String> {
    body["holders"]
        .as_array()
        .unwrap_or_else(|| panic!("holders in {body}"))
        .iter()
        .map(|h| h["owner"].as_str().unwrap().to_owned())
        .collect()
}

/// Waits until the pool shows `n` waiters: a waiter is only in line once
/// the gateway says so. The 10 s is a give-up, not a bound under test.
async fn until_waiting(api: &Api, name: &str, n: u64) {
    let give_up = Instant::now() + Duration::from_secs(10);
    loop {
        let view = api.pool_view(name).await;
        if view.status == StatusCode::OK && view.json()["waiting"] == n {
            return;
        }
        assert!(Instant::now() < give_up, "never {n} waiting: {}", view.text);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The entry of `name` in GET /v1/pools, if listed.
async fn listed(api: &Api, name: &str) -> Option<Value> {
    let list = api.get("/v1/pools").await;
    list.expect(StatusCode::OK);
    list.json()["pools"]
        .as_array()
        .expect("pools")
        .iter()
        .find(|p| p["pool"] == name)
        .cloned()
}

/// `statehouse_pool_holders` and `statehouse_pool_waiting` of `name` on
/// /metrics, if the page shows them.
async fn gauges(api: &Api, name: &str) -> (Option<u64>, Option<u64>) {
    let page = api.get("/metrics").await.text;
    let value = |family: &str| {
        let series = format!("statehouse_{family}{{pool=\"{name}\"}} ");
        page.lines()
            .find_map(|line| line.strip_prefix(series.as_str()))
            .map(|v| v.trim().parse().expect("a whole number"))
    };
    (value("pool_holders"), value("pool_waiting"))
}

/// Acceptance 1: six workers on a pool of three, each holding 1 s: never
/// more than three at once, and three at once (the pool's whole width, so
/// the six go in two turns). The acceptance's 4.5 s for all six is that,
/// plus what the machine's load adds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn six_workers_on_three_slots_hold_at_most_three_and_three_at_once() {
    let app = spawn_app().await;
    let log = SlotLog::default();
    // All six POST at once: none is spawned late enough to find a free slot.
    let gate = Arc::new(tokio::sync::Barrier::new(6));
    let workers: Vec<_> = (0..6)
        .map(|w| {
            let (api, log, gate) = (app.api.clone(), log.clone(), gate.clone());
            tokio::spawn(async move {
                gate.wait().await;
                let asked = Instant::now();
                let grant = take(&api, "source-db", &format!("worker-{w}"), 3, 30, 10.0).await;
                let start = Instant::now();
                tokio::time::sleep(Duration::from_secs(1)).await;
                let end = Instant::now();
                give_back(&api, "source-db", &grant).await;
                log.lock()
                    .unwrap()
                    .push(Slot::of(&grant, asked, start, end));
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    assert_eq!(check_slots(&log, 3, 6), 3, "the pool's three slots at once");
}

/// Acceptance 2: a full pool's 409, the views with holders and waiting,
/// and 404 once nobody holds or waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_pool_says_who_holds_and_who_waits_and_is_gone_once_empty() {
    let app = spawn_app().await;
    let name = "warehouse";
    let info_a = json!({"host": "runner-a", "pid": 11, "command": "meltano run a"});
    let info_b = json!({"host": "runner-b", "pid": 22, "command": "meltano run b"});
    let a = take_with(
        &app,
        name,
        &json!({"owner": "run-a", "limit": 2, "ttl_seconds": 60, "info": info_a}),
    )
    .await;
    let b = take_with(
        &app,
        name,
        &json!({"owner": "run-b", "limit": 2, "ttl_seconds": 60, "info": info_b}),
    )
    .await;
    assert_eq!(a.body["limit"], 2);

    let full = no_slot(&app, name, 2, "pool-full", &[&a, &b]).await;
    assert_eq!(full["pool"], name);
    assert_eq!(full["limit"], 2);
    assert_eq!(full["waiting"], 0, "{full}");
    assert_eq!(owners(&full), set(&["run-a", "run-b"]));
    for holder in full["holders"].as_array().unwrap() {
        let (grant, info) = if holder["owner"] == "run-a" {
            (&a, &info_a)
        } else {
            (&b, &info_b)
        };
        assert_eq!(holder["info"], *info, "{full}");
        assert_eq!(holder["fencing_token"], grant.token, "{full}");
        assert!(holder["gateway_id"].as_str().is_some(), "{full}");
    }

    // A waiter blocks; while it does, every view counts it.
    let waiter = {
        let api = app.api.clone();
        tokio::spawn(async move { take(&api, name, "run-d", 2, 60, 30.0).await })
    };
    until_waiting(&app, name, 1).await;
    let view = app.pool_view(name).await;
    view.expect(StatusCode::OK);
    let view = view.json();
    assert_shows_no_lease_id(&view, &[&a, &b]);
    assert_eq!(
        (view["pool"].as_str(), view["limit"].as_u64()),
        (Some(name), Some(2)),
        "{view}"
    );
    assert_eq!(owners(&view), owners(&full), "{view}");
    let entry = listed(&app, name)
        .await
        .expect("a pool with holders is listed");
    assert_eq!(
        (entry["limit"].as_u64(), entry["waiting"].as_u64()),
        (Some(2), Some(1)),
        "{entry}"
    );
    assert_eq!(owners(&entry), owners(&full), "{entry}");
    assert_shows_no_lease_id(&entry, &[&a, &b]);
    let full = no_slot(&app, name, 2, "pool-full", &[&a, &b]).await;
    assert_eq!(full["waiting"], 1, "{full}");
    assert_eq!(gauges(&app, name).await, (Some(2), Some(1)), "/metrics");

    // A release gives the waiter the slot.
    give_back(&app, name, &a).await;
    let d = waiter.await.unwrap();
    assert!(d.token > b.token, "{} after {}", d.token, b.token);
    let view = app.pool_view(name).await.json();
    assert_eq!(owners(&view), set(&["run-b", "run-d"]));
    assert_eq!(view["waiting"], 0, "{view}");

    for lease in [&b, &d] {
        give_back(&app, name, lease).await;
    }
    let gone = app.pool_view(name).await;
    gone.expect(StatusCode::NOT_FOUND);
    assert_eq!(gone.problem_type(), "pool-not-found");
    assert_eq!(
        listed(&app, name).await,
        None,
        "an empty pool is not listed"
    );
    assert_eq!(gauges(&app, name).await, (None, None), "gone from /metrics");
}

/// Acceptance 3: one limit per pool while anyone holds it.
#[tokio::test]
async fn another_limit_is_refused_while_held_and_accepted_once_empty() {
    let app = spawn_app().await;
    let name = "api-quota";
    let held = take(&app, name, "first", 2, 60, 0.0).await;
    let mismatch = no_slot(&app, name, 3, "pool-limit-mismatch", &[&held]).await;
    assert_eq!(mismatch["pool"], name);
    assert_eq!(mismatch["limit"], 2, "names the pool's limit: {mismatch}");
    let view = app.pool_view(name).await.json();
    assert_eq!(
        (view["limit"].as_u64(), owners(&view).len()),
        (Some(2), 1),
        "nothing changed: {view}"
    );

    give_back(&app, name, &held).await;
    let again = take(&app, name, "second", 3, 60, 0.0).await;
    assert_eq!(again.body["limit"], 3);
    assert_eq!(app.pool_view(name).await.json()["limit"], 3);
}

/// Acceptance 4: waiters on a full pool of 1 are granted in arrival order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_are_granted_in_arrival_order() {
    let app = spawn_app().await;
    let name = "single";
    let holder = take(&app, name, "holder", 1, 60, 0.0).await;
    let mut waiters = Vec::new();
    for i in 0..4_u64 {
        let api = app.api.clone();
        waiters.push(tokio::spawn(async move {
            let grant = take(&api, name, &format!("waiter-{i}"), 1, 60, 30.0).await;
            give_back(&api, name, &grant).await;
            (i, grant)
        }));
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Arrival is what the gateway saw: wait until it has this one in line.
        until_waiting(&app, name, i + 1).await;
    }
    give_back(&app, name, &holder).await;
    let mut granted = Vec::new();
    for waiter in waiters {
        granted.push(waiter.await.unwrap());
    }
    granted.sort_by_key(|(_, g)| g.token);
    let order: Vec<u64> = granted.iter().map(|(i, _)| *i).collect();
    assert_eq!(order, [0, 1, 2, 3], "grant order by fencing token");
    assert!(granted[0].1.token > holder.token);
    for pair in granted.windows(2) {
        assert!(
            pair[0].1.acquired_ms <= pair[1].1.acquired_ms,
            "grant times: {:?}",
            granted
        );
    }
}

/// Acceptance 8 (pools' part): info is shown wherever the holder is; over 4 KiB is 400.
#[tokio::test]
async fn a_pool_leases_info_shows_everywhere_and_over_4_kib_is_refused() {
    let app = spawn_app().await;
    let name = "with-info";
    let info = json!({"host": "runner-7", "pid": 4242, "command": "meltano run tap target", "dag": "daily"});
    let held = take_with(
        &app,
        name,
        &json!({"owner": "w", "limit": 1, "ttl_seconds": 60, "info": info}),
    )
    .await;
    assert_eq!(held.body["info"], info, "the 201");
    let view = app.pool_view(name).await.json();
    assert_eq!(
        view["holders"][0]["info"], info,
        "GET /v1/pools/{{name}}: {view}"
    );
    let full = no_slot(&app, name, 1, "pool-full", &[&held]).await;
    assert_eq!(full["holders"][0]["info"], info, "the 409: {full}");
    // No wait was asked for, so none is said to have run out.
    assert_eq!(
        full["detail"],
        "pool \"with-info\" is full (1 of 1 slots held)"
    );

    // {"k":"…"} is 8 bytes around the value: 4097 in all, as for locks.
    let over = json!({"owner": "w", "limit": 1, "info": {"k": "x".repeat(4089)}});
    let reply = app.pool_acquire("big-info", &over).await;
    problem(&reply, StatusCode::BAD_REQUEST, "invalid-body");
    app.pool_view("big-info")
        .await
        .expect_because(StatusCode::NOT_FOUND, "no lease taken");
    take_with(
        &app,
        "big-info",
        &json!({"owner": "w", "limit": 1, "info": {"k": "x".repeat(4088)}}),
    )
    .await;
}

const ROOT: &str = "root-admin-token-0123456789";
const READ_A: &str = "team-a-read-token-0123456789";
const WRITE_A: &str = "team-a-write-token-0123456789";
const ADMIN_A: &str = "team-a-admin-token-0123456789";

/// Acceptance 9: a token scoped to team-a-* cannot touch team-b-src's pool
/// in any way, and lists only its own.
#[tokio::test]
async fn a_scoped_token_is_kept_to_pools_in_its_scope() {
    let app = spawn_app_with(|config| {
        let lines = format!(
            "admin {ROOT} root\n\
             read {READ_A} team-a dashboard scope=team-a-*\n\
             write {WRITE_A} team-a workers scope=team-a-*\n\
             admin {ADMIN_A} team-a operators scope=team-a-*\n"
        );
        let mut tokens = Tokens::default();
        tokens.add("test", &lines, '\n').unwrap();
        config.tokens = tokens;
    })
    .await;
    let outside = "team-b-src";
    let post = |name: &str, owner: &str, token: &'static str| {
        let (path, body) = (pool_path(name), ask(owner, 1, 600, 0.0));
        let api = app.api.clone();
        async move {
            api.call(Method::POST, &path, Some(&body.to_string()), token)
                .await
        }
    };
    let held = Grant::from_reply(&post(outside, "team-b", ROOT).await, StatusCode::CREATED);
    Grant::from_reply(
        &post("team-a-src", "team-a", WRITE_A).await,
        StatusCode::CREATED,
    );

    let lease_path = format!("{}/{}", pool_path(outside), held.lease_id);
    let renew = json!({"ttl_seconds": 30});
    let tries = [
        (
            Method::POST,
            pool_path(outside),
            Some(ask("team-a", 1, 60, 0.0).to_string()),
            WRITE_A,
        ),
        (Method::GET, pool_path(outside), None, READ_A),
        (Method::GET, pool_path(outside), None, WRITE_A),
        (
            Method::PUT,
            lease_path.clone(),
            Some(renew.to_string()),
            WRITE_A,
        ),
        (Method::DELETE, lease_path.clone(), None, WRITE_A),
        (
            Method::DELETE,
            format!("{}?reason=mine", pool_path(outside)),
            None,
            ADMIN_A,
        ),
    ];
    for (method, path, body, token) in tries {
        let reply = app
            .call(method.clone(), &path, body.as_deref(), token)
            .await;
        problem(&reply, StatusCode::FORBIDDEN, "out-of-scope");
    }
    // Nothing changed: the same lease holds the only slot.
    let view = app
        .call(Method::GET, &pool_path(outside), None, ROOT)
        .await
        .json();
    assert_eq!(view["holders"][0]["fencing_token"], held.token, "{view}");
    assert_eq!(
        (view["waiting"].as_u64(), owners(&view).len()),
        (Some(0), 1),
        "{view}"
    );
    let renew = json!({"ttl_seconds": 60});
    let renewed = app
        .call(Method::PUT, &lease_path, Some(&renew.to_string()), ROOT)
        .await;
    Grant::from_reply(&renewed, StatusCode::OK);

    let names = |reply: Reply| -> BTreeSet<String> {
        reply.expect(StatusCode::OK);
        reply.json()["pools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["pool"].as_str().unwrap().to_owned())
            .collect()
    };
    for token in [READ_A, WRITE_A, ADMIN_A] {
        let seen = names(app.call(Method::GET, "/v1/pools", None, token).await);
        assert_eq!(seen, set(&["team-a-src"]), "{token}");
    }
    let all = names(app.call(Method::GET, "/v1/pools", None, ROOT).await);
    assert_eq!(all, set(&["team-a-src", outside]));
}

#[tokio::test]
async fn a_renewal_moves_expires_at_and_keeps_lease_and_token() {
    let app = spawn_app().await;
    let held = take(&app, "renewed", "w", 2, 5, 0.0).await;
    let renewed = Grant::from_reply(
        &app.pool_renew("renewed", &held.lease_id, 600).await,
        StatusCode::OK,
    );
    assert_eq!(
        (renewed.lease_id.as_str(), renewed.token),
        (held.lease_id.as_str(), held.token)
    );
    assert!(
        renewed.expires_ms > held.expires_ms,
        "{} then {}",
        held.body,
        renewed.body
    );
    let view = app.pool_view("renewed").await.json();
    assert_eq!(
        view["holders"][0]["expires_at"], renewed.body["expires_at"],
        "{view}"
    );
}

#[tokio::test]
async fn a_lease_that_is_not_current_cannot_be_released_or_renewed() {
    let app = spawn_app().await;
    let name = "released";
    let gone = take(&app, name, "w", 2, 60, 0.0).await;
    let other = take(&app, name, "v", 2, 60, 0.0).await;
    give_back(&app, name, &gone).await;
    for reply in [
        app.pool_release(name, &gone.lease_id).await,
        app.pool_renew(name, &gone.lease_id, 60).await,
        app.pool_release(name, &uuid::Uuid::new_v4().to_string())
            .await,
    ] {
        problem(&reply, StatusCode::CONFLICT, "lease-not-current");
    }
    let view = app.pool_view(name).await.json();
    assert_eq!(
        view["holders"][0]["fencing_token"], other.token,
        "the other holds on: {view}"
    );
}

/// The admin ends a pool: every lease ends, its holders' renewals get 409.
#[tokio::test]
async fn an_admin_delete_ends_every_lease_of_the_pool() {
    let app = spawn_app().await;
    let name = "stuck-source";
    let leases = [
        take(&app, name, "a", 2, 600, 0.0).await,
        take(&app, name, "b", 2, 600, 0.0).await,
    ];
    let too_long = app.pool_end(name, &"r".repeat(513)).await;
    problem(&too_long, StatusCode::BAD_REQUEST, "invalid-query");
    assert_eq!(
        owners(&app.pool_view(name).await.json()).len(),
        2,
        "nothing ended"
    );

    let ended = app.pool_end(name, "source migration").await;
    ended.expect(StatusCode::NO_CONTENT);
    for lease in &leases {
        let renew = app.pool_renew(name, &lease.lease_id, 600).await;
        problem(&renew, StatusCode::CONFLICT, "lease-not-current");
    }
    app.pool_view(name).await.expect(StatusCode::NOT_FOUND);
    let next = take(&app, name, "c", 2, 60, 0.0).await;
    assert!(
        next.token > leases[1].token,
        "{} after {}",
        next.token,
        leases[1].token
    );
}

#[tokio::test]
async fn a_limit_outside_1_to_1000_is_refused() {
    let app = spawn_app().await;
    for limit in [0, 1001] {
        let reply = app.pool_acquire("limits", &ask("w", limit, 60, 0.0)).await;
        problem(&reply, StatusCode::BAD_REQUEST, "invalid-body");
    }
    app.pool_view("limits").await.expect(StatusCode::NOT_FOUND);
    for limit in [1, 1000] {
        let held = take(&app, &format!("limits-{limit}"), "w", limit, 60, 0.0).await;
        assert_eq!(held.body["limit"], limit);
    }
}

/// A pool lease with a lock-delay, ended by force: its slot stays taken
/// for the delay (spec: "each one's lock-delay keeps its slot").
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_forced_end_keeps_a_delayed_leases_slot_for_the_delay() {
    let app = spawn_app().await;
    let name = "delayed";
    let body = json!({"owner": "w", "limit": 1, "ttl_seconds": 600, "lock_delay_seconds": 2});
    let held = take_with(&app, name, &body).await;
    assert_eq!(held.body["lock_delay_seconds"], 2);
    let ended = app.pool_end(name, "stuck").await;
    ended.expect(StatusCode::NO_CONTENT);

    // The spec leaves the 409's type open: a full pool or a lock-delay.
    let busy = app.pool_acquire(name, &ask("next", 1, 60, 0.0)).await;
    busy.expect_because(StatusCode::CONFLICT, "the slot is kept");
    let kind = busy.problem_type();
    assert!(
        ["pool-full", "lock-delay"].contains(&kind.as_str()),
        "{kind}"
    );
    assert_eq!(busy.json()["limit"], 1, "the pool's limit: {}", busy.text);
    let free_at = busy.json()["free_at"].as_str().map(millis);

    let next = take(&app, name, "next", 1, 60, 10.0).await;
    // The force came after the grant, so the delay ends after grant + 2 s.
    assert!(
        next.acquired_ms >= held.acquired_ms + 2000,
        "{} then {}",
        held.body,
        next.body
    );
    if let Some(free_at) = free_at {
        assert!(
            next.acquired_ms >= free_at,
            "granted before free_at: {}",
            next.body
        );
    }
    assert!(next.token > held.token);
}

mod scheduling;
