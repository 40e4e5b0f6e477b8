//! `statehouse lock` records its run (issue 54): started after the grant,
//! ended with the command's exit code or signal, none with `--no-run` or
//! for pools alone, `lost` when the runner dies, and a gateway that refuses
//! the record leaves the command running.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use statehouse::store::History;

use crate::helpers::{Api, spawn_app, spawn_app_with};
use crate::run_lease::{BIN, Scratch, ended, lock, lock_with, pid_in, until};

/// The runs of `id`, newest first.
async fn runs(app: &Api, id: &str) -> Vec<Value> {
    let listed = app.get(&format!("/v1/runs?pattern={id}")).await.json();
    listed["runs"].as_array().unwrap().clone()
}

#[tokio::test]
async fn each_run_is_recorded_with_how_its_command_ended() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    for (script, code) in [("exit 3", 3), ("true", 0), ("kill -TERM $$", 128 + 15)] {
        let run = lock(
            &app.base,
            &["--info", "dag=nightly"],
            "job",
            &scratch.0,
            script,
        );
        let (status, stderr) = ended(run, Duration::from_secs(20)).await;
        assert_eq!(status, Some(code), "{script}: {stderr}");
        assert_eq!(stderr, "", "{script}: nothing to say");
    }
    let recorded = runs(&app, "job").await;
    assert_eq!(recorded.len(), 3);
    let (signalled, succeeded, failed) = (&recorded[0], &recorded[1], &recorded[2]);
    assert_eq!(failed["status"], "failed");
    assert_eq!(failed["exit_code"], 3);
    assert_eq!(succeeded["status"], "succeeded");
    assert_eq!(succeeded["exit_code"], 0);
    assert_eq!(signalled["status"], "failed");
    assert_eq!(signalled["signal"], 15);
    assert_eq!(signalled["exit_code"], Value::Null);
    let info = &failed["info"];
    assert_eq!(info["dag"], "nightly");
    assert_eq!(info["command"], "sh -c exit 3");
    assert!(info["host"].is_string() && info["pid"].is_u64(), "{info}");

    let quiet = lock(&app.base, &["--no-run"], "job", &scratch.0, "true");
    assert_eq!(ended(quiet, Duration::from_secs(20)).await.0, Some(0));
    let pooled = lock_with(&app.base, &["--pool", "etl=2"], &scratch.0, "true");
    assert_eq!(ended(pooled, Duration::from_secs(20)).await.0, Some(0));
    assert_eq!(
        app.get("/v1/runs").await.json()["runs"]
            .as_array()
            .unwrap()
            .len(),
        3,
        "--no-run and a pool alone record none"
    );

    let table = runs_command(&app.base, &["--pattern", "j*"]).await;
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 4, "{table}");
    assert!(lines[0].starts_with("STATE_ID  STATUS"), "{table}");
    assert!(
        lines[1].contains("FAILED") && lines[1].contains("SIG15"),
        "{table}"
    );
    assert!(lines[2].contains("succeeded"), "{table}");
    let json = runs_command(
        &app.base,
        &["--json", "--status", "failed", "--since", "1h"],
    )
    .await;
    let lines: Vec<Value> = json
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(lines, [signalled.clone(), failed.clone()]);
    let one = runs_command(&app.base, &["--json", "--limit", "1"]).await;
    assert_eq!(one.lines().count(), 1);
}

/// `statehouse runs --url BASE ARGS...`: its stdout, once it exits 0.
async fn runs_command(base: &str, args: &[&str]) -> String {
    let output = tokio::process::Command::new(BIN)
        .args(["runs", "--url", base])
        .args(args)
        .env_remove("STATEHOUSE_TOKEN")
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

#[tokio::test]
async fn a_gateway_that_refuses_the_run_still_runs_the_command() {
    let app = spawn_app_with(|config| config.history = History::Off).await;
    let scratch = Scratch::new();
    let run = lock(&app.base, &[], "job", &scratch.0, "touch ran");
    let (status, stderr) = ended(run, Duration::from_secs(20)).await;
    assert_eq!(status, Some(0), "{stderr}");
    assert!(scratch.read("ran").is_some(), "the command ran");
    assert!(stderr.contains("the run is not recorded"), "{stderr}");
    assert!(
        stderr.contains("history-off") || stderr.contains("404"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_runner_killed_leaves_its_run_lost_within_the_ttl() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let mut run = lock(
        &app.base,
        &["--ttl", "2s", "--lock-delay", "3s"],
        "job",
        &scratch.0,
        "echo $$ > command; exec sleep 60",
    );
    until("the command starts", Duration::from_secs(20), || {
        scratch
            .read("command")
            .is_some_and(|pid| pid.ends_with('\n'))
    })
    .await;
    let _ = pid_in(&scratch, "command");
    run.start_kill().unwrap();
    let _ = run.wait().await;
    let killed = Instant::now();
    let lost = loop {
        let recorded = runs(&app, "job").await;
        assert_eq!(recorded.len(), 1);
        if recorded[0]["status"] != "running" {
            break recorded[0].clone();
        }
        assert!(
            killed.elapsed() < Duration::from_secs(2 + 5),
            "still running past the TTL and 5 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(lost["status"], "lost");
    assert_eq!(lost["exit_code"], Value::Null);
    let history = app.get("/v1/locks/job/history").await.json();
    assert_eq!(lost["ended_at"], history["leases"][0]["ended_at"]);
    assert_eq!(history["leases"][0]["ended_by"], json!("expired"));
}
