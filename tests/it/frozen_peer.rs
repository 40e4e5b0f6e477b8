//! A frozen or black-holed authority is treated as a dead one (design.md,
//! "Several gateways", last paragraph): a request forwarded to it has its
//! own deadline, every client request is answered within its wait and 5 s,
//! and once its claim has lapsed and its leases would have expired, another
//! gateway grants its ids. Its stale writes are refused when it comes back.
//! The outage rule, a lease outliving a coordination outage of a gateway
//! that still answers its peers, is `lease_outage`'s.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::json;
use statehouse::auth::Tokens;

use crate::api::{Api, Reply, encode_id};
use crate::helpers::{GatewayProcess, clickhouse_target, clickhouse_url, free_port, peer_config};
use crate::helpers::{
    spawn_configured, spawn_gateway_process_on, spawn_peer_process, unique_schema,
};
use crate::proxy::Proxy;

/// What the contract allows past an acquire's wait, whatever a peer does.
const ANSWER_SLACK: Duration = Duration::from_secs(5);
/// The wait of the acquires asked through the other gateway.
const WAIT_SECONDS: u64 = 30;
/// How far into the pause the acquires are asked: the short lease has
/// expired by then, and the authority's claim may still be live.
const ASKED_INTO_PAUSE: Duration = Duration::from_secs(7);

/// How the authority is taken away from its peers.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// SIGSTOP: its port still takes connections, and nothing answers.
    Frozen,
    /// Its advertised address and its ClickHouse link are black holes: it
    /// runs on, and no request reaches it or leaves it.
    BlackHoled,
}

/// The authority A and what stands between it and the world.
struct Authority {
    process: GatewayProcess,
    /// Its advertised address and its ClickHouse link, for a black hole.
    links: Option<(Proxy, Proxy)>,
}

impl Authority {
    async fn start(schema: &str, fault: Fault) -> Self {
        let args = ["--schema", schema, "--claim-settle", "200ms"];
        match fault {
            Fault::Frozen => Self {
                process: spawn_peer_process(&clickhouse_url(), &args).await,
                links: None,
            },
            Fault::BlackHoled => {
                let port = free_port();
                let front = Proxy::start(([127, 0, 0, 1], port).into()).await;
                let clickhouse = Proxy::to_clickhouse().await;
                let target = clickhouse_target();
                let url = clickhouse_url().replacen(
                    &format!("{}:{}", target.host, target.port),
                    &clickhouse.addr.to_string(),
                    1,
                );
                let advertise = format!("http://{}", front.addr);
                let mut with_advertise = vec!["--advertise-url", advertise.as_str()];
                with_advertise.extend_from_slice(&args);
                let process =
                    spawn_gateway_process_on(port, &url, &with_advertise, "json", &[]).await;
                Self {
                    process,
                    links: Some((front, clickhouse)),
                }
            }
        }
    }

    fn api(&self) -> Api {
        self.process.api()
    }

    fn take_away(&self) {
        match &self.links {
            None => signal(&self.process, "-STOP"),
            Some((front, clickhouse)) => {
                front.set_black_hole(true);
                clickhouse.set_black_hole(true);
            }
        }
    }

    fn bring_back(&self) {
        match &self.links {
            None => signal(&self.process, "-CONT"),
            Some((front, clickhouse)) => {
                front.set_black_hole(false);
                clickhouse.set_black_hole(false);
            }
        }
    }
}

fn signal(process: &GatewayProcess, signal: &str) {
    let pid = process.child.id().expect("running").to_string();
    let status = std::process::Command::new("kill")
        .args([signal, &pid])
        .status()
        .unwrap();
    assert!(status.success(), "kill {signal} {pid}");
}

/// Waits until `api` reads a holder of `id` from the lease rows.
async fn recorded(api: &Api, id: &str) {
    for _ in 0..100 {
        if api.get(&format!("/v1/locks/{id}")).await.status == StatusCode::OK {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the lease on {id} was never recorded");
}

/// An acquire through `api`, timed; a hang past any answer the contract
/// allows fails the test instead of stalling it.
async fn timed_acquire(api: &Api, id: &str, owner: &str) -> (Reply, Duration) {
    let asked = Instant::now();
    let body = json!({"owner": owner, "ttl_seconds": 30, "wait_seconds": WAIT_SECONDS});
    let bound = Duration::from_secs(WAIT_SECONDS) + ANSWER_SLACK * 4;
    let reply = tokio::time::timeout(bound, api.acquire(id, &body))
        .await
        .unwrap_or_else(|_| panic!("no answer on {id} within {bound:?}"));
    (reply, asked.elapsed())
}

async fn an_authority_taken_away_is_treated_as_dead(fault: Fault) {
    let schema = unique_schema();
    let a = Authority::start(&schema, fault).await;
    let b_process = spawn_peer_process(
        &clickhouse_url(),
        &["--schema", &schema, "--claim-settle", "200ms"],
    )
    .await;
    let b = b_process.api();
    // A is the authority of both ids: one leased for 6 s, one for 60 s.
    let (long_lease, _) = a.api().lease("frozen-long", "long-holder", 60, 0.0).await;
    let (short_lease, short_token) = a.api().lease("frozen-short", "short-holder", 6, 0.0).await;
    // Other gateways know a lease by its row, written behind the grant.
    for id in ["frozen-long", "frozen-short"] {
        recorded(&b, id).await;
    }
    a.take_away();
    tokio::time::sleep(ASKED_INTO_PAUSE).await;

    let ((short, short_took), (long, long_took)) = tokio::join!(
        timed_acquire(&b, "frozen-short", "after-short"),
        timed_acquire(&b, "frozen-long", "after-long"),
    );
    let answer_bound = Duration::from_secs(WAIT_SECONDS) + ANSWER_SLACK;
    // The short lease has expired: the id is granted elsewhere within the wait.
    short.expect_because(
        StatusCode::CREATED,
        format!("{fault:?}: the 6 s lease expired"),
    );
    assert!(
        short_took <= answer_bound,
        "{fault:?}: granted after {short_took:?}"
    );
    let granted = short.json();
    assert!(granted["fencing_token"].as_u64().unwrap() > short_token);
    // The long lease is still the holder's: the wait runs out, and the
    // answer comes within it and the slack, whatever A does.
    long.expect_because(
        StatusCode::CONFLICT,
        format!("{fault:?}: the 60 s lease holds"),
    );
    assert!(
        long_took <= answer_bound,
        "{fault:?}: 409 after {long_took:?}"
    );

    // The new holder writes; then A comes back, and its stale writes are refused.
    let new_lease = granted["lease_id"].as_str().unwrap();
    b.put_state_with_lease(
        "frozen-short",
        &json!({"completed": {"by": "new"}}),
        new_lease,
    )
    .await
    .expect(StatusCode::CREATED);
    eprintln!("{fault:?}: granted after {short_took:?}, 409 after {long_took:?}");
    a.bring_back();
    for (id, lease) in [("frozen-short", &short_lease), ("frozen-long", &long_lease)] {
        let stale = a
            .api()
            .put_state_with_lease(id, &json!({"completed": {"by": "stale"}}), lease)
            .await;
        assert!(
            matches!(
                stale.status,
                StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE
            ),
            "{fault:?}: a stale write on {id} was not refused: {} {}",
            stale.status,
            stale.text
        );
    }
    let stored = b.get_state("frozen-short").await;
    assert_eq!(
        stored.expect(StatusCode::OK).json()["completed"]["by"],
        "new"
    );
    let long_stored = b.get_state("frozen-long").await;
    assert_eq!(
        long_stored.status,
        StatusCode::NOT_FOUND,
        "{}",
        long_stored.text
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_authority_is_passed_over_once_its_claim_and_leases_end() {
    an_authority_taken_away_is_treated_as_dead(Fault::Frozen).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_black_holed_authority_is_passed_over_once_its_claim_and_leases_end() {
    an_authority_taken_away_is_treated_as_dead(Fault::BlackHoled).await;
}

/// The other cluster's token, at least 16 characters.
const OTHER_TOKEN: &str = "other-cluster-token-0123";

/// A gateway now at the address an authority's claim names (one of another
/// cluster, or one started there since) is not that authority: it refuses
/// the requests forwarded to the authority, acting on nothing, and the
/// forwarding gateway answers as for an authority out of reach, until the
/// claim lapses and the id can be claimed elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gateway_at_the_authoritys_address_refuses_its_forwards_and_acts_on_nothing() {
    // Another cluster's gateway, with tokens of its own: it refuses before
    // any token check, so the forwarder learns its peer is not there.
    let mut other = peer_config(&unique_schema());
    let mut tokens = Tokens::default();
    tokens
        .add("other", &format!("write {OTHER_TOKEN}"), ',')
        .unwrap();
    other.tokens = tokens;
    let other_cluster = spawn_configured(other).await;
    let schema = unique_schema();
    let mut config = peer_config(&schema);
    config.locks.advertise_url = Some(other_cluster.base.clone());
    let a = spawn_configured(config).await;
    let b = spawn_configured(peer_config(&schema)).await;
    let id = "dev:at-anothers-address";
    let (lease, _) = a.lease(id, "holder", 60, 5.0).await;

    let acquire = b
        .acquire(id, &json!({"owner": "other", "ttl_seconds": 60}))
        .await;
    acquire.expect(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(acquire.problem_type(), "authority-unreachable");
    assert!(
        acquire.text.contains("answers there instead"),
        "{}",
        acquire.text
    );
    let write = b
        .put_state_with_lease(id, &json!({"completed": {"by": "holder"}}), &lease)
        .await;
    write.expect(StatusCode::SERVICE_UNAVAILABLE);

    // The gateway at that address granted and wrote nothing, nor did anyone.
    for path in [
        format!("/v1/locks/{}", encode_id(id)),
        format!("/v1/states/{}", encode_id(id)),
    ] {
        other_cluster
            .call(Method::GET, &path, None, OTHER_TOKEN)
            .await
            .expect(StatusCode::NOT_FOUND);
    }
    a.get_state(id).await.expect(StatusCode::NOT_FOUND);
}
