//! Tokens that expire, a tokens file replaced while the gateway serves
//! (SIGHUP or a change of the file), and the audit of denials (issue 31).
//! Each gateway here is a process of its own: SIGHUP goes to a process.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};

use crate::helpers::{
    Api, GatewayProcess, clickhouse_url, metric, spawn_gateway_process, unique_schema,
};

const STAYS: &str = "stays-token-0123456789";
const OLD: &str = "old-token-0123456789";
const NEW: &str = "new-token-0123456789";
const EXPIRED: &str = "expired-token-0123456789";
const SCOPED: &str = "scoped-token-0123456789";
const ADMIN: &str = "admin-token-0123456789";

/// What the tests PUT: any state will do.
const DOC: &str = r#"{"completed": {"n": 1}}"#;

async fn gateway(tokens_file: &Path) -> GatewayProcess {
    let schema = unique_schema();
    spawn_gateway_process(
        &clickhouse_url(),
        &[
            "--schema",
            &schema,
            "--tokens-file",
            tokens_file.to_str().unwrap(),
        ],
    )
    .await
}

fn hang_up(process: &GatewayProcess) {
    let pid = process.child.id().expect("running").to_string();
    let status = std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap();
    assert!(status.success());
}

/// Waits until `token` gets `expected` on a read, for at most 10 s.
async fn until_status(api: &Api, token: &str, expected: StatusCode) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = api
            .call(Method::GET, "/v1/states", None, token)
            .await
            .status;
        if status == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{token}: still {status}, not {expected}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A directory for one test's tokens file, removed at its end.
struct TokensDir(std::path::PathBuf);

impl TokensDir {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("statehouse-tokens-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for TokensDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

#[tokio::test]
async fn sighup_replaces_a_token_while_16_clients_send_requests_and_none_fails() {
    let dir = TokensDir::new();
    let file = dir.0.join("tokens");
    write(&file, &format!("write {STAYS} workers\nread {OLD} old\n"));
    let mut process = gateway(&file).await;
    let api = process.api();
    api.call(Method::GET, "/v1/states", None, OLD)
        .await
        .expect(StatusCode::OK);

    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..16)
        .map(|n| {
            let (api, stop, sent) = (api.clone(), stop.clone(), sent.clone());
            tokio::spawn(async move {
                let path = format!("/v1/states/client-{n}");
                // Each sends until it has sent a request begun after the
                // second SIGHUP, however slowly the machine lets it go.
                loop {
                    let last = stop.load(Ordering::Relaxed);
                    let (method, body) = if n % 2 == 0 {
                        (Method::PUT, Some(DOC))
                    } else {
                        (Method::GET, None)
                    };
                    let reply = api.call(method, &path, body, STAYS).await;
                    assert!(
                        reply.status.is_success() || reply.status == StatusCode::NOT_FOUND,
                        "client {n}: {} {}",
                        reply.status,
                        reply.text
                    );
                    sent.fetch_add(1, Ordering::Relaxed);
                    if last {
                        break;
                    }
                }
            })
        })
        .collect();
    // The clients are busy before the first SIGHUP.
    let give_up = Instant::now() + Duration::from_secs(30);
    while sent.load(Ordering::Relaxed) < 16 {
        assert!(Instant::now() < give_up, "the clients never got going");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    write(&file, &format!("write {STAYS} workers\nread {NEW} new\n"));
    hang_up(&process);
    until_status(&api, NEW, StatusCode::OK).await;
    api.call(Method::GET, "/v1/states", None, OLD)
        .await
        .expect(StatusCode::UNAUTHORIZED);
    // Another SIGHUP in the middle of the traffic, with nothing changed.
    hang_up(&process);
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.await.expect("no client saw a failure");
    }
    assert!(
        process.child.try_wait().unwrap().is_none(),
        "SIGHUP did not end the gateway"
    );
    process.terminate().await;
}

#[tokio::test]
async fn a_file_that_does_not_parse_keeps_the_old_tokens_and_a_change_is_picked_up() {
    let dir = TokensDir::new();
    let file = dir.0.join("tokens");
    write(&file, &format!("read {OLD} old\n"));
    let process = gateway(&file).await;
    let api = process.api();
    for broken in [
        "",
        "# nothing but a comment\n",
        "read new-tok",
        &format!("read {NEW} new\nwrite short\n"),
    ] {
        write(&file, broken);
        hang_up(&process);
        // Past the debounce of a change, too.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        api.call(Method::GET, "/v1/states", None, OLD)
            .await
            .expect_because(StatusCode::OK, format!("{broken:?}"));
        api.call(Method::GET, "/v1/states", None, NEW)
            .await
            .expect_because(StatusCode::UNAUTHORIZED, format!("{broken:?}"));
    }
    // No SIGHUP: the change of the file is enough.
    write(&file, &format!("read {NEW} new\n"));
    until_status(&api, NEW, StatusCode::OK).await;
    until_status(&api, OLD, StatusCode::UNAUTHORIZED).await;
    let logs = process.kill_and_collect_logs().await;
    let text: Vec<String> = logs
        .iter()
        .map(|l| String::from_utf8_lossy(l).into_owned())
        .collect();
    assert!(
        text.iter()
            .any(|l| l.contains("tokens not reloaded") && l.contains("line 2")),
        "a refused reload says why: {text:#?}"
    );
    for line in &text {
        assert!(
            !line.contains(OLD) && !line.contains(NEW),
            "a token in the log: {line}"
        );
    }
}

#[tokio::test]
async fn sighup_does_not_end_a_gateway_without_tls_or_tokens_file() {
    let schema = unique_schema();
    let mut process = spawn_gateway_process(&clickhouse_url(), &["--schema", &schema]).await;
    hang_up(&process);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        process.child.try_wait().unwrap().is_none(),
        "SIGHUP ended the gateway"
    );
    process.api().get("/readyz").await.expect(StatusCode::OK);
    process.terminate().await;
}

#[tokio::test]
async fn expiry_and_each_denial_are_counted_and_logged_by_name_never_by_token() {
    let dir = TokensDir::new();
    let file = dir.0.join("tokens");
    write(
        &file,
        &format!(
            "admin {ADMIN} root\n\
             read {EXPIRED} last-year expires=2020-01-01T00:00:00Z\n\
             write {STAYS} until-2999 expires=2999-01-01T00:00:00+02:00\n\
             write {SCOPED} team-a scope=team-a:*\n"
        ),
    );
    let process = gateway(&file).await;
    let api = process.api();
    let expired = api.call(Method::GET, "/v1/states", None, EXPIRED).await;
    expired.expect(StatusCode::UNAUTHORIZED);
    assert_eq!(expired.problem_type(), "unauthorized");
    assert!(
        expired.json()["detail"]
            .as_str()
            .unwrap()
            .contains("expired"),
        "{}",
        expired.text
    );
    api.call(Method::GET, "/v1/states", None, STAYS)
        .await
        .expect(StatusCode::OK);

    api.call(Method::GET, "/v1/states", None, "nobody-token-0123456789")
        .await
        .expect(StatusCode::UNAUTHORIZED);
    api.call(Method::DELETE, "/v1/locks/team-a:x", None, SCOPED)
        .await
        .expect(StatusCode::FORBIDDEN);
    for _ in 0..2 {
        let outside = api
            .call(Method::PUT, "/v1/states/team-b:x", Some(DOC), SCOPED)
            .await;
        assert_eq!(outside.problem_type(), "out-of-scope");
    }
    let metrics = api.get("/metrics").await.text;
    for (reason, count) in [
        ("unknown", 1.0),
        ("expired", 1.0),
        ("role", 1.0),
        ("scope", 2.0),
    ] {
        let sample = format!("statehouse_auth_denied_total{{reason=\"{reason}\"}}");
        assert_eq!(metric(&metrics, &sample), Some(count), "{sample}");
    }

    let logs = process.kill_and_collect_logs().await;
    let denials: Vec<serde_json::Value> = logs
        .iter()
        .filter_map(|line| serde_json::from_slice::<serde_json::Value>(line).ok())
        .filter(|line| line["message"] == "request denied")
        .collect();
    assert_eq!(denials.len(), 5, "{denials:#?}");
    let scope = denials.iter().find(|d| d["reason"] == "scope").unwrap();
    assert_eq!(scope["token"], "team-a");
    assert_eq!(scope["route"], "/v1/states/{state_id}");
    assert_eq!(scope["state_id"], "team-b:x");
    assert!(
        denials
            .iter()
            .any(|d| d["reason"] == "expired" && d["token"] == "last-year")
    );
    for line in &logs {
        let line = String::from_utf8_lossy(line);
        for token in [ADMIN, EXPIRED, STAYS, SCOPED, "nobody-token-0123456789"] {
            assert!(!line.contains(token), "a token in the log: {line}");
        }
    }
}
