//! Shared test plumbing: a gateway per test on its own ClickHouse database
//! (or two peers on one), raw SQL against the local ClickHouse, and the
//! HTTP client of api.rs that checks every response against openapi.yaml.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use statehouse::App;
use statehouse::config::{ClickHouseTarget, Config, parse_clickhouse_url};
use tokio::sync::oneshot;

// The client lives in api.rs; most tests take it from here with the rest.
pub use crate::api::{Api, Reply, ask, encode_id, pool_path};

/// The ClickHouse the tests use; `scripts/test` starts the local one and sets this.
pub fn clickhouse_url() -> String {
    std::env::var("STATEHOUSE_TEST_CLICKHOUSE_URL")
        .unwrap_or_else(|_| "clickhouse://default@127.0.0.1:8123/default".to_owned())
}

pub fn clickhouse_target() -> ClickHouseTarget {
    parse_clickhouse_url(&clickhouse_url())
        .expect("STATEHOUSE_TEST_CLICKHOUSE_URL must be a valid URI")
}

/// The second local ClickHouse node (`scripts/test` starts it): on the main
/// one's ZooKeeper, so their KeeperMap tables share keys, with MergeTree
/// tables of its own.
pub fn node_b_url() -> String {
    std::env::var("STATEHOUSE_TEST_CLICKHOUSE_NODE_B_URL")
        .expect("STATEHOUSE_TEST_CLICKHOUSE_NODE_B_URL is set by scripts/test")
}

/// The local ClickHouse that checks credentials (`scripts/test` starts it):
/// this URL's user may do anything.
pub fn auth_clickhouse_url() -> String {
    std::env::var("STATEHOUSE_TEST_CLICKHOUSE_AUTH_URL")
        .expect("STATEHOUSE_TEST_CLICKHOUSE_AUTH_URL is set by scripts/test")
}

/// The same ClickHouse as a user who may only read.
pub fn readonly_clickhouse_url() -> String {
    std::env::var("STATEHOUSE_TEST_CLICKHOUSE_READONLY_URL")
        .expect("STATEHOUSE_TEST_CLICKHOUSE_READONLY_URL is set by scripts/test")
}

/// A database name no other test uses.
pub fn unique_schema() -> String {
    format!("it_{}", uuid::Uuid::new_v4().simple())
}

/// The defaults `statehouse serve` has, on port 0 and a database of its own;
/// a short claim settle keeps lock tests quick (the mechanism is the same).
pub fn test_config(schema: &str) -> Config {
    let url = clickhouse_url();
    let mut config = Config::from_serve_args(&[
        "--clickhouse-url",
        &url,
        "--listen",
        "127.0.0.1:0",
        "--schema",
        schema,
        "--claim-settle",
        "200ms",
        "--shutdown-timeout",
        "5s",
    ])
    .expect("test configuration is valid");
    config.query_timeout = Duration::from_secs(10);
    config.startup_timeout = START_WAIT;
    config
}

/// How long a test gateway may take to start: its DDL queues behind every
/// other test's statements at the one local engine, which under
/// SCRIPTS_TEST_STRESS took longer than the 30 s default.
const START_WAIT: Duration = Duration::from_secs(120);

/// A test gateway on a port of its own that it advertises to its peers.
pub fn peer_config(schema: &str) -> Config {
    let mut config = test_config(schema);
    let port = free_port();
    config.listen = ([127, 0, 0, 1], port).into();
    config.locks.advertise_url = Some(format!("http://127.0.0.1:{port}"));
    config
}

/// Whether `config` is [`peer_config`]'s: it advertises its own listen port.
fn is_peer(config: &Config) -> bool {
    config.locks.advertise_url.as_deref()
        == Some(format!("http://127.0.0.1:{}", config.listen.port()).as_str())
}

/// Two gateways in this process on one database that forward to each other.
pub async fn two_peers() -> (TestApp, TestApp) {
    two_peers_with(|_, _| {}).await
}

/// As [`two_peers`]; `adjust` gets each one's configuration before it
/// starts, with its index (0 for the first, 1 for the second).
pub async fn two_peers_with(adjust: impl Fn(usize, &mut Config)) -> (TestApp, TestApp) {
    let schema = unique_schema();
    // Each one's port is picked just before it starts, so the two never pick the same.
    let start = |index| {
        let mut config = peer_config(&schema);
        adjust(index, &mut config);
        spawn_configured(config)
    };
    let first = start(0).await;
    (first, start(1).await)
}

/// A gateway running in this process on its own database.
pub struct TestApp {
    pub api: Api,
    pub schema: String,
    stop: Option<oneshot::Sender<()>>,
    served: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl std::ops::Deref for TestApp {
    type Target = Api;

    fn deref(&self) -> &Api {
        &self.api
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

pub async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

pub async fn spawn_app_with(adjust: impl FnOnce(&mut Config)) -> TestApp {
    let schema = unique_schema();
    let mut config = test_config(&schema);
    adjust(&mut config);
    spawn_configured(config).await
}

pub async fn spawn_configured(config: Config) -> TestApp {
    // Captured per test, shown only when that test fails.
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .try_init();
    let mut config = config;
    let app = loop {
        match App::build(&config).await {
            Ok(app) => break app,
            // Two tests' free_port() may pick the same port: a peer whose
            // own port was taken meanwhile moves to another.
            Err(err) if format!("{err:?}").contains("AddrInUse") && is_peer(&config) => {
                let port = free_port();
                config.listen = ([127, 0, 0, 1], port).into();
                config.locks.advertise_url = Some(format!("http://127.0.0.1:{port}"));
            }
            Err(err) => panic!("gateway starts against the test ClickHouse: {err:?}"),
        }
    };
    let base = format!("{}://{}", app.scheme(), app.local_addr());
    let (stop, stopped) = oneshot::channel();
    let served = tokio::spawn(app.serve(async move {
        let _ = stopped.await;
    }));
    TestApp {
        api: Api::new(base),
        schema: config.schema.as_str().to_owned(),
        stop: Some(stop),
        served: Some(served),
    }
}

impl TestApp {
    /// Stops the gateway as SIGTERM would, and waits until it has finished.
    pub async fn shut_down(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(served) = self.served.take() {
            served.await.unwrap().expect("a clean shutdown");
        }
    }

    /// Every state id with its content, straight from ClickHouse (FINAL).
    pub async fn table_snapshot(&self) -> Vec<(String, Option<String>, Option<String>)> {
        let rows = raw_sql(&format!(
            "SELECT state_id, completed_state, partial_state FROM `{}`.state FINAL ORDER BY state_id FORMAT JSONCompactEachRow",
            self.schema
        ))
        .await;
        rows.lines()
            .map(|line| {
                let row: Vec<Value> = serde_json::from_str(line).unwrap();
                let text = |v: &Value| v.as_str().map(str::to_owned);
                (text(&row[0]).unwrap(), text(&row[1]), text(&row[2]))
            })
            .collect()
    }
}

/// Sends SQL to the test ClickHouse over its HTTP interface, as any client would.
pub async fn raw_sql(sql: &str) -> String {
    raw_sql_at(&clickhouse_url(), sql).await
}

/// Writes `doc` as `id`'s row straight into the state table, as the
/// ClickHouse plugin does, stamped an hour ahead of the clock.
pub async fn plugin_writes_ahead(schema: &str, id: &str, doc: &Value) {
    raw_sql(&format!(
        "INSERT INTO `{schema}`.state (state_id, partial_state, completed_state, updated_at)
         SETTINGS async_insert=0
         VALUES ('{id}', '{}', '{}', now64(3) + INTERVAL 1 HOUR)",
        doc.get("partial").unwrap_or(&json!({})),
        doc.get("completed").unwrap_or(&json!({})),
    ))
    .await;
}

/// Sends SQL to the ClickHouse of `url`, as its user.
pub async fn raw_sql_at(url: &str, sql: &str) -> String {
    // A client per call: each test has its own runtime, and a connection
    // pooled by one that has ended fails the next test that picks it up
    // ("runtime dropped the dispatch task").
    let target = parse_clickhouse_url(url).expect("a valid ClickHouse URI");
    let response = reqwest::Client::new()
        .post(format!("{}/", target.endpoint()))
        .basic_auth(&target.user, Some(&target.password))
        .body(sql.to_owned())
        .send()
        .await
        .expect("ClickHouse answers");
    let status = response.status();
    let text = response.text().await.unwrap();
    assert!(status.is_success(), "ClickHouse refused {sql}: {text}");
    text
}

/// `statehouse serve` as a separate process, ready to serve.
pub struct GatewayProcess {
    pub base: String,
    pub child: tokio::process::Child,
    /// Every line it writes to stderr, byte for byte (without the `\n`).
    logs: tokio::task::JoinHandle<Vec<Vec<u8>>>,
}

impl GatewayProcess {
    pub fn api(&self) -> Api {
        Api::new(self.base.clone())
    }

    /// Sends SIGTERM and waits for a clean exit.
    pub async fn terminate(mut self) {
        // Once it answers it serves, and SIGTERM reaches its handler: right
        // after its ready line, the signal's default would still kill it.
        self.api().get("/readyz").await.expect(StatusCode::OK);
        let pid = self.child.id().expect("running");
        let status = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let exited = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("exits after SIGTERM")
            .unwrap();
        assert!(exited.success(), "{exited}");
    }

    /// Kills the process and answers every line it logged.
    pub async fn kill_and_collect_logs(mut self) -> Vec<Vec<u8>> {
        self.child.kill().await.expect("the gateway can be killed");
        self.logs.await.expect("the log reader finishes")
    }
}

/// A port bound and never listened on: connections to it are refused, and
/// while it lives no listener can take it. A port that `free_port` found is
/// free only until the next test binds port 0, so "nobody listens there"
/// held only by luck: in CI another test's gateway got one and answered.
pub struct ClosedPort(tokio::net::TcpSocket);

impl ClosedPort {
    pub fn bind() -> Self {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(([127, 0, 0, 1], 0).into()).unwrap();
        Self(socket)
    }

    pub fn port(&self) -> u16 {
        self.0.local_addr().unwrap().port()
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port())
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts the binary against `clickhouse_url` and waits for its ready line;
/// `extra` adds flags (the schema, claim timings, ...). Logs as JSON.
pub async fn spawn_gateway_process(clickhouse_url: &str, extra: &[&str]) -> GatewayProcess {
    spawn_gateway_process_logging(clickhouse_url, extra, "json", &[]).await
}

/// A gateway process that advertises its address to its peers.
pub async fn spawn_peer_process(clickhouse_url: &str, extra: &[&str]) -> GatewayProcess {
    spawn_on_a_free_port(clickhouse_url, "json", &[], |port| {
        advertised(&format!("http://127.0.0.1:{port}"), extra)
    })
    .await
}

/// `--advertise-url url` before `extra`.
fn advertised(url: &str, extra: &[&str]) -> Vec<String> {
    let mut args = vec!["--advertise-url".to_owned(), url.to_owned()];
    args.extend(extra.iter().map(|arg| (*arg).to_owned()));
    args
}

/// A gateway process serving HTTPS (`extra` has its certificate flags) that
/// advertises its `https://` address to its peers.
pub async fn spawn_https_peer_process(clickhouse_url: &str, extra: &[&str]) -> GatewayProcess {
    let mut process = spawn_on_a_free_port(clickhouse_url, "json", &[], |port| {
        advertised(&format!("https://127.0.0.1:{port}"), extra)
    })
    .await;
    process.base = process.base.replacen("http://", "https://", 1);
    process
}

/// As [`spawn_gateway_process`], with `--log-format log_format` and `env` set.
pub async fn spawn_gateway_process_logging(
    clickhouse_url: &str,
    extra: &[&str],
    log_format: &str,
    env: &[(&str, &str)],
) -> GatewayProcess {
    spawn_on_a_free_port(clickhouse_url, log_format, env, |_| {
        extra.iter().map(|arg| (*arg).to_owned()).collect()
    })
    .await
}

/// Starts a gateway on a port that was free a moment before, with the flags
/// `args_for(port)`. Another process (any outgoing connection's ephemeral
/// port) may take the port in between: a start that could not listen is
/// tried again on another port, so a busy machine does not fail a test.
async fn spawn_on_a_free_port(
    clickhouse_url: &str,
    log_format: &str,
    env: &[(&str, &str)],
    args_for: impl Fn(u16) -> Vec<String>,
) -> GatewayProcess {
    let mut tries = 0;
    loop {
        let port = free_port();
        let args = args_for(port);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        match try_spawn_on(port, clickhouse_url, &args, log_format, env).await {
            Ok(process) => return process,
            Err(output) if output.contains("cannot listen on") && tries < 5 => tries += 1,
            Err(output) => panic!("statehouse did not start:\n{output}"),
        }
    }
}

/// As [`spawn_gateway_process_logging`], on `port`.
pub async fn spawn_gateway_process_on(
    port: u16,
    clickhouse_url: &str,
    extra: &[&str],
    log_format: &str,
    env: &[(&str, &str)],
) -> GatewayProcess {
    try_spawn_on(port, clickhouse_url, extra, log_format, env)
        .await
        .unwrap_or_else(|output| panic!("statehouse did not start:\n{output}"))
}

/// Starts `statehouse serve` on `port` and waits for its ready line; a
/// process that exits first, or is not ready within 30 s, is answered by
/// what it printed.
async fn try_spawn_on(
    port: u16,
    clickhouse_url: &str,
    extra: &[&str],
    log_format: &str,
    env: &[(&str, &str)],
) -> Result<GatewayProcess, String> {
    use std::process::Stdio;
    use tokio::io::{AsyncBufReadExt, BufReader};

    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_statehouse"))
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--log-format",
            log_format,
        ])
        .args(extra)
        .env("STATEHOUSE_CLICKHOUSE_URL", clickhouse_url)
        .env(
            "STATEHOUSE_STARTUP_TIMEOUT",
            format!("{}s", START_WAIT.as_secs()),
        )
        .envs(env.iter().copied())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("statehouse starts");
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    // Raw bytes, split on `\n` only: a stray `\r` or invalid UTF-8 must stay visible.
    let (ready_tx, ready_rx) = oneshot::channel();
    let logs = tokio::spawn(async move {
        let mut lines = Vec::new();
        let mut ready_tx = Some(ready_tx);
        loop {
            let mut line = Vec::new();
            match stderr.read_until(b'\n', &mut line).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if line.last() == Some(&b'\n') {
                line.pop();
            }
            let text = String::from_utf8_lossy(&line);
            if let Some(tx) = ready_tx.take_if(|_| text.contains("statehouse ready")) {
                let _ = tx.send(text.into_owned());
            }
            // Keep draining so that it never blocks on a full pipe.
            lines.push(line);
        }
        lines
    });
    let ready = match tokio::time::timeout(START_WAIT, ready_rx).await {
        Ok(Ok(ready)) => ready,
        Ok(Err(_)) => return Err(printed(logs.await.unwrap_or_default())),
        Err(_) => {
            let _ = child.kill().await;
            let output = printed(logs.await.unwrap_or_default());
            return Err(format!(
                "not ready within {START_WAIT:?}; it printed:\n{output}"
            ));
        }
    };
    if log_format == "json" {
        let ready: Value = serde_json::from_str(&ready).expect("the ready line is JSON");
        assert_eq!(ready["message"], "statehouse ready");
    }
    Ok(GatewayProcess {
        base: format!("http://127.0.0.1:{port}"),
        child,
        logs,
    })
}

/// A process's stderr lines as one text.
fn printed(lines: Vec<Vec<u8>>) -> String {
    lines
        .iter()
        .map(|line| String::from_utf8_lossy(line))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Runs `statehouse serve` against `clickhouse_url` with a startup timeout
/// far longer than the test waits, so a start that retries fails the test;
/// answers the one line it printed on stderr.
pub async fn failed_start(clickhouse_url: &str, extra: &[&str]) -> String {
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_statehouse"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--startup-timeout",
            "60s",
        ])
        .args(extra)
        .env("STATEHOUSE_CLICKHOUSE_URL", clickhouse_url)
        .env("RUST_LOG", "off")
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("the start gave up at once instead of retrying")
        .expect("statehouse runs");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(stderr.starts_with("statehouse: error: "), "{stderr}");
    stderr
}

/// A TCP server on loopback that reads a request and answers `reply` to each
/// connection: a web server or another service where ClickHouse should be.
pub fn answering(reply: &'static [u8]) -> std::net::SocketAddr {
    use std::io::{Read, Write};

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut request = Vec::new();
            let mut buf = [0; 4096];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&buf[..n]),
                }
            }
            let _ = stream.write_all(reply);
        }
    });
    addr
}

/// One sample's value in a /metrics exposition, e.g.
/// `metric(&text, r#"statehouse_requests_shed_total{limit="requests"}"#)`.
pub fn metric(exposition: &str, sample: &str) -> Option<f64> {
    exposition.lines().find_map(|line| {
        line.strip_prefix(sample)?
            .strip_prefix(' ')?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// The statements of the write path a gateway has sent so far: routing and
/// lock reads, current rows, INSERTs (background work, such as claim
/// renewals and the gateway's heartbeat, left out).
pub async fn write_path_statements(api: &Api) -> f64 {
    joined(api).await;
    let text = api.get("/metrics").await.text;
    ["route_read", "lock_read", "get", "history_record", "put"]
        .iter()
        .map(|op| query_count(&text, op) as f64)
        .sum()
}

/// Waits until a table-mode gateway's membership joins have been answered
/// (one per lock core): a routing read asked for before stands in for no
/// fresh one (see docs/gateways.md, "A lone gateway claims without
/// settling"), so statements counted from here on are the writes' own.
pub async fn joined(api: &Api) {
    if std::env::var("STATEHOUSE_COORDINATION").is_ok_and(|mode| mode == "keeper") {
        return;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while queries(api, "member_beat").await < 2 {
        assert!(std::time::Instant::now() < deadline, "no membership joined");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How many ClickHouse statements of `operation` the gateway has sent.
pub async fn queries(api: &Api, operation: &str) -> u64 {
    query_count(&api.get("/metrics").await.text, operation)
}

/// The statements of `operation` counted in the `/metrics` text `metrics`.
fn query_count(metrics: &str, operation: &str) -> u64 {
    metric(
        metrics,
        &format!(
            r#"statehouse_clickhouse_query_duration_seconds_count{{operation="{operation}"}}"#
        ),
    )
    .map_or(0, |n| n as u64)
}
