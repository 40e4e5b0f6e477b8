//! Runs (issue 54): recorded under a lease, ended by their PATCH or by
//! their lease's end, read the same through any gateway, listed and scoped.

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use statehouse::auth::Tokens;
use statehouse::domain::Coordination;

use crate::helpers::{
    Reply, TestApp, clickhouse_url, metric, peer_config, spawn_app, spawn_app_with,
    spawn_configured, spawn_peer_process, two_peers, two_peers_with, unique_schema,
};

fn state(orders: &str) -> Value {
    json!({"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "day", "replication_key_value": orders},
        "customers": {"replication_key": "id", "replication_key_value": 9}
    }}}})
}

async fn start(app: &TestApp, id: &str, lease_id: &str) -> Reply {
    let body = json!({"state_id": id, "lease_id": lease_id, "info": {"host": "h1"}});
    app.request(Method::POST, "/v1/runs", Some(&body.to_string()), &[])
        .await
}

async fn end(app: &TestApp, run_id: &str, body: &Value) -> Reply {
    app.request(
        Method::PATCH,
        &format!("/v1/runs/{run_id}"),
        Some(&body.to_string()),
        &[],
    )
    .await
}

/// A run on a fresh lease of `id`, ended with `ending`.
async fn finished_run(app: &TestApp, id: &str, ending: Value) -> Value {
    let (lease_id, _) = app.lease(id, "worker", 60, 5.0).await;
    let run = start(app, id, &lease_id).await;
    run.expect(StatusCode::CREATED);
    let run_id = run.json()["run_id"].as_str().unwrap().to_owned();
    let ended = end(app, &run_id, &ending).await;
    ended.expect(StatusCode::OK);
    app.release(id, &lease_id)
        .await
        .expect(StatusCode::NO_CONTENT);
    ended.json()
}

#[tokio::test]
async fn started_on_one_gateway_ended_on_the_other_it_reads_the_same_on_both() {
    let (a, b) = two_peers().await;
    a.put_state("orders-job", &state("2026-01-01"))
        .await
        .expect(StatusCode::CREATED);
    let (lease_id, fencing_token) = a.lease("orders-job", "worker-1", 60, 5.0).await;
    let started = start(&a, "orders-job", &lease_id).await;
    started.expect(StatusCode::CREATED);
    let run = started.json();
    assert_eq!(run["status"], "running");
    assert_eq!(run["owner"], "worker-1");
    assert_eq!(run["fencing_token"], fencing_token);
    assert_eq!(run["info"], json!({"host": "h1"}));
    assert!(run.get("lease_id").is_none(), "a run never shows its lease");
    let run_id = run["run_id"].as_str().unwrap().to_owned();

    let again = start(&b, "orders-job", &lease_id).await;
    again.expect(StatusCode::CONFLICT);
    assert_eq!(again.problem_type(), "run-exists");
    assert_eq!(again.json()["run_id"], run_id.as_str());

    a.put_state_with_lease("orders-job", &state("2026-01-05"), &lease_id)
        .await
        .expect(StatusCode::OK);
    let ended = end(&b, &run_id, &json!({"exit_code": 3, "info": {"rows": 5}})).await;
    ended.expect(StatusCode::OK);
    let ended = ended.json();
    assert_eq!(ended["status"], "failed");
    assert_eq!(ended["exit_code"], 3);
    assert_eq!(ended["signal"], Value::Null);
    assert_eq!(ended["versions"], 1);
    assert_eq!(ended["info"], json!({"host": "h1", "rows": 5}));
    assert_eq!(
        ended["advanced"],
        json!([{"stream": "orders", "from": "2026-01-01", "to": "2026-01-05"}])
    );
    for gateway in [&a, &b] {
        let read = gateway.get(&format!("/v1/runs/{run_id}")).await;
        read.expect(StatusCode::OK);
        assert_eq!(read.json(), ended);
    }
    let twice = end(&a, &run_id, &json!({"exit_code": 0})).await;
    twice.expect(StatusCode::CONFLICT);
    assert_eq!(twice.problem_type(), "run-ended");
    assert_eq!(b.get(&format!("/v1/runs/{run_id}")).await.json(), ended);
}

#[tokio::test]
async fn an_exit_0_succeeds_and_a_signal_fails() {
    let app = spawn_app().await;
    let succeeded = finished_run(&app, "job", json!({"exit_code": 0})).await;
    assert_eq!(succeeded["status"], "succeeded");
    assert_eq!(succeeded["exit_code"], 0);
    let signalled = finished_run(&app, "job", json!({"signal": 15})).await;
    assert_eq!(signalled["status"], "failed");
    assert_eq!(signalled["signal"], 15);
    assert_eq!(signalled["exit_code"], Value::Null);
    let both = app
        .get(&format!(
            "/v1/runs/{}",
            signalled["run_id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(both.json()["status"], "failed");

    let bad = end(
        &app,
        succeeded["run_id"].as_str().unwrap(),
        &json!({"exit_code": 1, "signal": 9}),
    )
    .await;
    bad.expect(StatusCode::BAD_REQUEST);
    let unknown = app.get(&format!("/v1/runs/{}", uuid::Uuid::new_v4())).await;
    unknown.expect(StatusCode::NOT_FOUND);
    assert_eq!(unknown.problem_type(), "run-not-found");

    let text = app.get("/metrics").await.text;
    let sample = |status: &str| {
        metric(
            &text,
            &format!("statehouse_runs_total{{status=\"{status}\"}}"),
        )
    };
    assert_eq!(sample("succeeded"), Some(1.0));
    assert_eq!(sample("failed"), Some(1.0));
    assert_eq!(sample("lost"), Some(0.0));
    assert_eq!(metric(&text, "statehouse_runs_running"), Some(0.0));
    assert_eq!(
        metric(&text, "statehouse_run_duration_seconds_count"),
        Some(2.0)
    );
    assert!(
        text.lines()
            .filter(|line| line.starts_with("statehouse_run"))
            .all(|line| !line.contains("state_id")),
        "no run series is labelled by state_id"
    );
}

#[tokio::test]
async fn a_lease_that_is_not_current_takes_no_run() {
    let app = spawn_app().await;
    let (lease_id, _) = app.lease("job", "worker", 60, 5.0).await;
    app.release("job", &lease_id)
        .await
        .expect(StatusCode::NO_CONTENT);
    let stale = start(&app, "job", &lease_id).await;
    stale.expect(StatusCode::CONFLICT);
    assert_eq!(stale.problem_type(), "lease-not-current");
    let unknown = start(&app, "job", &uuid::Uuid::new_v4().to_string()).await;
    unknown.expect(StatusCode::CONFLICT);
    assert_eq!(unknown.problem_type(), "lease-not-current");
}

/// Reads the run until it is no longer running (the lease's row reaches
/// ClickHouse about a second after its end).
async fn settled(app: &TestApp, run_id: &str) -> Value {
    for _ in 0..60 {
        let run = app.get(&format!("/v1/runs/{run_id}")).await.json();
        if run["status"] != "running" {
            return run;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("run {run_id} still running");
}

#[tokio::test]
async fn a_run_ends_lost_with_its_lease_and_takes_no_patch_after() {
    let (a, b) = two_peers().await;
    lost_with_its_lease(&a, &b).await;
}

#[tokio::test]
async fn in_keeper_mode_too_a_run_ends_lost_with_its_lease() {
    let (a, b) = two_peers_with(|_, config| config.locks.coordination = Coordination::Keeper).await;
    lost_with_its_lease(&a, &b).await;
}

/// A run whose lease expires unrenewed, and one whose lease is forced, both
/// started through `a` and read through `b`.
async fn lost_with_its_lease(a: &TestApp, b: &TestApp) {
    let expiring = a
        .acquire("expiring", &json!({"owner": "w", "ttl_seconds": 1}))
        .await;
    expiring.expect(StatusCode::CREATED);
    let lease = expiring.json();
    let run = start(a, "expiring", lease["lease_id"].as_str().unwrap()).await;
    run.expect(StatusCode::CREATED);
    let run_id = run.json()["run_id"].as_str().unwrap().to_owned();
    let lost = settled(b, &run_id).await;
    assert_eq!(lost["status"], "lost");
    assert_eq!(
        lost["ended_at"], lease["expires_at"],
        "it ends at the lease's expiry"
    );
    let late = end(a, &run_id, &json!({"exit_code": 0})).await;
    late.expect(StatusCode::CONFLICT);
    assert_eq!(late.problem_type(), "run-ended");
    assert_eq!(a.get(&format!("/v1/runs/{run_id}")).await.json(), lost);

    let (lease_id, _) = a.lease("forced", "w", 60, 5.0).await;
    let run = start(a, "forced", &lease_id).await;
    let run_id = run.json()["run_id"].as_str().unwrap().to_owned();
    b.request(Method::DELETE, "/v1/locks/forced?reason=stuck", None, &[])
        .await
        .expect(StatusCode::NO_CONTENT);
    let lost = settled(a, &run_id).await;
    assert_eq!(lost["status"], "lost");
    let history = a.get("/v1/locks/forced/history").await.json();
    assert_eq!(lost["ended_at"], history["leases"][0]["ended_at"]);
    end(b, &run_id, &json!({"exit_code": 0}))
        .await
        .expect(StatusCode::CONFLICT);
}

#[tokio::test]
async fn listings_filter_page_and_give_each_ids_latest() {
    let app = spawn_app().await;
    finished_run(&app, "tap-a", json!({"exit_code": 0})).await;
    finished_run(&app, "tap-a", json!({"exit_code": 2})).await;
    finished_run(&app, "tap-b", json!({"exit_code": 1})).await;
    finished_run(&app, "other", json!({"exit_code": 0})).await;

    let all = app.get("/v1/runs?pattern=tap-*").await;
    all.expect(StatusCode::OK);
    let runs = all.json()["runs"].as_array().unwrap().clone();
    let ids: Vec<&str> = runs
        .iter()
        .map(|r| r["state_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["tap-b", "tap-a", "tap-a"], "newest first");
    let failed = app.get("/v1/runs?status=failed").await.json();
    assert_eq!(failed["runs"].as_array().unwrap().len(), 2);
    let some = app
        .get("/v1/runs?status=succeeded,failed&pattern=tap-a")
        .await
        .json();
    assert_eq!(some["runs"].as_array().unwrap().len(), 2);
    app.get("/v1/runs?status=done")
        .await
        .expect(StatusCode::BAD_REQUEST);
    let later = app.get("/v1/runs?since=2999-01-01T00:00:00Z").await.json();
    assert_eq!(later["runs"], json!([]));

    let mut seen = Vec::new();
    let mut path = "/v1/runs?limit=1".to_owned();
    loop {
        let page = app.get(&path).await.json();
        seen.extend(
            page["runs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["run_id"].clone()),
        );
        match page["next_cursor"].as_str() {
            Some(cursor) => path = format!("/v1/runs?limit=1&cursor={cursor}"),
            None => break,
        }
    }
    let every: Vec<Value> = app.get("/v1/runs").await.json()["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["run_id"].clone())
        .collect();
    assert_eq!(seen, every);
    assert_eq!(every.len(), 4);

    let latest = app.get("/v1/runs/latest?pattern=tap-*").await.json();
    let latest = latest["latest"].as_array().unwrap();
    assert_eq!(latest.len(), 2);
    assert_eq!(latest[0]["state_id"], "tap-a");
    assert_eq!(latest[0]["run"]["exit_code"], 2);
    assert!(latest[0]["last_succeeded_at"].is_string());
    assert_eq!(latest[1]["state_id"], "tap-b");
    assert_eq!(latest[1]["last_succeeded_at"], Value::Null);
}

const ROOT: &str = "root-admin-token-0123456789";
const WRITE_A: &str = "team-a-write-token-0123456789";
const READ_A: &str = "team-a-read-token-0123456789";

#[tokio::test]
async fn runs_are_held_to_roles_and_scopes() {
    let app = spawn_app_with(|config| {
        let mut tokens = Tokens::default();
        let lines = format!(
            "admin {ROOT} root\nwrite {WRITE_A} team-a scope=team-a:*\nread {READ_A} team-a-dash scope=team-a:*\n"
        );
        tokens.add("test", &lines, '\n').unwrap();
        config.tokens = tokens;
    })
    .await;
    let lease = |id: &'static str| {
        let app = &app;
        async move {
            let body = json!({"owner": "w"}).to_string();
            let path = format!("/v1/locks/{id}");
            let reply = app.call(Method::POST, &path, Some(&body), ROOT).await;
            reply.expect(StatusCode::CREATED);
            reply.json()["lease_id"].as_str().unwrap().to_owned()
        }
    };
    let inside = lease("team-a:job").await;
    let outside = lease("team-b:job").await;
    let body = |id: &str, lease: &str| json!({"state_id": id, "lease_id": lease}).to_string();
    let denied = app
        .call(
            Method::POST,
            "/v1/runs",
            Some(&body("team-b:job", &outside)),
            WRITE_A,
        )
        .await;
    denied.expect(StatusCode::FORBIDDEN);
    assert_eq!(denied.problem_type(), "out-of-scope");
    app.call(
        Method::POST,
        "/v1/runs",
        Some(&body("team-a:job", &inside)),
        READ_A,
    )
    .await
    .expect(StatusCode::FORBIDDEN);
    let ours = app
        .call(
            Method::POST,
            "/v1/runs",
            Some(&body("team-a:job", &inside)),
            WRITE_A,
        )
        .await;
    ours.expect(StatusCode::CREATED);
    assert_eq!(ours.json()["actor"], "team-a");
    let theirs = app
        .call(
            Method::POST,
            "/v1/runs",
            Some(&body("team-b:job", &outside)),
            ROOT,
        )
        .await;
    theirs.expect(StatusCode::CREATED);
    let their_id = theirs.json()["run_id"].as_str().unwrap().to_owned();

    let listed = app.call(Method::GET, "/v1/runs", None, READ_A).await.json();
    let ids: Vec<&str> = listed["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["state_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["team-a:job"]);
    let latest = app
        .call(Method::GET, "/v1/runs/latest", None, READ_A)
        .await
        .json();
    assert_eq!(latest["latest"].as_array().unwrap().len(), 1);
    let hidden = app
        .call(Method::GET, &format!("/v1/runs/{their_id}"), None, READ_A)
        .await;
    hidden.expect(StatusCode::FORBIDDEN);
    app.call(
        Method::PATCH,
        &format!("/v1/runs/{their_id}"),
        Some(r#"{"exit_code":0}"#),
        WRITE_A,
    )
    .await
    .expect(StatusCode::FORBIDDEN);
}

/// The authority dies (kill -9) holding the lease: its run is lost at the
/// lease's expiry, read through the survivor, in both coordination modes.
#[tokio::test]
async fn a_run_whose_authority_dies_ends_lost_at_its_lease_expiry() {
    for mode in ["table", "keeper"] {
        let schema = unique_schema();
        let args = [
            "--schema",
            &schema,
            "--coordination",
            mode,
            "--claim-ttl",
            "3s",
            "--claim-settle",
            "200ms",
        ];
        let authority = spawn_peer_process(&clickhouse_url(), &args).await;
        let mut survivor = peer_config(&schema);
        survivor.locks.coordination = match mode {
            "keeper" => Coordination::Keeper,
            _ => Coordination::Table,
        };
        let survivor = spawn_configured(survivor).await;
        let dying = authority.api();
        let acquired = dying
            .acquire("job", &json!({"owner": "w", "ttl_seconds": 2}))
            .await;
        acquired.expect(StatusCode::CREATED);
        let lease = acquired.json();
        let body = json!({"state_id": "job", "lease_id": lease["lease_id"]}).to_string();
        let run = dying
            .request(Method::POST, "/v1/runs", Some(&body), &[])
            .await;
        run.expect(StatusCode::CREATED);
        let run_id = run.json()["run_id"].as_str().unwrap().to_owned();
        // The lease's row is written behind its grant: it has landed once
        // the survivor sees the lock.
        for _ in 0..50 {
            if survivor.get("/v1/locks/job").await.status == StatusCode::OK {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = authority.kill_and_collect_logs().await;
        let lost = settled(&survivor, &run_id).await;
        assert_eq!(lost["status"], "lost", "{mode}");
        assert_eq!(lost["ended_at"], lease["expires_at"], "{mode}");
    }
}
