//! Who holds a lock: the `info` of a lease wherever its holder shows, the
//! reason and actor of a force-unlock, and each id's lease history.

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use statehouse::auth::Tokens;

use crate::helpers::{Api, spawn_app, spawn_app_with, two_peers};
use crate::run_lease::{Scratch, WAIT_FOR_GO, ended, lock, until};

/// The id's lease history once `done` holds for it: rows reach ClickHouse
/// behind the lock's own answers.
async fn history_when(api: &Api, id: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let mut leases = Vec::new();
    for _ in 0..60 {
        let reply = api.get(&format!("/v1/locks/{id}/history")).await;
        reply.expect(StatusCode::OK);
        assert_eq!(reply.json()["state_id"], id);
        leases = reply.json()["leases"].as_array().unwrap().clone();
        if done(&leases) {
            return leases;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("history of {id} never got there: {leases:?}");
}

#[tokio::test]
async fn info_shows_in_the_lease_its_views_and_every_409_that_names_the_holder() {
    let app = spawn_app().await;
    let info = json!({"host": "etl-1", "pid": 4242, "command": "meltano run tap target"});
    let reply = app
        .acquire(
            "job",
            &json!({"owner": "worker", "ttl_seconds": 60, "info": info}),
        )
        .await;
    reply.expect(StatusCode::CREATED);
    assert_eq!(reply.json()["info"], info);
    let lease_id = reply.json()["lease_id"].as_str().unwrap().to_owned();

    assert_eq!(app.get("/v1/locks/job").await.json()["info"], info);
    assert_eq!(app.get("/v1/locks").await.json()["locks"][0]["info"], info);
    let other = app.acquire("job", &json!({"owner": "other"})).await;
    other.expect(StatusCode::CONFLICT);
    assert_eq!(other.json()["holder"]["info"], info);
    let write = app.put_state("job", &json!({"completed": {}})).await;
    assert_eq!(write.problem_type(), "state-locked");
    assert_eq!(write.json()["holder"]["info"], info);

    // A lease acquired without info shows an empty object.
    app.release("job", &lease_id).await;
    let plain = app.acquire("job", &json!({"owner": "plain"})).await;
    assert_eq!(plain.json()["info"], json!({}));
}

#[tokio::test]
async fn info_over_4_kib_or_not_an_object_is_400_and_takes_no_lease() {
    let app = spawn_app().await;
    // {"k":"…"} is 8 bytes around the value: 4097 in all.
    let over = json!({"k": "x".repeat(4089)});
    let reply = app
        .acquire("big", &json!({"owner": "w", "info": over}))
        .await;
    reply.expect(StatusCode::BAD_REQUEST);
    assert_eq!(reply.problem_type(), "invalid-body");
    for not_object in [json!([1, 2]), json!("host"), json!(7)] {
        let reply = app
            .acquire("big", &json!({"owner": "w", "info": not_object}))
            .await;
        reply.expect(StatusCode::BAD_REQUEST);
    }
    app.get("/v1/locks/big").await.expect(StatusCode::NOT_FOUND);
    let fits = json!({"k": "x".repeat(4088)});
    let reply = app
        .acquire("big", &json!({"owner": "w", "info": fits}))
        .await;
    reply.expect(StatusCode::CREATED);
}

#[tokio::test]
async fn a_force_unlock_shows_in_the_history_with_its_actor_and_reason() {
    const ADMIN: &str = "admin-token-0123456789";
    let app = spawn_app_with(|config| {
        let mut tokens = Tokens::default();
        tokens
            .add("test", &format!("admin {ADMIN} oncall-alice"), '\n')
            .unwrap();
        config.tokens = tokens;
    })
    .await;
    let bearer = format!("Bearer {ADMIN}");
    let auth = [("authorization", bearer.as_str())];
    let info = json!({"host": "etl-2"});
    let body = json!({"owner": "stuck", "ttl_seconds": 60, "info": info}).to_string();
    let reply = app
        .request(Method::POST, "/v1/locks/wedged", Some(&body), &auth)
        .await;
    reply.expect(StatusCode::CREATED);
    let token = reply.json()["fencing_token"].clone();

    let long = "x".repeat(513);
    let refused = app
        .request(
            Method::DELETE,
            &format!("/v1/locks/wedged?reason={long}"),
            None,
            &auth,
        )
        .await;
    refused.expect(StatusCode::BAD_REQUEST);
    app.request(Method::GET, "/v1/locks/wedged", None, &auth)
        .await
        .expect(StatusCode::OK);
    let forced = app
        .request(
            Method::DELETE,
            "/v1/locks/wedged?reason=run%20hung%20on%20etl-2",
            None,
            &auth,
        )
        .await;
    forced.expect(StatusCode::NO_CONTENT);

    let history_api = Api {
        base: app.base.clone(),
        client: reqwest::Client::builder()
            .default_headers(
                [(reqwest::header::AUTHORIZATION, bearer.parse().unwrap())]
                    .into_iter()
                    .collect(),
            )
            .build()
            .unwrap(),
    };
    let leases = history_when(&history_api, "wedged", |l| {
        l.first().is_some_and(|l| l["ended_by"] == "forced")
    })
    .await;
    assert_eq!(leases.len(), 1);
    let lease = &leases[0];
    assert_eq!(lease["owner"], "stuck");
    assert_eq!(lease["fencing_token"], token);
    assert_eq!(lease["info"], info);
    assert_eq!(lease["actor"], "oncall-alice");
    assert_eq!(lease["reason"], "run hung on etl-2");
    assert!(lease["ended_at"].is_string());
    assert!(lease.get("lease_id").is_none());
}

#[tokio::test]
async fn releases_and_expiries_show_in_the_history_newest_first() {
    let app = spawn_app().await;
    app.lease("daily", "expires", 1, 0.0).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (released, _) = app.lease("daily", "releases", 60, 0.0).await;
    app.release("daily", &released)
        .await
        .expect(StatusCode::NO_CONTENT);
    app.lease("daily", "runs", 60, 0.0).await;

    let leases = history_when(&app, "daily", |l| {
        l.len() == 3 && l[1]["ended_by"] == "released"
    })
    .await;
    let owners: Vec<&Value> = leases.iter().map(|l| &l["owner"]).collect();
    assert_eq!(owners, ["runs", "releases", "expires"]);
    assert_eq!(leases[0]["ended_by"], Value::Null);
    assert_eq!(leases[0]["ended_at"], Value::Null);
    assert_eq!(leases[2]["ended_by"], "expired");
    assert!(leases[1]["ended_at"].is_string() && leases[2]["ended_at"].is_string());
    for lease in &leases {
        assert!(
            lease.get("actor").is_none(),
            "only a forced end has an actor"
        );
    }
    let tokens: Vec<u64> = leases
        .iter()
        .map(|l| l["fencing_token"].as_u64().unwrap())
        .collect();
    assert!(tokens[0] > tokens[1] && tokens[1] > tokens[2], "{tokens:?}");
    let one = app.get("/v1/locks/daily/history?limit=1").await.json();
    assert_eq!(one["leases"].as_array().unwrap().len(), 1);
    app.get("/v1/locks/daily/history?limit=0")
        .await
        .expect(StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn info_crosses_gateways_and_reaches_the_next_authority() {
    let (a, b) = two_peers().await;
    let info = json!({"host": "etl-3", "pid": 17});
    let reply = b
        .acquire(
            "shared",
            &json!({"owner": "via-b", "ttl_seconds": 60, "info": info}),
        )
        .await;
    reply.expect(StatusCode::CREATED);
    assert_eq!(reply.json()["info"], info);
    assert_eq!(a.get("/v1/locks/shared").await.json()["info"], info);
    let other = a.acquire("shared", &json!({"owner": "via-a"})).await;
    other.expect(StatusCode::CONFLICT);
    assert_eq!(other.json()["holder"]["info"], info);
    // The authority hands its lease on at shutdown: the other gateway learns
    // the info from the lease row alone.
    drop(b);
    let mut seen = Value::Null;
    for _ in 0..100 {
        let view = a.get("/v1/locks/shared").await;
        if view.status == StatusCode::OK && view.json()["owner"] == "via-b" {
            seen = view.json()["info"].clone();
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(seen, info);
    let history = history_when(&a, "shared", |l| !l.is_empty()).await;
    assert_eq!(history[0]["info"], info);
}

#[tokio::test]
async fn the_runners_lease_names_its_host_pid_and_command() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let run = lock(
        &app.base,
        &["--info", "dag=nightly", "--info", "try=2"],
        "runner-info",
        &scratch.0,
        WAIT_FOR_GO,
    );
    let runner_pid = run.id().unwrap();
    until("the command starts", Duration::from_secs(20), || {
        scratch.path("ready").exists()
    })
    .await;
    let view = app.get("/v1/locks/runner-info").await;
    view.expect(StatusCode::OK);
    let info = &view.json()["info"];
    assert_eq!(info["pid"], runner_pid);
    assert_eq!(info["command"], format!("sh -c {WAIT_FOR_GO}"));
    assert!(!info["host"].as_str().unwrap().is_empty());
    assert_eq!(info["dag"], "nightly");
    assert_eq!(info["try"], "2");
    // A second run is told what the first one runs.
    let busy = lock(&app.base, &[], "runner-info", &scratch.0, "true");
    let (status, stderr) = ended(busy, Duration::from_secs(20)).await;
    assert_eq!(status, Some(75), "{stderr}");
    assert!(
        stderr.contains(&format!("running `sh -c {WAIT_FOR_GO}`")),
        "{stderr}"
    );
    std::fs::write(scratch.path("go"), "").unwrap();
    let (status, stderr) = ended(run, Duration::from_secs(20)).await;
    assert_eq!(status, Some(0), "{stderr}");
}

#[tokio::test]
async fn a_force_unlock_through_another_gateway_keeps_its_reason() {
    let (a, b) = two_peers().await;
    a.lease("far", "on-a", 60, 0.0).await;
    let forced = b
        .request(
            Method::DELETE,
            "/v1/locks/far?reason=moved%20hosts",
            None,
            &[],
        )
        .await;
    forced.expect(StatusCode::NO_CONTENT);
    let leases = history_when(&b, "far", |l| {
        l.first().is_some_and(|l| l["ended_by"] == "forced")
    })
    .await;
    assert_eq!(leases[0]["owner"], "on-a");
    assert_eq!(leases[0]["reason"], "moved hosts");
    assert_eq!(leases[0]["actor"], "anonymous");
}

#[tokio::test]
async fn with_history_off_there_is_no_lock_history() {
    let app = spawn_app_with(|config| config.history = statehouse::config::History::Off).await;
    app.lease("untracked", "w", 60, 0.0).await;
    let reply = app.get("/v1/locks/untracked/history").await;
    reply.expect(StatusCode::NOT_FOUND);
    assert_eq!(reply.problem_type(), "history-off");
}
