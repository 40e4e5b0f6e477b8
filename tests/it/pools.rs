//! Pools (issue 37) through one gateway: up to `limit` leases at a time,
//! FIFO for the rest, a 409 that says who holds the slots, limits that
//! must agree, info shown wherever a holder is, token scopes, renew,
//! release, the admin's end of a pool and a lock-delay that keeps its slot.
//! (`scripts/test` runs these in keeper mode too.) The pool API helpers
//! here are shared with `pool_checker`.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use statehouse::auth::Tokens;

use crate::helpers::{Api, Reply, encode_id, spawn_app, spawn_app_with};
use crate::lock_faults::millis;
use crate::pool_checker::{Slot, SlotLog, check_slots};

pub fn pool_path(name: &str) -> String {
    format!("/v1/pools/{}", encode_id(name))
}

/// An acquire body with the fields every test sets.
pub fn ask(owner: &str, limit: u64, ttl: u64, wait: f64) -> Value {
    json!({"owner": owner, "limit": limit, "ttl_seconds": ttl, "wait_seconds": wait})
}

/// POST /v1/pools/{name}, as sent; `Api::request` checks the answer against openapi.yaml.
pub async fn pool_acquire(api: &Api, name: &str, body: &Value) -> Reply {
    api.request(Method::POST, &pool_path(name), Some(&body.to_string()), &[])
        .await
}

pub async fn pool_renew(api: &Api, name: &str, lease_id: &str, ttl: u64) -> Reply {
    let body = json!({ "ttl_seconds": ttl }).to_string();
    let path = format!("{}/{lease_id}", pool_path(name));
    api.request(Method::PUT, &path, Some(&body), &[]).await
}

pub async fn pool_release(api: &Api, name: &str, lease_id: &str) -> Reply {
    let path = format!("{}/{lease_id}", pool_path(name));
    api.request(Method::DELETE, &path, None, &[]).await
}

pub async fn pool_view(api: &Api, name: &str) -> Reply {
    api.get(&pool_path(name)).await
}

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
        assert_eq!(reply.status, status, "{}", reply.text);
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
    Grant::from_reply(&pool_acquire(api, name, body).await, StatusCode::CREATED)
}

pub async fn take(api: &Api, name: &str, owner: &str, limit: u64, ttl: u64, wait: f64) -> Grant {
    take_with(api, name, &ask(owner, limit, ttl, wait)).await
}

/// The 409 of an acquire on a full pool: checks its problem type, and that
/// no lease id (the key, or any of `leases`) is anywhere in it: a lease id
/// is what renews and releases, so only its holder may know it.
pub fn refused(reply: &Reply, kind: &str, leases: &[&Grant]) -> Value {
    assert_eq!(reply.status, StatusCode::CONFLICT, "{}", reply.text);
    assert_eq!(reply.problem_type(), kind, "{}", reply.text);
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

/// The owners of a view's (or a 409's) holders.
pub fn owners(body: &Value) -> BTreeSet<String> {
    body["holders"]
        .as_array()
        .unwrap_or_else(|| panic!("holders in {body}"))
        .iter()
        .map(|h| h["owner"].as_str().unwrap().to_owned())
        .collect()
}

/// Waits until the pool shows `n` waiters: a waiter is only in line once
/// the gateway says so. The 10 s is a give-up, not a bound under test.
pub async fn until_waiting(api: &Api, name: &str, n: u64) {
    let give_up = Instant::now() + Duration::from_secs(10);
    loop {
        let view = pool_view(api, name).await;
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
    assert_eq!(list.status, StatusCode::OK, "{}", list.text);
    list.json()["pools"]
        .as_array()
        .expect("pools")
        .iter()
        .find(|p| p["pool"] == name)
        .cloned()
}

/// Acceptance 1: six workers on a pool of three, each holding 1 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn six_workers_on_three_slots_hold_at_most_three_and_finish_in_4_5_s() {
    let app = spawn_app().await;
    let log = SlotLog::default();
    // All six POST at once: none is spawned late enough to find a free slot.
    let gate = Arc::new(tokio::sync::Barrier::new(6));
    let started = Instant::now();
    let workers: Vec<_> = (0..6)
        .map(|w| {
            let (api, log, gate) = (app.api.clone(), log.clone(), gate.clone());
            tokio::spawn(async move {
                gate.wait().await;
                let grant = take(&api, "source-db", &format!("worker-{w}"), 3, 30, 10.0).await;
                let start = Instant::now();
                tokio::time::sleep(Duration::from_secs(1)).await;
                let end = Instant::now();
                let released = pool_release(&api, "source-db", &grant.lease_id).await;
                assert_eq!(released.status, StatusCode::NO_CONTENT, "{}", released.text);
                log.lock().unwrap().push(Slot::of(&grant, start, end));
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    let took = started.elapsed();
    check_slots(&log, 3, 6);
    assert!(
        took < Duration::from_millis(4500),
        "all six done after {took:?}"
    );
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

    let full = refused(
        &pool_acquire(&app, name, &ask("run-c", 2, 60, 0.0)).await,
        "pool-full",
        &[&a, &b],
    );
    assert_eq!(full["pool"], name);
    assert_eq!(full["limit"], 2);
    assert_eq!(full["waiting"], 0, "{full}");
    assert_eq!(
        owners(&full),
        BTreeSet::from(["run-a".into(), "run-b".into()])
    );
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
    let view = pool_view(&app, name).await;
    assert_eq!(view.status, StatusCode::OK, "{}", view.text);
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
    let full = refused(
        &pool_acquire(&app, name, &ask("run-e", 2, 60, 0.0)).await,
        "pool-full",
        &[&a, &b],
    );
    assert_eq!(full["waiting"], 1, "{full}");

    // A release gives the waiter the slot.
    assert_eq!(
        pool_release(&app, name, &a.lease_id).await.status,
        StatusCode::NO_CONTENT
    );
    let d = waiter.await.unwrap();
    assert!(d.token > b.token, "{} after {}", d.token, b.token);
    let view = pool_view(&app, name).await.json();
    assert_eq!(
        owners(&view),
        BTreeSet::from(["run-b".into(), "run-d".into()])
    );
    assert_eq!(view["waiting"], 0, "{view}");

    for lease in [&b, &d] {
        assert_eq!(
            pool_release(&app, name, &lease.lease_id).await.status,
            StatusCode::NO_CONTENT
        );
    }
    let gone = pool_view(&app, name).await;
    assert_eq!(gone.status, StatusCode::NOT_FOUND, "{}", gone.text);
    assert_eq!(gone.problem_type(), "pool-not-found");
    assert_eq!(
        listed(&app, name).await,
        None,
        "an empty pool is not listed"
    );
}

/// Acceptance 3: one limit per pool while anyone holds it.
#[tokio::test]
async fn another_limit_is_refused_while_held_and_accepted_once_empty() {
    let app = spawn_app().await;
    let name = "api-quota";
    let held = take(&app, name, "first", 2, 60, 0.0).await;
    let mismatch = refused(
        &pool_acquire(&app, name, &ask("second", 3, 60, 0.0)).await,
        "pool-limit-mismatch",
        &[&held],
    );
    assert_eq!(mismatch["pool"], name);
    assert_eq!(mismatch["limit"], 2, "names the pool's limit: {mismatch}");
    let view = pool_view(&app, name).await.json();
    assert_eq!(
        (view["limit"].as_u64(), owners(&view).len()),
        (Some(2), 1),
        "nothing changed: {view}"
    );

    assert_eq!(
        pool_release(&app, name, &held.lease_id).await.status,
        StatusCode::NO_CONTENT
    );
    let again = take(&app, name, "second", 3, 60, 0.0).await;
    assert_eq!(again.body["limit"], 3);
    assert_eq!(pool_view(&app, name).await.json()["limit"], 3);
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
            let released = pool_release(&api, name, &grant.lease_id).await;
            assert_eq!(released.status, StatusCode::NO_CONTENT, "{}", released.text);
            (i, grant)
        }));
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Arrival is what the gateway saw: wait until it has this one in line.
        until_waiting(&app, name, i + 1).await;
    }
    assert_eq!(
        pool_release(&app, name, &holder.lease_id).await.status,
        StatusCode::NO_CONTENT
    );
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
    let view = pool_view(&app, name).await.json();
    assert_eq!(
        view["holders"][0]["info"], info,
        "GET /v1/pools/{{name}}: {view}"
    );
    let full = refused(
        &pool_acquire(&app, name, &ask("other", 1, 60, 0.0)).await,
        "pool-full",
        &[&held],
    );
    assert_eq!(full["holders"][0]["info"], info, "the 409: {full}");

    // {"k":"…"} is 8 bytes around the value: 4097 in all, as for locks.
    let over = json!({"owner": "w", "limit": 1, "info": {"k": "x".repeat(4089)}});
    let reply = pool_acquire(&app, "big-info", &over).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{}", reply.text);
    assert_eq!(reply.problem_type(), "invalid-body");
    assert_eq!(
        pool_view(&app, "big-info").await.status,
        StatusCode::NOT_FOUND,
        "no lease taken"
    );
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

async fn call(api: &Api, method: Method, path: &str, body: Option<&Value>, token: &str) -> Reply {
    let bearer = format!("Bearer {token}");
    let body = body.map(Value::to_string);
    api.request(method, path, body.as_deref(), &[("authorization", &bearer)])
        .await
}

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
    let held = call(
        &app,
        Method::POST,
        &pool_path(outside),
        Some(&ask("team-b", 1, 600, 0.0)),
        ROOT,
    )
    .await;
    let held = Grant::from_reply(&held, StatusCode::CREATED);
    let mine = call(
        &app,
        Method::POST,
        &pool_path("team-a-src"),
        Some(&ask("team-a", 2, 600, 0.0)),
        WRITE_A,
    )
    .await;
    assert_eq!(mine.status, StatusCode::CREATED, "{}", mine.text);

    let lease_path = format!("{}/{}", pool_path(outside), held.lease_id);
    let renew = json!({"ttl_seconds": 30});
    let tries = [
        (
            Method::POST,
            pool_path(outside),
            Some(ask("team-a", 1, 60, 0.0)),
            WRITE_A,
        ),
        (Method::GET, pool_path(outside), None, READ_A),
        (Method::GET, pool_path(outside), None, WRITE_A),
        (Method::PUT, lease_path.clone(), Some(renew), WRITE_A),
        (Method::DELETE, lease_path, None, WRITE_A),
        (
            Method::DELETE,
            format!("{}?reason=mine", pool_path(outside)),
            None,
            ADMIN_A,
        ),
    ];
    for (method, path, body, token) in tries {
        let reply = call(&app, method.clone(), &path, body.as_ref(), token).await;
        assert_eq!(
            reply.status,
            StatusCode::FORBIDDEN,
            "{method} {path}: {}",
            reply.text
        );
        assert_eq!(reply.problem_type(), "out-of-scope", "{method} {path}");
    }
    // Nothing changed: the same lease holds the only slot.
    let view = call(&app, Method::GET, &pool_path(outside), None, ROOT)
        .await
        .json();
    assert_eq!(view["holders"][0]["fencing_token"], held.token, "{view}");
    assert_eq!(
        (view["waiting"].as_u64(), owners(&view).len()),
        (Some(0), 1),
        "{view}"
    );
    let renewed = call(
        &app,
        Method::PUT,
        &format!("{}/{}", pool_path(outside), held.lease_id),
        Some(&json!({"ttl_seconds": 600})),
        ROOT,
    )
    .await;
    assert_eq!(
        renewed.status,
        StatusCode::OK,
        "still current: {}",
        renewed.text
    );

    let names = |reply: Reply| -> BTreeSet<String> {
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
        reply.json()["pools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["pool"].as_str().unwrap().to_owned())
            .collect()
    };
    for token in [READ_A, WRITE_A, ADMIN_A] {
        let seen = names(call(&app, Method::GET, "/v1/pools", None, token).await);
        assert_eq!(seen, BTreeSet::from(["team-a-src".to_owned()]), "{token}");
    }
    let all = names(call(&app, Method::GET, "/v1/pools", None, ROOT).await);
    assert_eq!(
        all,
        BTreeSet::from(["team-a-src".to_owned(), outside.to_owned()])
    );
}

#[tokio::test]
async fn a_renewal_moves_expires_at_and_keeps_lease_and_token() {
    let app = spawn_app().await;
    let held = take(&app, "renewed", "w", 2, 5, 0.0).await;
    let renewed = Grant::from_reply(
        &pool_renew(&app, "renewed", &held.lease_id, 600).await,
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
    let view = pool_view(&app, "renewed").await.json();
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
    assert_eq!(
        pool_release(&app, name, &gone.lease_id).await.status,
        StatusCode::NO_CONTENT
    );
    for reply in [
        pool_release(&app, name, &gone.lease_id).await,
        pool_renew(&app, name, &gone.lease_id, 60).await,
        pool_release(&app, name, &uuid::Uuid::new_v4().to_string()).await,
    ] {
        assert_eq!(reply.status, StatusCode::CONFLICT, "{}", reply.text);
        assert_eq!(reply.problem_type(), "lease-not-current");
    }
    let view = pool_view(&app, name).await.json();
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
    let too_long = app
        .request(
            Method::DELETE,
            &format!("{}?reason={}", pool_path(name), "r".repeat(513)),
            None,
            &[],
        )
        .await;
    assert_eq!(
        too_long.status,
        StatusCode::BAD_REQUEST,
        "{}",
        too_long.text
    );
    assert_eq!(too_long.problem_type(), "invalid-query");
    assert_eq!(
        owners(&pool_view(&app, name).await.json()).len(),
        2,
        "nothing ended"
    );

    let ended = app
        .request(
            Method::DELETE,
            &format!("{}?reason=source%20migration", pool_path(name)),
            None,
            &[],
        )
        .await;
    assert_eq!(ended.status, StatusCode::NO_CONTENT, "{}", ended.text);
    for lease in &leases {
        let renew = pool_renew(&app, name, &lease.lease_id, 600).await;
        assert_eq!(renew.status, StatusCode::CONFLICT, "{}", renew.text);
        assert_eq!(renew.problem_type(), "lease-not-current");
    }
    assert_eq!(pool_view(&app, name).await.status, StatusCode::NOT_FOUND);
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
        let reply = pool_acquire(&app, "limits", &ask("w", limit, 60, 0.0)).await;
        assert_eq!(
            reply.status,
            StatusCode::BAD_REQUEST,
            "{limit}: {}",
            reply.text
        );
        assert_eq!(reply.problem_type(), "invalid-body", "{limit}");
    }
    assert_eq!(
        pool_view(&app, "limits").await.status,
        StatusCode::NOT_FOUND
    );
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
    let ended = app
        .request(
            Method::DELETE,
            &format!("{}?reason=stuck", pool_path(name)),
            None,
            &[],
        )
        .await;
    assert_eq!(ended.status, StatusCode::NO_CONTENT, "{}", ended.text);

    // The spec leaves the 409's type open: a full pool or a lock-delay.
    let busy = pool_acquire(&app, name, &ask("next", 1, 60, 0.0)).await;
    assert_eq!(
        busy.status,
        StatusCode::CONFLICT,
        "the slot is kept: {}",
        busy.text
    );
    let kind = busy.problem_type();
    assert!(
        kind == "pool-full" || kind == "lock-delay",
        "{kind}: {}",
        busy.text
    );
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
