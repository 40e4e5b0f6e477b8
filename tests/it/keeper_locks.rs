//! Locks in keeper mode (`--coordination keeper`): claims in KeeperMap, so
//! gateways on different ClickHouse nodes (whose MergeTree tables never
//! meet) still grant one lease at a time; a crashed authority's claim
//! lapses to the survivor; with Keeper gone, nothing is granted.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;
use statehouse::config::parse_clickhouse_url;
use statehouse::domain::Coordination;

use crate::checker::{self, Work};
use crate::helpers::{
    TestApp, clickhouse_url, node_b_url, peer_config, spawn_configured, spawn_peer_process,
    test_config, unique_schema,
};
use crate::keeper_loss::KeeperNode;
use crate::proxy::Proxy;

/// A keeper-mode gateway in this process on the ClickHouse at `url`.
async fn keeper_gateway(schema: &str, url: &str) -> TestApp {
    let mut config = peer_config(schema);
    config.clickhouse = parse_clickhouse_url(url).unwrap();
    config.locks.coordination = Coordination::Keeper;
    spawn_configured(config).await
}

/// Two gateways, each on its own ClickHouse node, share only Keeper: 8
/// workers spread over both lock one id in turn, never two at once, with
/// fencing tokens rising in grant order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gateways_on_two_clickhouse_nodes_grant_one_lease_at_a_time() {
    let schema = unique_schema();
    let a = keeper_gateway(&schema, &clickhouse_url()).await;
    let b = keeper_gateway(&schema, &node_b_url()).await;
    let api_for = |w: usize| {
        if w.is_multiple_of(2) {
            a.api.clone()
        } else {
            b.api.clone()
        }
    };
    // No counter: the nodes' state tables never meet.
    checker::run(api_for, "two-nodes", 8, 6, Work::Nothing).await;
}

/// The first acquires of many ids, at once on both nodes: each id has one
/// winner, whose token is above every token that id had.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn first_acquires_racing_on_two_nodes_have_one_winner_each() {
    let schema = unique_schema();
    let a = keeper_gateway(&schema, &clickhouse_url()).await;
    let b = keeper_gateway(&schema, &node_b_url()).await;
    for n in 0..10 {
        let id = format!("fresh-{n}");
        let body = json!({"owner": "w", "ttl_seconds": 30, "wait_seconds": 0});
        let (one, two) = tokio::join!(a.acquire(&id, &body), b.acquire(&id, &body));
        let granted = [&one, &two]
            .iter()
            .filter(|r| r.status == StatusCode::CREATED)
            .count();
        assert_eq!(granted, 1, "{id}: {} / {}", one.text, two.text);
        let loser = if one.status == StatusCode::CREATED {
            &two
        } else {
            &one
        };
        assert_eq!(loser.problem_type(), "lock-held", "{}", loser.text);
    }
}

/// kill -9 of the authority: its claim lapses, and the survivor on the other
/// node grants within the claim TTL and 5 s, with a higher fencing token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_authoritys_claim_lapses_to_the_survivor_with_a_higher_token() {
    let schema = unique_schema();
    let args = [
        "--schema",
        schema.as_str(),
        "--coordination",
        "keeper",
        "--claim-ttl",
        "3s",
    ];
    let mut a = spawn_peer_process(&clickhouse_url(), &args).await;
    let b = spawn_peer_process(&node_b_url(), &args).await;
    let (_, token) = a.api().lease("crash", "on-a", 600, 0.0).await;
    a.child.kill().await.expect("kill -9");
    let killed = Instant::now();
    let until = killed + Duration::from_secs(3 + 5);
    let next = loop {
        let reply = b
            .api()
            .acquire(
                "crash",
                &json!({"owner": "on-b", "ttl_seconds": 30, "wait_seconds": 1}),
            )
            .await;
        if reply.status == StatusCode::CREATED {
            break reply;
        }
        assert!(
            matches!(
                reply.status,
                StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT
            ),
            "{}",
            reply.text
        );
        assert!(
            Instant::now() < until,
            "no grant within claim TTL + 5 s: {}",
            reply.text
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let next_token = next.json()["fencing_token"].as_u64().unwrap();
    assert!(next_token > token, "{next_token} after {token}");
}

/// With ZooKeeper killed no acquire is granted: each gets a 503 problem
/// within 45 s. Once ZooKeeper is back, grants resume within 90 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_keeper_nothing_is_granted_and_grants_resume_when_it_returns() {
    let keeper = tokio::task::spawn_blocking(KeeperNode::start)
        .await
        .unwrap();
    // Each acquire below waits out the query timeout: 5 s, not the tests'
    // 10 s, with a claim TTL (6 s) that leaves a claim renewed just before
    // the kill less than a grant's margin (3 s) once one has timed out.
    let mut config = peer_config(&unique_schema());
    config.clickhouse = parse_clickhouse_url(&keeper.url).unwrap();
    config.locks.coordination = Coordination::Keeper;
    config.query_timeout = Duration::from_secs(5);
    config.locks.claim_ttl = Duration::from_secs(6);
    let gateway = spawn_configured(config).await;
    let (lease, token) = gateway.lease("before", "w", 30, 0.0).await;
    gateway
        .release("before", &lease)
        .await
        .expect(StatusCode::NO_CONTENT);

    keeper.kill_zookeeper();
    // "before" is still claimed here, but by the time the fresh id's
    // acquire has timed out the claim has less validity left than a grant
    // needs: it must be renewed in Keeper.
    for id in ["fresh-while-down", "before"] {
        let asked = Instant::now();
        let reply = gateway
            .acquire(
                id,
                &json!({"owner": "w", "ttl_seconds": 30, "wait_seconds": 0}),
            )
            .await;
        reply.expect_because(StatusCode::SERVICE_UNAVAILABLE, id);
        assert_eq!(reply.problem_type(), "clickhouse-unavailable");
        assert_eq!(reply.header("retry-after"), Some("1"), "{id}");
        assert!(
            asked.elapsed() < Duration::from_secs(45),
            "{id}: {:?}",
            asked.elapsed()
        );
    }

    keeper.start_zookeeper();
    let back = Instant::now();
    let granted = loop {
        let reply = gateway
            .acquire(
                "before",
                &json!({"owner": "w", "ttl_seconds": 30, "wait_seconds": 1}),
            )
            .await;
        if reply.status == StatusCode::CREATED {
            break reply;
        }
        reply.expect(StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            back.elapsed() < Duration::from_secs(90),
            "no grant within 90 s of Keeper's return"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(granted.json()["fencing_token"].as_u64().unwrap() > token);
}

/// The Keeper claim renewal, as it goes to ClickHouse.
const CLAIM_RENEWAL: &str = "UPDATE\n                expires_ms = ";

/// A claim write that wins, followed by a renewal that fails: the claim is
/// withdrawn, so another gateway is granted the id within the unconfirmed-
/// grant time (3 s), not after the claim TTL (12 s) it was written with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_won_claim_whose_renewal_fails_is_withdrawn() {
    let schema = unique_schema();
    let proxy = Proxy::to_clickhouse().await;
    // No advertised URL: the other gateway waits in line instead of
    // forwarding to this one.
    let mut config = test_config(&schema);
    config.locks.coordination = Coordination::Keeper;
    config.locks.claim_ttl = Duration::from_secs(12);
    proxy.route(&mut config);
    let a = spawn_configured(config).await;
    let b = keeper_gateway(&schema, &clickhouse_url()).await;

    // Each round trip takes 2 s: the claim is won with less than the
    // grant margin left (half the TTL), so it is renewed before the grant,
    // and that renewal is cut.
    proxy.set_delay(Duration::from_secs(2));
    proxy.refuse_requests_containing(Some(CLAIM_RENEWAL));
    let reply = a
        .acquire(
            "renewal-fails",
            &json!({"owner": "a", "ttl_seconds": 30, "wait_seconds": 0}),
        )
        .await;
    reply.expect(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.header("retry-after"), Some("1"));
    proxy.set_delay(Duration::ZERO);
    proxy.refuse_requests_containing(None);

    // Granted once a's withdrawal lands (or, were it lost, once a's claim
    // lapses): a wait long enough for either on a loaded machine, where the
    // 3 s it was once met a 409.
    let reply = b
        .acquire(
            "renewal-fails",
            &json!({"owner": "b", "ttl_seconds": 30, "wait_seconds": 30}),
        )
        .await;
    reply.expect(StatusCode::CREATED);
}
