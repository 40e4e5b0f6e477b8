//! The `statehouse` binary as scripts and runbooks call it.

use std::process::Command;
use std::time::Duration;

use crate::helpers::{ClosedPort, answering, free_port, spawn_gateway_process, unique_schema};

const BIN: &str = env!("CARGO_BIN_EXE_statehouse");

fn run(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default());
    for (name, value) in env {
        command.env(name, value);
    }
    let output = command.output().expect("statehouse runs");
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn help_documents_every_setting_with_its_env_var() {
    let output = Command::new(BIN)
        .args(["serve", "--help"])
        .output()
        .unwrap();
    assert!(output.status.success());
    let help = String::from_utf8(output.stdout).unwrap();
    for (flag, env) in [
        ("--listen", "STATEHOUSE_LISTEN"),
        ("--clickhouse-url", "STATEHOUSE_CLICKHOUSE_URL"),
        ("--clickhouse-host", "STATEHOUSE_CLICKHOUSE_HOST"),
        ("--clickhouse-port", "STATEHOUSE_CLICKHOUSE_PORT"),
        ("--clickhouse-database", "STATEHOUSE_CLICKHOUSE_DATABASE"),
        ("--clickhouse-user", "STATEHOUSE_CLICKHOUSE_USER"),
        ("--clickhouse-password", "STATEHOUSE_CLICKHOUSE_PASSWORD"),
        ("--clickhouse-secure", "STATEHOUSE_CLICKHOUSE_SECURE"),
        ("--clickhouse-ca-file", "STATEHOUSE_CLICKHOUSE_CA_FILE"),
        ("--schema", "STATEHOUSE_SCHEMA"),
        ("--table", "STATEHOUSE_TABLE"),
        ("--query-timeout", "STATEHOUSE_QUERY_TIMEOUT"),
        ("--startup-timeout", "STATEHOUSE_STARTUP_TIMEOUT"),
        ("--body-limit", "STATEHOUSE_BODY_LIMIT"),
        ("--shutdown-timeout", "STATEHOUSE_SHUTDOWN_TIMEOUT"),
        (
            "--max-concurrent-requests",
            "STATEHOUSE_MAX_CONCURRENT_REQUESTS",
        ),
        ("--max-lock-waiters", "STATEHOUSE_MAX_LOCK_WAITERS"),
        ("--header-read-timeout", "STATEHOUSE_HEADER_READ_TIMEOUT"),
        ("--body-read-timeout", "STATEHOUSE_BODY_READ_TIMEOUT"),
        ("--idle-timeout", "STATEHOUSE_IDLE_TIMEOUT"),
        ("--log-format", "STATEHOUSE_LOG_FORMAT"),
        ("--tokens-file", "STATEHOUSE_TOKENS_FILE"),
        ("--tokens", "STATEHOUSE_TOKENS"),
        ("--protect-metrics", "STATEHOUSE_PROTECT_METRICS"),
        (
            "--allow-unauthenticated",
            "STATEHOUSE_ALLOW_UNAUTHENTICATED",
        ),
        ("--gateway-id", "STATEHOUSE_GATEWAY_ID"),
        ("--claim-settle", "STATEHOUSE_CLAIM_SETTLE"),
        ("--claim-ttl", "STATEHOUSE_CLAIM_TTL"),
        ("--claim-idle", "STATEHOUSE_CLAIM_IDLE"),
    ] {
        assert!(help.contains(flag), "{flag} missing from --help");
        assert!(
            help.contains(&format!("env: {env}")),
            "{env} missing from --help"
        );
    }
    let top = Command::new(BIN).arg("--help").output().unwrap();
    assert!(String::from_utf8(top.stdout).unwrap().contains("serve"));
}

#[test]
fn missing_or_malformed_uri_is_one_clear_line_and_a_failure() {
    for (env, expected) in [
        (vec![], "no ClickHouse URL"),
        (
            vec![("STATEHOUSE_CLICKHOUSE_URL", "localhost:8123")],
            "invalid ClickHouse URL",
        ),
        (
            vec![("STATEHOUSE_CLICKHOUSE_URL", "postgres://h/db")],
            "unsupported scheme",
        ),
        (
            vec![
                ("STATEHOUSE_CLICKHOUSE_URL", "clickhouse://h"),
                ("STATEHOUSE_SCHEMA", "bad-name"),
            ],
            "invalid schema",
        ),
    ] {
        let (code, stderr) = run(&["serve"], &env);
        assert_eq!(code, Some(1), "{env:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
        assert!(
            stderr.starts_with("statehouse: error: ") && stderr.contains(expected),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked"));
    }
}

const PROXY_502: &[u8] = b"HTTP/1.1 502 Bad Gateway\r\nServer: nginx\r\nContent-Type: text/html\r\nContent-Length: 53\r\nConnection: close\r\n\r\n<html><head><title>502 Bad Gateway</title></head></html>";

#[test]
fn unreachable_clickhouse_at_start_is_retried_until_the_startup_timeout() {
    let closed = ClosedPort::bind();
    let closed_port = format!("clickhouse://default@127.0.0.1:{}/default", closed.port());
    let proxy_without_upstream = format!("clickhouse://default@{}/default", answering(PROXY_502));
    for url in [closed_port, proxy_without_upstream] {
        let (code, stderr) = run(
            &[
                "serve",
                "--startup-timeout",
                "2s",
                "--listen",
                "127.0.0.1:0",
                "--log-format",
                "json",
            ],
            &[("STATEHOUSE_CLICKHOUSE_URL", &url), ("RUST_LOG", "warn")],
        );
        assert_eq!(code, Some(1), "{stderr}");
        let (last, logs) = stderr
            .lines()
            .collect::<Vec<_>>()
            .split_last()
            .map(|(last, logs)| (last.to_string(), logs.to_vec()))
            .expect("something on stderr");
        assert!(
            last.starts_with("statehouse: error: ") && last.contains("not usable after"),
            "{stderr}"
        );
        let retries = logs
            .iter()
            .filter(|line| line.contains("ClickHouse not usable yet"))
            .count();
        assert!(retries >= 2, "retried before giving up: {stderr}");
    }
}

#[tokio::test]
async fn logs_a_ready_line_as_json_and_drains_in_flight_requests_on_sigterm() {
    let target = crate::helpers::clickhouse_target();
    let proxy = crate::proxy::Proxy::to_clickhouse().await;
    let url = format!(
        "clickhouse://{}:{}@{}/{}",
        target.user, target.password, proxy.addr, target.database
    );
    let schema = unique_schema();
    let mut gateway = spawn_gateway_process(&url, &["--schema", &schema]).await;

    let client = reqwest::Client::new();
    let ready = client
        .get(format!("{}/readyz", gateway.base))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    proxy.set_delay(Duration::from_millis(1500));
    let in_flight = tokio::spawn({
        let client = client.clone();
        let url = format!("{}/v1/states/slow", gateway.base);
        async move {
            client
                .put(url)
                .body(r#"{"completed":{"v":1}}"#)
                .send()
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = gateway.child.id().unwrap().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );

    let reply = in_flight
        .await
        .unwrap()
        .expect("the in-flight request is answered");
    assert_eq!(reply.status(), 201, "it finished its write");
    let status = tokio::time::timeout(Duration::from_secs(30), gateway.child.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    proxy.set_delay(Duration::ZERO);
    let stored = crate::helpers::raw_sql(&format!(
        "SELECT count() FROM `{schema}`.state FINAL WHERE state_id = 'slow'"
    ))
    .await;
    assert_eq!(stored.trim(), "1");
}

#[test]
fn an_open_address_without_tokens_is_refused_at_once_naming_both_ways_out() {
    // Nothing listens at this ClickHouse: a start that went on to it would
    // retry for the 30 s startup timeout. The bound below it only catches
    // that; a refusal takes a process start.
    let closed = ClosedPort::bind();
    let clickhouse = format!("clickhouse://default@127.0.0.1:{}/default", closed.port());
    for listen in ["0.0.0.0:8080", "[::]:8080"] {
        let started = std::time::Instant::now();
        let (code, stderr) = run(
            &["serve", "--listen", listen],
            &[("STATEHOUSE_CLICKHOUSE_URL", &clickhouse)],
        );
        assert!(started.elapsed() < Duration::from_secs(20), "at once");
        assert_eq!(code, Some(2), "{listen}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
        assert!(stderr.contains(listen), "{stderr}");
        assert!(
            stderr.contains("--tokens-file") && stderr.contains("--allow-unauthenticated"),
            "both ways out: {stderr}"
        );
    }
}

#[tokio::test]
async fn allow_unauthenticated_serves_the_address_it_was_given() {
    let schema = unique_schema();
    let port = free_port();
    let mut child = tokio::process::Command::new(BIN)
        .args([
            "serve",
            "--listen",
            &format!("0.0.0.0:{port}"),
            "--schema",
            &schema,
        ])
        .env_remove("STATEHOUSE_TOKENS")
        .env_remove("STATEHOUSE_TOKENS_FILE")
        .env("STATEHOUSE_ALLOW_UNAUTHENTICATED", "true")
        .env(
            "STATEHOUSE_CLICKHOUSE_URL",
            crate::helpers::clickhouse_url(),
        )
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let ready = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains("statehouse ready") {
                return line;
            }
        }
        panic!("the gateway ended before it was ready");
    })
    .await
    .expect("ready within 30 s");
    assert!(ready.contains(&format!("0.0.0.0:{port}")), "{ready}");
    // Reached through loopback, which the wildcard address includes.
    let local = reqwest::get(format!("http://127.0.0.1:{port}/healthz"))
        .await
        .unwrap();
    assert_eq!(local.status(), 200);
}

/// A command line missing what it needs says what would do, and its usage
/// line shows as required only what is: flags set from the environment are
/// options, however they were given.
#[test]
fn a_missing_argument_names_every_way_to_give_it() {
    let from_env = [
        ("STATEHOUSE_URL", "http://gateway.internal:8080"),
        ("STATEHOUSE_LOCK_OWNER", "cron"),
        ("STATEHOUSE_TOKEN", "token-from-the-environment"),
    ];
    for (args, names) in [
        (&["lock", "--", "true"][..], &["--pool", "STATE_ID"][..]),
        (&["wait", "dev:id"], &["--stream", "--changed"]),
        (&["wait", "--stream=s", "dev:id"], &["--until"]),
    ] {
        let (code, stderr) = run(args, &from_env);
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
        let (missing, usage) = stderr.split_once("Usage:").expect("a usage line");
        for name in names {
            assert!(missing.contains(name), "{args:?} names {name}: {stderr}");
        }
        for flag in ["--url", "--owner", "--token"] {
            assert!(!usage.contains(flag), "{args:?}: {flag} in {usage}");
        }
    }
}

/// `wait --help` asks for the token a wait needs, and says when it gives up
/// on a gateway that does not answer.
#[test]
fn wait_help_asks_for_a_read_token_and_names_its_exits() {
    let output = Command::new(BIN).args(["wait", "--help"]).output().unwrap();
    assert!(output.status.success());
    let help = String::from_utf8(output.stdout).unwrap();
    assert!(help.contains("a read token is enough"), "{help}");
    for said in ["124", "cannot be reached"] {
        assert!(help.contains(said), "{said} missing from {help}");
    }
}
