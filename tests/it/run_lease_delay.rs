//! `statehouse lock` and the lock-delay, from the client side: it asks for
//! one with every acquire, and an id in its lock-delay is busy (a stand-in
//! gateway answers, since the gateway's own lock-delay is built elsewhere);
//! and, against real gateways, the runner notices a lease's end between
//! renewals, so that with the defaults the delay keeps a lost run's command
//! and the next run's apart, even one that ignores SIGTERM.

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::helpers::{
    clickhouse_url, metric, peer_config, spawn_app, spawn_app_with, spawn_configured,
    spawn_peer_process, two_peers, unique_schema,
};
use crate::run_lease::{STARTS, Scratch, WAIT_FOR_GO, ended, lock, lock_with, pid_in, until};

/// Answers one request with a 409 `lock-delay`; hands back the request's body.
async fn delayed_gateway() -> (String, tokio::task::JoinHandle<Value>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let served = tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.unwrap();
        let mut received = Vec::new();
        let mut buf = [0u8; 4096];
        let body = loop {
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0, "the request broke off");
            received.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&received).into_owned();
            let Some((head, body)) = text.split_once("\r\n\r\n") else {
                continue;
            };
            let length: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().to_owned())
                })
                .expect("a content-length")
                .parse()
                .unwrap();
            if body.len() >= length {
                break serde_json::from_str::<Value>(&body[..length]).unwrap();
            }
        };
        let problem = r#"{"type":"urn:statehouse:problem:lock-delay","title":"Lock-delay","status":409,"detail":"the last lease was lost","free_at":"2026-12-05T01:00:15.000Z"}"#;
        let answer = format!(
            "HTTP/1.1 409 Conflict\r\ncontent-type: application/problem+json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{problem}",
            problem.len()
        );
        conn.write_all(answer.as_bytes()).await.unwrap();
        body
    });
    (base, served)
}

#[tokio::test]
async fn an_id_in_its_lock_delay_is_busy_and_the_delay_asked_for_is_2s_plus_grace_plus_5s() {
    for (flags, asked) in [
        (vec!["--grace", "20s"], 27),
        (vec!["--lock-delay", "1500ms"], 2),
    ] {
        let (base, served) = delayed_gateway().await;
        let scratch = Scratch::new();
        let run = lock(&base, &flags, "job", &scratch.0, "touch ran");
        let (status, stderr) = ended(run, Duration::from_secs(20)).await;
        assert_eq!(status, Some(75), "{stderr}");
        assert!(stderr.contains("2026-12-05T01:00:15.000Z"), "{stderr}");
        assert!(stderr.contains("lock-delay"), "{stderr}");
        assert!(!scratch.path("ran").exists(), "nothing was run");
        let body = served.await.unwrap();
        assert_eq!(body["lock_delay_seconds"], asked, "{flags:?}: {body}");
    }
}

/// Acceptance 10 of issue 54, with every setting at its default (TTL 30 s,
/// renewals 10 s apart, grace 10 s): run A's command ignores SIGTERM and is
/// force-unlocked while run B waits for the id. A's runner notices within
/// 2 s, not at its next renewal, and SIGKILLs the command after the grace,
/// within the default lock-delay (2 s + grace + 5 s): B's command starts
/// after A's is dead, as B's command itself checks.
#[tokio::test]
async fn with_the_defaults_a_force_unlocked_command_that_ignores_sigterm_is_dead_before_the_next_starts()
 {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    // SIGTERM ignored is inherited by the loop's `sleep`s: only SIGKILL
    // ends the group.
    let a = lock(
        &app.base,
        &[],
        "job",
        &scratch.0,
        "trap '' TERM; echo $$ > a; while :; do sleep 0.1; done",
    );
    until("A's command starts", STARTS, || {
        scratch.read("a").is_some_and(|pid| pid.ends_with('\n'))
    })
    .await;
    let a_pid = pid_in(&scratch, "a");
    // B's command, once it runs, writes the state of A's command as
    // /proc shows it (third field of its stat; nothing once it is gone).
    let b = lock(
        &app.base,
        &["--wait", "2m"],
        "job",
        &scratch.0,
        &format!("cut -d' ' -f3 /proc/{a_pid}/stat > a-seen-by-b 2>/dev/null; touch b"),
    );
    // B is in the gateway's line before A's lease is forced to end.
    let deadline = tokio::time::Instant::now() + STARTS;
    while metric(
        &app.get("/metrics").await.text,
        r#"statehouse_lock_events_total{event="wait"}"#,
    )
    .unwrap_or(0.0)
        < 1.0
    {
        assert!(tokio::time::Instant::now() < deadline, "B waits in line");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    app.request(Method::DELETE, "/v1/locks/job", None, &[])
        .await
        .expect(StatusCode::NO_CONTENT);
    let (a_status, a_stderr) = ended(a, STARTS).await;
    assert_eq!(a_status, Some(76), "{a_stderr}");
    let (b_status, b_stderr) = ended(b, STARTS).await;
    assert_eq!(b_status, Some(0), "{b_stderr}");
    assert!(scratch.path("b").exists(), "B ran its command");
    let seen = scratch.read("a-seen-by-b").unwrap_or_default();
    assert!(
        matches!(seen.trim(), "" | "Z" | "X"),
        "A's command was still running (state {seen:?}) when B's started; A said: {a_stderr}"
    );
}

/// A gateway that cuts the lock-delay (`--max-lock-delay`) below what the
/// runner asks for breaks the promise above: the runner says so, and runs.
#[tokio::test]
async fn a_lock_delay_cut_by_the_gateway_is_said() {
    let app = spawn_app_with(|config| config.locks.max_lock_delay = Duration::from_secs(5)).await;
    let scratch = Scratch::new();
    let run = lock(&app.base, &["--no-run"], "job", &scratch.0, "touch ran");
    let (status, stderr) = ended(run, STARTS).await;
    assert_eq!(status, Some(0), "{stderr}");
    assert!(scratch.path("ran").exists());
    assert!(
        stderr.contains("cut the lock-delay on job to 5s") && stderr.contains("the 17s asked"),
        "{stderr}"
    );
}

/// The runner looks at each of its leases between renewals, through
/// whichever gateway it talks to: with renewals 20 minutes apart (`--ttl
/// 1h`), a force-unlock of the state_id's lock, or of a pool, through the
/// other gateway still ends the run with 76. (The test's bound only catches
/// a hang: the next renewal would come 20 minutes later.)
#[tokio::test]
async fn a_lease_ended_through_another_gateway_is_noticed_between_renewals() {
    let (a, b) = two_peers().await;
    let scratch = Scratch::new();
    let flags = ["--ttl", "1h", "--grace", "0s", "--lock-delay", "0s"];
    for (held, end) in [
        (&["job"][..], "/v1/locks/job"),
        (&["--pool", "etl=1"][..], "/v1/pools/etl"),
    ] {
        let _ = std::fs::remove_file(scratch.path("ready"));
        let run = lock_with(
            &b.base,
            &[&flags[..], held].concat(),
            &scratch.0,
            WAIT_FOR_GO,
        );
        until("the command starts", STARTS, || {
            scratch.path("ready").exists()
        })
        .await;
        a.request(Method::DELETE, end, None, &[])
            .await
            .expect(StatusCode::NO_CONTENT);
        let (status, stderr) = ended(run, STARTS).await;
        assert_eq!(status, Some(76), "{end}: {stderr}");
        assert!(
            stderr.contains("the gateway refused its renewal"),
            "{end}: {stderr}"
        );
    }
}

/// A lease lost with its authority's claim (the authority killed) is
/// noticed through the surviving gateway between renewals (`--ttl 1h`)
/// once the claim lapses, and the runner exits 76. (The bound only catches
/// a hang: the next renewal would come 20 minutes later.)
#[tokio::test]
async fn a_lease_lost_with_its_authoritys_claim_is_noticed_between_renewals() {
    let schema = unique_schema();
    let args = [
        "--schema",
        &schema,
        "--claim-ttl",
        "3s",
        "--claim-settle",
        "200ms",
    ];
    let authority = spawn_peer_process(&clickhouse_url(), &args).await;
    let survivor = spawn_configured(peer_config(&schema)).await;
    // The authority holds the id (a short lease of its own): the runner's
    // acquire through the survivor is forwarded to it and waits there.
    authority
        .api()
        .acquire("job", &json!({"owner": "first", "ttl_seconds": 1}))
        .await
        .expect(StatusCode::CREATED);
    let authority_id = authority.api().get("/v1/locks/job").await.json()["gateway_id"].clone();
    let scratch = Scratch::new();
    let run = lock(
        &survivor.base,
        &[
            "--ttl",
            "1h",
            "--wait",
            "30s",
            "--grace",
            "0s",
            "--lock-delay",
            "0s",
        ],
        "job",
        &scratch.0,
        WAIT_FOR_GO,
    );
    until("the command starts", STARTS, || {
        scratch.path("ready").exists()
    })
    .await;
    let held = authority.api().get("/v1/locks/job").await.json();
    assert_eq!(
        held["gateway_id"], authority_id,
        "the authority granted it: {held}"
    );
    let _ = authority.kill_and_collect_logs().await;
    let (status, stderr) = ended(run, STARTS).await;
    assert_eq!(status, Some(76), "{stderr}");
}
