//! Three gateway processes on one ClickHouse, behind a per-request
//! round-robin balancer, act as one: every request may land on any gateway,
//! and the id's authority serves it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::balancer::Balancer;
use crate::checker::{self, Work, final_counter};
use crate::helpers::{Api, GatewayProcess, clickhouse_url, spawn_peer_process, unique_schema};

/// Claim timings short enough that a dead gateway's claims lapse within the
/// test; the mechanism is the one production runs.
const CLAIM_TTL_SECONDS: u64 = 3;
/// The claim TTL a production gateway runs with, for tests where no gateway
/// dies: on a loaded 2-core machine one Keeper or ClickHouse call can take a
/// second or two, and a 3 s claim would lapse for that alone.
const PRODUCTION_CLAIM_TTL_SECONDS: u64 = 10;
const SETTLE_MS: u64 = 200;
/// The lease a killed authority holds: it keeps its place until it would
/// have expired, so the survivors grant after it.
const KILLED_LEASE_TTL_SECONDS: u64 = 3;

struct Cluster {
    schema: String,
    /// Each gateway with its id in the lock table.
    gateways: Vec<(String, GatewayProcess)>,
    balancer: Balancer,
}

impl Cluster {
    async fn start(schema: String, size: usize, claim_ttl_seconds: u64) -> Self {
        let mut gateways = Vec::new();
        for _ in 0..size {
            gateways.push(spawn_gateway(&schema, claim_ttl_seconds).await);
        }
        let balancer =
            Balancer::start(gateways.iter().map(|(_, g)| g.base.clone()).collect()).await;
        Self {
            schema,
            gateways,
            balancer,
        }
    }

    /// Every request through the balancer.
    fn api(&self) -> Api {
        Api::new(self.balancer.base.clone())
    }

    /// Kills -9 the gateway that is the authority for `id` while `id` is locked.
    async fn kill_authority_of(&mut self, id: &str) {
        let lock = self.api().get(&format!("/v1/locks/{id}")).await;
        lock.expect(StatusCode::OK);
        let authority = lock.json()["gateway_id"].as_str().unwrap().to_owned();
        let index = self
            .gateways
            .iter()
            .position(|(gateway_id, _)| *gateway_id == authority)
            .expect("the authority is one of ours");
        let (_, mut dead) = self.gateways.remove(index);
        dead.child.kill().await.expect("kill -9");
    }
}

async fn spawn_gateway(schema: &str, claim_ttl_seconds: u64) -> (String, GatewayProcess) {
    let gateway_id = uuid::Uuid::new_v4().to_string();
    let ttl = format!("{claim_ttl_seconds}s");
    let settle = format!("{SETTLE_MS}ms");
    let process = spawn_peer_process(
        &clickhouse_url(),
        &[
            "--schema",
            schema,
            "--gateway-id",
            &gateway_id,
            "--claim-ttl",
            &ttl,
            "--claim-settle",
            &settle,
        ],
    )
    .await;
    (gateway_id, process)
}

/// How long a survivor is given to grant once the authority died: by
/// design the claim TTL, the dead authority's lease and the settle; this
/// bound only catches a take-over that never comes, on however slow a
/// machine.
fn takeover_wait() -> Duration {
    Duration::from_secs(10 * (CLAIM_TTL_SECONDS + KILLED_LEASE_TTL_SECONDS))
}

/// Acquires `id` once the dead authority's claim has lapsed and its lease
/// would have expired: until the lapse the answer is 503 with Retry-After,
/// which a client honours, then 409 while the lease keeps its place.
async fn lease_after_takeover(api: &Api, id: &str, owner: &str) -> (String, u64) {
    let give_up = tokio::time::Instant::now() + takeover_wait();
    loop {
        let reply = api
            .acquire(
                id,
                &json!({"owner": owner, "ttl_seconds": 30, "wait_seconds": 1}),
            )
            .await;
        match reply.status {
            StatusCode::CREATED => {
                let body = reply.json();
                return (
                    body["lease_id"].as_str().unwrap().to_owned(),
                    body["fencing_token"].as_u64().unwrap(),
                );
            }
            StatusCode::CONFLICT if tokio::time::Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            StatusCode::SERVICE_UNAVAILABLE if tokio::time::Instant::now() < give_up => {
                assert_eq!(reply.problem_type(), "authority-unreachable");
                let retry_after: u64 = reply.header("retry-after").unwrap().parse().unwrap();
                assert!((1..=CLAIM_TTL_SECONDS + 1).contains(&retry_after));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            _ => panic!("no grant within the takeover bound: {}", reply.text),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twelve_workers_cycle_through_a_round_robin_balancer() {
    let cluster = Cluster::start(unique_schema(), 3, PRODUCTION_CLAIM_TTL_SECONDS).await;
    checker::run(|_| cluster.api(), "balanced", 12, 10, Work::Counter).await;
}

#[tokio::test]
async fn a_lock_taken_through_the_balancer_shows_on_every_gateway_and_its_release_frees_it() {
    let cluster = Cluster::start(unique_schema(), 3, PRODUCTION_CLAIM_TTL_SECONDS).await;
    let api = cluster.api();
    let (lease, token) = api.lease("seen", "worker", 60, 0.0).await;
    for (_, gateway) in &cluster.gateways {
        let seen = gateway.api().get("/v1/locks/seen").await;
        seen.expect(StatusCode::OK);
        assert_eq!(seen.json()["owner"], "worker");
        assert_eq!(seen.json()["fencing_token"], token);
    }
    api.release("seen", &lease)
        .await
        .expect(StatusCode::NO_CONTENT);
    for (_, gateway) in &cluster.gateways {
        let gone = gateway.api().get("/v1/locks/seen").await;
        gone.expect(StatusCode::NOT_FOUND);
    }
    // Free at once: the next acquire does not wait at all.
    let (_, next_token) = api.lease("seen", "next", 60, 0.0).await;
    assert!(next_token > token);
}

/// The gateway holding the id's claim is killed mid-traffic: requests for
/// the id get 503 (or the dead lease's 409) until its claim lapses, then
/// another gateway takes over. Every acknowledged increment counts once;
/// a write answered 502 or 503 (its answer lost with the dead gateway, or
/// its INSERT past the query timeout on a loaded machine) may have landed
/// too, and counts at most once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_authority_is_replaced_and_no_acknowledged_increment_is_lost_or_doubled() {
    let mut cluster = Cluster::start(unique_schema(), 3, CLAIM_TTL_SECONDS).await;
    let api = cluster.api();
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let api = api.clone();
            let tally = tally.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    increment_once(&api, &format!("worker-{w}"), &tally).await;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Take a turn in line, and kill the authority while holding the lease.
    api.lease("kill", "killer", KILLED_LEASE_TTL_SECONDS, 30.0)
        .await;
    cluster.kill_authority_of("kill").await;

    let survivor = cluster.gateways[0].1.api();
    let (after, _) = lease_after_takeover(&survivor, "kill", "after-the-kill").await;
    survivor.release("kill", &after).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.await.unwrap();
    }
    let counted = final_counter(&survivor, "kill").await;
    let acknowledged = tally.acknowledged.load(Ordering::SeqCst);
    let uncertain = tally.uncertain.load(Ordering::SeqCst);
    assert!(
        (acknowledged..=acknowledged + uncertain).contains(&counted),
        "{counted} counted, {acknowledged} acknowledged, {uncertain} of unknown outcome"
    );
    assert!(counted > 0);
}

/// What the workers' writes were answered.
#[derive(Default)]
struct Tally {
    /// 2xx: the write landed.
    acknowledged: AtomicU64,
    /// 502 or 503: it may have landed. A 409 refused it before any INSERT.
    uncertain: AtomicU64,
}

/// One cycle on "kill": acquire, read, write +1 with the lease, release.
/// Failures from the dead gateway are expected: 503 until its claim lapses,
/// 409 for a lease that ended with it, and the balancer's 502 for a request
/// it was serving when it died.
async fn increment_once(api: &Api, owner: &str, tally: &Tally) {
    let send = |method: reqwest::Method, path: String, body: Option<Value>, lease: Option<&str>| {
        let mut request = api.client.request(method, format!("{}{path}", api.base));
        if let Some(body) = body {
            request = request.json(&body);
        }
        if let Some(lease) = lease {
            request = request.header("lease-id", lease);
        }
        async move {
            match request.send().await {
                Ok(response) => {
                    let status = response.status();
                    (
                        status,
                        response.json::<Value>().await.unwrap_or(Value::Null),
                    )
                }
                Err(err) => panic!("the balancer answers: {err}"),
            }
        }
    };
    let expected_failure = |status: StatusCode| {
        matches!(
            status,
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::CONFLICT | StatusCode::BAD_GATEWAY
        )
    };
    let (status, body) = send(
        reqwest::Method::POST,
        "/v1/locks/kill".into(),
        Some(json!({"owner": owner, "ttl_seconds": 5, "wait_seconds": 10})),
        None,
    )
    .await;
    if status != StatusCode::CREATED {
        assert!(expected_failure(status), "acquire: {status} {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
        return;
    }
    let lease = body["lease_id"].as_str().unwrap().to_owned();
    let (status, body) = send(reqwest::Method::GET, "/v1/states/kill".into(), None, None).await;
    let counter = match status {
        StatusCode::OK => Some(body["completed"]["counter"].as_u64().unwrap()),
        StatusCode::NOT_FOUND => Some(0),
        other => {
            assert!(expected_failure(other), "read: {other} {body}");
            None
        }
    };
    if let Some(counter) = counter {
        let (status, body) = send(
            reqwest::Method::PUT,
            "/v1/states/kill".into(),
            Some(json!({"completed": {"counter": counter + 1}})),
            Some(&lease),
        )
        .await;
        if status.is_success() {
            tally.acknowledged.fetch_add(1, Ordering::SeqCst);
        } else {
            assert!(expected_failure(status), "write: {status} {body}");
            if status != StatusCode::CONFLICT {
                tally.uncertain.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
    let (status, body) = send(
        reqwest::Method::DELETE,
        format!("/v1/locks/kill/{lease}"),
        None,
        None,
    )
    .await;
    assert!(
        status == StatusCode::NO_CONTENT || expected_failure(status),
        "release: {status} {body}"
    );
}

/// Tokens seen so far must keep growing.
struct Fence {
    last: u64,
}

impl Fence {
    async fn take(&mut self, api: &Api) {
        let (lease, token) = lease_after_takeover(api, "fenced", "w").await;
        assert!(token > self.last, "token {token} after {}", self.last);
        self.last = token;
        api.release("fenced", &lease).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_increase_across_a_killed_authority_and_a_restart_of_every_gateway() {
    let mut cluster = Cluster::start(unique_schema(), 3, CLAIM_TTL_SECONDS).await;
    let api = cluster.api();
    let mut fence = Fence { last: 0 };
    fence.take(&api).await;
    fence.take(&api).await;

    let (lease, token) = api
        .lease("fenced", "w", KILLED_LEASE_TTL_SECONDS, 0.0)
        .await;
    assert!(token > fence.last);
    fence.last = token;
    cluster.kill_authority_of("fenced").await;
    drop(lease);
    fence.take(&api).await;

    // Restart every gateway: SIGTERM hands the claims back.
    for (_, mut gateway) in std::mem::take(&mut cluster.gateways) {
        terminate(&mut gateway).await;
    }
    let restarted = Cluster::start(cluster.schema.clone(), 3, CLAIM_TTL_SECONDS).await;
    fence.take(&restarted.api()).await;
    fence.take(&restarted.api()).await;
}

async fn terminate(gateway: &mut GatewayProcess) {
    let pid = gateway.child.id().expect("running");
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exited = tokio::time::timeout(Duration::from_secs(30), gateway.child.wait())
        .await
        .expect("exits after SIGTERM")
        .unwrap();
    assert!(exited.success());
}
