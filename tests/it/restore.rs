//! `POST /v1/restore`: a glob put back as it was at an instant, on the
//! timeline of `point_in_time` (A three versions, B created later, C
//! deleted later): the plan, the dry run, the writes and their history, a
//! repeat, leases and the regression guard, the id limit.

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use statehouse::domain::GuardMode;
use statehouse::store::History;

use crate::helpers::{Api, encode_id, spawn_app_with};
use crate::point_in_time::{A, B, C, bookmark, gateway, timeline};

async fn restore(api: &Api, body: &Value) -> crate::helpers::Reply {
    api.request(Method::POST, "/v1/restore", Some(&body.to_string()), &[])
        .await
}

async fn versions(api: &Api, id: &str) -> Vec<Value> {
    let reply = api
        .get(&format!("/v1/states/{}/history", encode_id(id)))
        .await;
    reply.expect(StatusCode::OK);
    reply.json()["versions"].as_array().unwrap().clone()
}

async fn counts(api: &Api) -> Vec<usize> {
    let mut counts = Vec::new();
    for id in [A, B, C] {
        counts.push(versions(api, id).await.len());
    }
    counts
}

fn actions(answer: &Value) -> Vec<(String, String)> {
    answer["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["state_id"].as_str().unwrap().to_owned(),
                c["action"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
        .collect()
}

#[tokio::test]
async fn a_restore_plans_writes_and_then_changes_nothing() {
    let app = gateway().await;
    let timeline = timeline(&app).await;
    let before = counts(&app).await;

    let dry = restore(
        &app,
        &json!({"pattern": "pit:*", "at": timeline.at, "dry_run": true}),
    )
    .await;
    dry.expect(StatusCode::OK);
    let plan = dry.json();
    assert_eq!(
        actions(&plan),
        pairs(&[(A, "restore"), (B, "delete"), (C, "restore")])
    );
    assert_eq!(
        plan["changes"][0]["streams"],
        json!([{"stream": "orders",
            "from": {"replication_key": "id", "replication_key_value": 3},
            "to": {"replication_key": "id", "replication_key_value": 2}}])
    );
    assert_eq!(
        plan["changes"][0]["to_version"],
        timeline.a_at["updated_at"]
    );
    assert_eq!(
        plan["changes"][2]["from_version"],
        Value::Null,
        "C is gone now"
    );
    assert_eq!(counts(&app).await, before, "a dry run writes nothing");
    app.get_state(B).await.expect(StatusCode::OK);

    let done = restore(
        &app,
        &json!({"pattern": "pit:*", "at": timeline.at, "reason": "bad release 4.2"}),
    )
    .await;
    done.expect(StatusCode::OK);
    let done = done.json();
    assert_eq!(actions(&done), actions(&plan), "the plan is what was done");
    assert_eq!(
        (&done["restored"], &done["deleted"], &done["unchanged"]),
        (&json!(2), &json!(1), &json!(0))
    );
    let a = app.get_state(A).await;
    assert_eq!(a.json()["completed"], timeline.a_at["completed"]);
    app.get_state(B).await.expect(StatusCode::NOT_FOUND);
    app.get_state(C).await.expect(StatusCode::OK);
    assert_eq!(
        counts(&app).await,
        before.iter().map(|n| n + 1).collect::<Vec<_>>(),
        "one version each"
    );
    let newest = &versions(&app, A).await[0];
    assert_eq!(newest["operation"], "restore");
    assert_eq!(newest["reason"], "bad release 4.2");
    assert_eq!(newest["restored_from"], timeline.a_at["updated_at"]);

    let after = counts(&app).await;
    let again = restore(&app, &json!({"pattern": "pit:*", "at": timeline.at})).await;
    again.expect(StatusCode::OK);
    assert_eq!(
        actions(&again.json()),
        pairs(&[(A, "unchanged"), (C, "unchanged")]),
        "B did not exist then and does not now"
    );
    assert_eq!(counts(&app).await, after, "a repeat writes nothing");
}

#[tokio::test]
async fn a_leased_id_is_left_and_the_guard_records_what_goes_back() {
    let app = spawn_app_with(|config| {
        config.history = History::Kept(Some(Duration::from_secs(3600)));
        config.bookmark_regression = GuardMode::Reject;
    })
    .await;
    let timeline = timeline(&app).await;
    let (_lease, _) = app.lease(C, "another-run", 60, 0.0).await;
    let done = restore(&app, &json!({"pattern": "pit:*", "at": timeline.at})).await;
    done.expect(StatusCode::OK);
    assert_eq!(
        actions(&done.json()),
        pairs(&[(A, "restore"), (B, "delete"), (C, "skipped-locked")])
    );
    app.get_state(C).await.expect(StatusCode::NOT_FOUND);
    let newest = &versions(&app, A).await[0];
    assert_eq!(newest["operation"], "restore");
    assert_eq!(newest["regressed_streams"], json!(["orders"]));
}

#[tokio::test]
async fn more_ids_than_the_limit_is_refused_and_writes_nothing() {
    let app = gateway().await;
    let entries: Vec<Value> = (0..10_001)
        .map(|n| {
            let mut entry = bookmark("orders", n);
            entry["state_id"] = json!(format!("many:{n:05}"));
            entry
        })
        .collect();
    let imported = app
        .request(
            Method::POST,
            "/v1/states",
            Some(&Value::Array(entries).to_string()),
            &[],
        )
        .await;
    imported.expect(StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(5)).await;
    app.put_state("many:00000", &bookmark("orders", 99))
        .await
        .expect(StatusCode::OK);
    let at = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
    let refused = restore(&app, &json!({"pattern": "many:*", "at": at})).await;
    refused.expect(StatusCode::BAD_REQUEST);
    assert!(refused.json()["detail"].as_str().unwrap().contains("10000"));
    assert_eq!(versions(&app, "many:00000").await.len(), 2);
}

/// `statehouse restore --url BASE ARGS...`: its exit code and stdout.
async fn restore_cli(api: &Api, args: &[&str]) -> (Option<i32>, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_statehouse"))
        .args(["restore", "--url", &api.base])
        .args(args)
        .env_remove("STATEHOUSE_TOKEN")
        .env_remove("STATEHOUSE_URL")
        .env_remove("MELTANO_STATE_BACKEND_URI")
        .output()
        .await
        .expect("statehouse runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[tokio::test]
async fn the_command_line_plans_a_line_per_change() {
    let app = gateway().await;
    let timeline = timeline(&app).await;
    let before = counts(&app).await;
    let (code, out) = restore_cli(&app, &["--pattern", "pit:*", "--at", "30m", "--dry-run"]).await;
    assert_eq!(code, Some(0), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines.len(),
        3,
        "A and B did not exist half an hour ago: {out}"
    );
    assert!(lines[2].starts_with("dry run to "), "{out}");
    assert!(
        lines[2].ends_with("0 restored, 2 deleted, 0 unchanged, 0 skipped-locked"),
        "{out}"
    );

    let (code, out) = restore_cli(
        &app,
        &["--pattern", "pit:*", "--at", &timeline.at, "--dry-run"],
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0].starts_with(&format!("restore        {A}")),
        "{out}"
    );
    assert!(lines[0].ends_with("orders: 3 -> 2"), "{out}");
    assert!(
        lines[1].starts_with(&format!("delete         {B}")),
        "{out}"
    );
    assert!(
        lines[2].starts_with(&format!("restore        {C}")),
        "{out}"
    );
    assert_eq!(counts(&app).await, before, "dry runs write nothing");

    let (code, out) = restore_cli(&app, &["--pattern", "pit:*", "--at", "yesterday-ish"]).await;
    assert_eq!(code, Some(1), "{out}");
    assert_eq!(counts(&app).await, before);
}

#[tokio::test]
async fn a_scoped_token_restores_only_its_ids_and_names_no_others() {
    let app = spawn_app_with(|config| {
        config.history = History::Kept(Some(Duration::from_secs(3600)));
        let mut tokens = statehouse::auth::Tokens::default();
        tokens
            .add(
                "test",
                "admin root-token-0123456789 root\nwrite team-token-0123456789 team scope=pit:*\n",
                '\n',
            )
            .unwrap();
        config.tokens = tokens;
    })
    .await;
    let at = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
    tokio::time::sleep(Duration::from_millis(5)).await;
    for id in [A, "other:tap"] {
        app.call(
            Method::PUT,
            &format!("/v1/states/{}", encode_id(id)),
            Some(&bookmark("orders", 1).to_string()),
            "root-token-0123456789",
        )
        .await
        .expect(StatusCode::CREATED);
    }
    let body = json!({"pattern": "*", "at": at}).to_string();
    let done = app
        .call(
            Method::POST,
            "/v1/restore",
            Some(&body),
            "team-token-0123456789",
        )
        .await;
    done.expect(StatusCode::OK);
    assert_eq!(actions(&done.json()), pairs(&[(A, "delete")]));
    for (id, status) in [(A, StatusCode::NOT_FOUND), ("other:tap", StatusCode::OK)] {
        let path = format!("/v1/states/{}", encode_id(id));
        app.call(Method::GET, &path, None, "root-token-0123456789")
            .await
            .expect_because(status, id);
    }
}
