//! A lone table-mode gateway claims fresh ids without settling (see
//! docs/gateways.md, "A lone gateway claims without settling"); a second
//! gateway that starts meanwhile never holds an id at once with it, also
//! when the newcomer's first requests aim at the very ids being claimed.
//! Neither advertises a URL, so each grants only under a claim of its own:
//! two claims on one id would show as two leases at once. Run in either
//! mode (with STATEHOUSE_COORDINATION=keeper too).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;
use statehouse::config::parse_clickhouse_url;
use statehouse::domain::{Coordination, StateId};
use statehouse::metrics::Metrics;
use statehouse::store::{ClickHouse, History, Identifier, Store};
use uuid::Uuid;

use crate::api::Api;
use crate::api::retried;
use crate::checker::{Held, Log, check};
use crate::helpers::{
    clickhouse_url, metric, raw_sql, spawn_configured, test_config, unique_schema,
};

/// Fresh ids the first gateway locks one after the other.
const IDS: usize = 12;
/// How long each lease is held before its release.
const HOLD: Duration = Duration::from_millis(100);
/// The first gateway's grants before the second starts.
const ALONE_FIRST: usize = 3;

/// Every lease granted, per id.
#[derive(Clone, Default)]
struct Grants(Arc<Mutex<HashMap<String, Log>>>);

impl Grants {
    fn log(&self, id: &str) -> Log {
        self.0
            .lock()
            .unwrap()
            .entry(id.to_owned())
            .or_default()
            .clone()
    }

    /// No two leases on one id at once, tokens rising in lease order;
    /// answers how many were granted.
    fn check(&self) -> usize {
        let logs = self.0.lock().unwrap();
        let mut granted = 0;
        for log in logs.values() {
            let held = log.lock().unwrap().len();
            check(log, held);
            granted += held;
        }
        granted
    }
}

/// Acquires `id` through `api` with a short wait; holds and releases a
/// lease it got, recording it. Answers whether one was granted.
async fn hold(api: &Api, id: &str, who: &str, grants: &Grants) -> bool {
    let body = json!({"owner": who, "ttl_seconds": 30, "wait_seconds": 1});
    let reply = api.acquire(id, &body).await;
    if reply.status != StatusCode::CREATED {
        // Held under the other gateway's claim, or its claim is on its way.
        assert!(
            [StatusCode::CONFLICT, StatusCode::SERVICE_UNAVAILABLE].contains(&reply.status),
            "{who} {id}: {} {}",
            reply.status,
            reply.text
        );
        return false;
    }
    let lease = reply.json();
    let (lease_id, token) = (
        lease["lease_id"].as_str().unwrap().to_owned(),
        lease["fencing_token"].as_u64().unwrap(),
    );
    let start = Instant::now();
    tokio::time::sleep(HOLD).await;
    let end = Instant::now();
    retried(|| api.release(id, &lease_id))
        .await
        .expect_because(StatusCode::NO_CONTENT, who);
    grants
        .log(id)
        .lock()
        .unwrap()
        .push(Held { start, end, token });
    true
}

/// Gateway a locks fresh ids one after the other; gateway b starts once a
/// has granted a few, and at once asks for ids too: with `aim`, the next
/// ones a is about to claim, else the ones a has just released (its claims
/// still held).
async fn second_gateway_starts_while_the_first_grants(aim: bool) {
    let schema = unique_schema();
    let a = spawn_configured(test_config(&schema)).await;
    let grants = Grants::default();
    let next = Arc::new(AtomicUsize::new(0));
    let first = {
        let (api, grants, next) = (a.api.clone(), grants.clone(), next.clone());
        tokio::spawn(async move {
            let mut granted = 0;
            for n in 0..IDS {
                next.store(n, Ordering::SeqCst);
                if hold(&api, &format!("fresh-{n}"), "a", &grants).await {
                    granted += 1;
                }
            }
            next.store(IDS, Ordering::SeqCst);
            granted
        })
    };
    while next.load(Ordering::SeqCst) < ALONE_FIRST {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let b = spawn_configured(test_config(&schema)).await;
    // Each id is asked for once through b: with `aim` as a is about to
    // claim it, else just after a released it.
    let mut asks = Vec::new();
    let mut asked = 0;
    while asked < IDS {
        let n = next.load(Ordering::SeqCst);
        let due = if aim { n + 1 } else { n.saturating_sub(1) };
        for k in asked..=due.min(IDS - 1) {
            let (api, grants) = (b.api.clone(), grants.clone());
            asks.push(tokio::spawn(async move {
                hold(&api, &format!("fresh-{k}"), "b", &grants).await
            }));
        }
        asked = asked.max(due.min(IDS - 1) + 1);
        if n >= IDS {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let granted_by_a = first.await.unwrap();
    for ask in asks {
        ask.await.unwrap();
    }
    assert!(granted_by_a >= ALONE_FIRST, "a granted while alone");
    assert!(grants.check() >= granted_by_a);
}

#[tokio::test]
async fn a_second_gateway_starting_while_a_lone_one_grants_fresh_ids_never_shares_one() {
    second_gateway_starts_while_the_first_grants(false).await;
}

#[tokio::test]
async fn a_newcomer_aiming_at_the_ids_being_claimed_never_shares_one() {
    second_gateway_starts_while_the_first_grants(true).await;
}

/// A lone gateway beside the record of a gateway of an earlier version (a
/// table-mode row in `<table>_gateways` with no members row: such a gateway
/// keeps none, and waits nothing after it starts) settles every claim: it
/// decides none alone (docs/gateways.md, the upgrade case). Table mode only.
#[tokio::test]
async fn a_lone_gateway_beside_a_gateway_of_an_earlier_version_settles_every_claim() {
    let schema = unique_schema();
    let config = test_config(&schema);
    if config.locks.coordination != Coordination::Table {
        return;
    }
    let app = spawn_configured(config).await;
    raw_sql(&format!(
        "INSERT INTO `{schema}`.state_gateways (gateway_id, coordination, expires_at, version)
         SETTINGS async_insert=0
         VALUES (generateUUIDv4(), 'table', now64(3) + INTERVAL 15 SECOND, 1)"
    ))
    .await;
    for n in 0..3 {
        let id = format!("upgrade-{n}");
        let (lease, _) = app.api.lease(&id, "new", 30, 30.0).await;
        retried(|| app.api.release(&id, &lease))
            .await
            .expect_because(StatusCode::NO_CONTENT, "new");
    }
    let metrics = app.api.get("/metrics").await.text;
    let event = |name: &str| {
        metric(
            &metrics,
            &format!(r#"statehouse_lock_events_total{{event="{name}"}}"#),
        )
    };
    assert!(event("claim_win") >= Some(3.0), "each id claimed");
    assert_eq!(event("claim_alone"), Some(0.0));
}

/// The decision read (docs/gateways.md, rule 3) answers in one statement
/// what a lone member's claim is decided by: the id's candidates, its last
/// fencing token, and whether another gateway may claim. Table mode's tables.
#[tokio::test]
async fn the_decision_read_finds_the_candidates_the_last_token_and_the_other_members() {
    let schema = unique_schema();
    let target = parse_clickhouse_url(&clickhouse_url()).expect("a valid ClickHouse URI");
    let ch = ClickHouse::new(
        &target,
        Duration::from_secs(30),
        Arc::new(Metrics::default()),
    );
    let store = Store::new(
        ch,
        Identifier::parse(&schema).unwrap(),
        &Identifier::parse("state").unwrap(),
        History::Off,
    );
    store.ensure_schema().await.expect("tables made");
    let (me, other) = (Uuid::new_v4(), Uuid::new_v4());
    let id = StateId::parse("decided").unwrap();
    let (leases, members) = (&store.leases, &store.members);
    let ttl = Duration::from_secs(15);
    members.beat(me, ttl).await.unwrap();
    let claim = Uuid::new_v4();
    let url = "http://me";
    leases
        .propose_claim(&id, claim, me, url, ttl)
        .await
        .unwrap();
    leases.reserve_tokens(&id, 2047).await.unwrap();

    let (locks, others) = leases.id_locks_and_others(&id, members, me).await.unwrap();
    assert!(!others, "alone among the members");
    let line: Vec<Uuid> = locks.candidates.iter().map(|c| c.claim_id).collect();
    assert_eq!(line, [claim]);
    assert_eq!(locks.last_token, 2047);
    assert!(locks.leases.is_empty(), "the reservation is no lease");

    members.beat(other, ttl).await.unwrap();
    let (_, others) = leases.id_locks_and_others(&id, members, me).await.unwrap();
    assert!(others, "another live member may claim");
}
