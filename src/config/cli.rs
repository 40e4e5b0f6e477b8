//! The command line: `serve`, `lock`, `wait`, `restore`, `runs` and `healthcheck`, each flag with its
//! `STATEHOUSE_*` variable.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use uuid::Uuid;

use crate::domain::{Coordination, GuardMode};
use crate::telemetry::LogFormat;

#[derive(Debug, Parser)]
#[command(
    name = "statehouse",
    version,
    about = "HTTP gateway that keeps Meltano pipeline state in ClickHouse"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the gateway.
    Serve(Box<ServeArgs>),
    /// Exit 0 if the gateway on this machine answers GET /readyz with 200
    /// (for container health checks, which have no curl).
    Healthcheck(HealthcheckArgs),
    /// Run a command while holding the lease on a state_id, so that no two
    /// runs of one pipeline overlap, and a slot of each --pool, so that at
    /// most its limit of runs go at once: exits with the command's status,
    /// 75 when another holds the lock (or the pool is full) past --wait, 76
    /// when a lease was lost (force-unlocked, expired, a claim lost: noticed
    /// within 2s; the command gets SIGTERM, and SIGKILL after --grace).
    // The usage lines are written out: clap's own would show every flag set
    // from the environment (STATEHOUSE_URL, ...) as if it were required.
    #[command(
        arg_required_else_help = true,
        override_usage = "statehouse lock [OPTIONS] [--pool <NAME=LIMIT>]... [STATE_ID] -- <COMMAND>..."
    )]
    Lock(Box<crate::run_lease::LockArgs>),
    /// Wait until a stream's bookmark reaches a value (--stream, --until), or
    /// for the state's next change (--changed), through the gateway's
    /// long-poll: exits 0 then (at once if the value is already reached),
    /// 124 when --timeout ends first, 1 when the gateway refuses (a token, a
    /// scope), when it cannot be reached for 20s in a row (asked again
    /// meanwhile; or until --timeout, if that ends first) or when the command
    /// line is bad.
    #[command(
        arg_required_else_help = true,
        override_usage = "statehouse wait [OPTIONS] <--stream <STREAM> --until <VALUE>|--changed> <STATE_ID>"
    )]
    Wait(Box<crate::waiter::WaitArgs>),
    /// Put every state a glob matches back as it was at an instant (--at: RFC
    /// 3339, or a duration ago such as 2h), through POST /v1/restore: one line
    /// per change and a summary (--json: the gateway's answer); --dry-run
    /// writes nothing. Exits 0, or 1 on any error.
    #[command(arg_required_else_help = true)]
    Restore(Box<crate::restorer::RestoreArgs>),
    /// List the runs recorded under leases, newest first: a table, or JSON
    /// lines with --json; exits 1 when the gateway cannot be reached or refuses.
    Runs(Box<crate::runs_cli::RunsArgs>),
    /// Started by `statehouse lock` to stop its command's process group
    /// should the runner die; not for use by hand.
    #[command(hide = true)]
    LockWatchdog(crate::run_lease::WatchdogArgs),
}

#[derive(Debug, Clone, Args)]
pub struct HealthcheckArgs {
    /// The gateway's listen address (0.0.0.0 and :: are probed on loopback):
    /// a gateway that listens off 127.0.0.1:8080 needs its --listen here too,
    /// or the same STATEHOUSE_LISTEN.
    #[arg(long, env = "STATEHOUSE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// The path to probe.
    #[arg(long, default_value = "/readyz")]
    pub path: String,

    /// How long to wait for the answer.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,

    /// Probe over HTTPS, trusting this PEM CA file for the gateway's
    /// certificate (a gateway with --tls-cert-file serves HTTPS only).
    #[arg(long, env = "STATEHOUSE_HEALTHCHECK_CA_FILE")]
    pub ca_file: Option<std::path::PathBuf>,

    /// A PEM client certificate to present (with --client-key-file); the
    /// health checks need none, even under mTLS, but a client may bring one.
    #[arg(long, env = "STATEHOUSE_HEALTHCHECK_CLIENT_CERT_FILE", requires_all = ["client_key_file", "ca_file"])]
    pub client_cert_file: Option<std::path::PathBuf>,

    /// The key of --client-cert-file.
    #[arg(
        long,
        env = "STATEHOUSE_HEALTHCHECK_CLIENT_KEY_FILE",
        requires = "client_cert_file"
    )]
    pub client_key_file: Option<std::path::PathBuf>,

    /// The name the gateway's certificate must be for, over HTTPS.
    #[arg(
        long,
        env = "STATEHOUSE_HEALTHCHECK_SERVER_NAME",
        default_value = "localhost"
    )]
    pub server_name: String,
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "STATEHOUSE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// ClickHouse URI: clickhouse://user:password@host:port/database (HTTP
    /// interface, port 8123 by default); clickhouses:// for TLS (port 8443).
    /// User and password are percent-decoded. Required.
    #[arg(long, env = "STATEHOUSE_CLICKHOUSE_URL", hide_env_values = true)]
    pub clickhouse_url: Option<String>,

    /// Overrides the host of the ClickHouse URI.
    #[arg(long, env = "STATEHOUSE_CLICKHOUSE_HOST")]
    pub clickhouse_host: Option<String>,

    /// Overrides the port of the ClickHouse URI.
    #[arg(long, env = "STATEHOUSE_CLICKHOUSE_PORT")]
    pub clickhouse_port: Option<u16>,

    /// Overrides the database of the ClickHouse URI (the connection's default
    /// database; the state tables live in --schema).
    #[arg(long, env = "STATEHOUSE_CLICKHOUSE_DATABASE")]
    pub clickhouse_database: Option<String>,

    /// Overrides the user of the ClickHouse URI.
    #[arg(long, env = "STATEHOUSE_CLICKHOUSE_USER")]
    pub clickhouse_user: Option<String>,

    /// Overrides the password of the ClickHouse URI.
    #[arg(long, env = "STATEHOUSE_CLICKHOUSE_PASSWORD", hide_env_values = true)]
    pub clickhouse_password: Option<String>,

    /// PEM file of extra certificate authorities to trust for TLS to ClickHouse
    /// (on top of the system's), e.g. a private CA.
    #[arg(long, env = "STATEHOUSE_CLICKHOUSE_CA_FILE")]
    pub clickhouse_ca_file: Option<std::path::PathBuf>,

    /// Use TLS to ClickHouse (the same as a clickhouses:// URI).
    #[arg(long, env = "STATEHOUSE_CLICKHOUSE_SECURE", num_args = 0..=1, default_missing_value = "true")]
    pub clickhouse_secure: Option<bool>,

    /// ClickHouse database that holds the state tables.
    #[arg(long, env = "STATEHOUSE_SCHEMA", default_value = "meltano")]
    pub schema: String,

    /// Name of the state table (the lease table is `<table>_lease`).
    #[arg(long, env = "STATEHOUSE_TABLE", default_value = "state")]
    pub table: String,

    /// Longest a ClickHouse query may take before the request fails with 503.
    #[arg(long, env = "STATEHOUSE_QUERY_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    pub query_timeout: Duration,

    /// How long to keep retrying an unreachable ClickHouse at start before exiting.
    #[arg(long, env = "STATEHOUSE_STARTUP_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub startup_timeout: Duration,

    /// Largest request body in bytes; one byte more is answered with 413.
    #[arg(long, env = "STATEHOUSE_BODY_LIMIT", default_value_t = 16 * 1024 * 1024)]
    pub body_limit: usize,

    /// How long SIGTERM waits for in-flight requests before exiting anyway.
    #[arg(long, env = "STATEHOUSE_SHUTDOWN_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub shutdown_timeout: Duration,

    /// Requests worked on at once (lock acquires and health checks aside);
    /// one more is answered at once with 503 and Retry-After. With
    /// --body-limit it bounds the memory request bodies can take.
    #[arg(long, env = "STATEHOUSE_MAX_CONCURRENT_REQUESTS", default_value_t = 64)]
    pub max_concurrent_requests: u32,

    /// Lock acquires (POST /v1/locks/{state_id}) in progress at once, waiting
    /// ones included; one more is answered at once with 503 and Retry-After.
    #[arg(long, env = "STATEHOUSE_MAX_LOCK_WAITERS", default_value_t = 1024)]
    pub max_lock_waiters: u32,

    /// Long-polls (GET /v1/states/{state_id}?wait=) waiting at once; they
    /// hold no --max-concurrent-requests permit, so this caps them instead.
    /// One more is answered at once with 503 and Retry-After.
    #[arg(long, env = "STATEHOUSE_MAX_WATCHERS", default_value_t = 1024)]
    pub max_watchers: u32,

    /// The part of --max-concurrent-requests, --max-lock-waiters and --max-watchers that
    /// one token name may hold at once (at least one request); past it that
    /// token gets 429 and Retry-After while the others are served. Without
    /// tokens only the limits apply.
    #[arg(long, env = "STATEHOUSE_MAX_SHARE", default_value_t = 0.5, value_parser = parse_share)]
    pub max_share: f64,

    /// How long a client may take to send a request's headers, from its
    /// first byte; a slower client's connection is closed.
    #[arg(long, env = "STATEHOUSE_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub header_read_timeout: Duration,

    /// How long a client may take to send a whole request body, once the
    /// gateway starts reading it; a slower one gets 408 and the connection is closed.
    #[arg(long, env = "STATEHOUSE_BODY_READ_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub body_read_timeout: Duration,

    /// A connection with no request in progress (a fresh one, or kept alive
    /// after a response) is closed after this long.
    #[arg(long, env = "STATEHOUSE_IDLE_TIMEOUT", default_value = "75s", value_parser = humantime::parse_duration)]
    pub idle_timeout: Duration,

    /// This gateway's id in the lock tables (default: a fresh UUID per start,
    /// so a restarted gateway never mistakes its predecessor's claims for its own).
    #[arg(long, env = "STATEHOUSE_GATEWAY_ID")]
    pub gateway_id: Option<Uuid>,

    /// How long a lock claim candidate settles in ClickHouse before the
    /// earliest one wins; paid once per claim, not per lease.
    #[arg(long, env = "STATEHOUSE_CLAIM_SETTLE", default_value = "1s", value_parser = humantime::parse_duration)]
    pub claim_settle: Duration,

    /// How long a gateway's claim on a state_id outlives its last renewal
    /// (renewed every third of it); a crashed gateway's claims expire after this.
    #[arg(long, env = "STATEHOUSE_CLAIM_TTL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub claim_ttl: Duration,

    /// A claim with no lease, no waiter and no write is released after this
    /// long, so other gateways can take it without waiting for it to expire;
    /// an id written twice within it through one gateway is claimed by that
    /// gateway for its writes.
    #[arg(long, env = "STATEHOUSE_CLAIM_IDLE", default_value = "10s", value_parser = humantime::parse_duration)]
    pub claim_idle: Duration,

    /// The longest lock-delay an acquire may ask for (`lock_delay_seconds`);
    /// a longer one is cut to this, not refused.
    #[arg(long, env = "STATEHOUSE_MAX_LOCK_DELAY", default_value = "60s", value_parser = humantime::parse_duration)]
    pub max_lock_delay: Duration,

    /// How peer gateways reach this one, e.g. http://10.0.0.5:8080: stored
    /// with its claims, so any gateway can forward a state_id's lock
    /// operations to the one holding its claim. Without it this gateway
    /// cannot be forwarded to, and locks through several gateways behind a
    /// load balancer are slow.
    #[arg(long, env = "STATEHOUSE_ADVERTISE_URL")]
    pub advertise_url: Option<String>,

    /// How gateways agree on who holds a state_id's lock claim: table (claim
    /// candidates settle in the lease table; correct only while every gateway
    /// reaches one ClickHouse node) or keeper (claims in KeeperMap tables:
    /// for clusters and ClickHouse Cloud; needs the server's Keeper and its
    /// keeper_map_path_prefix setting). Gateways on one set of tables must agree.
    #[arg(long, env = "STATEHOUSE_COORDINATION", value_enum, default_value_t = Coordination::Table)]
    pub coordination: Coordination,

    /// ClickHouse cluster to create the tables on: every MergeTree table is
    /// made with ON CLUSTER and its Replicated engine, and reads that must see
    /// the latest write ask for select_sequential_consistency. In a database
    /// with the Replicated engine (ClickHouse Cloud) the DDL goes without ON CLUSTER.
    #[arg(long, env = "STATEHOUSE_CLUSTER")]
    pub cluster: Option<String>,

    /// What to do with a write whose bookmark goes backwards (a stream whose
    /// replication_key_value moves back under an unchanged replication_key):
    /// warn (write it, and say so in a header, the log and /metrics), reject
    /// (409 unless the request's Statehouse-Allow-Regression names the
    /// stream) or off.
    #[arg(long, env = "STATEHOUSE_BOOKMARK_REGRESSION", value_enum, default_value_t = GuardMode::Warn)]
    pub bookmark_regression: GuardMode,

    /// What to do with a write that drops a bookmark (a stream, its
    /// replication_key_value or one of its partitions gone from the
    /// effective state, or the whole state emptied): warn (write it, and
    /// say so in a header, the log and /metrics), reject (409 unless the
    /// request's Statehouse-Allow-Loss names the stream) or off.
    #[arg(long, env = "STATEHOUSE_BOOKMARK_LOSS", value_enum, default_value_t = GuardMode::Warn)]
    pub bookmark_loss: GuardMode,

    /// Keep a version of every change made through the gateway in
    /// `<table>_history` (see --history-retention); false records none, and
    /// the history endpoints answer 404 saying so.
    #[arg(long, env = "STATEHOUSE_HISTORY", num_args = 0..=1, default_missing_value = "true", default_value = "true")]
    pub history: bool,

    /// How long history keeps a version (a ClickHouse TTL on the history
    /// table), e.g. 90d or 12h; 0 keeps every version forever.
    #[arg(long, env = "STATEHOUSE_HISTORY_RETENTION", default_value = "90d", value_parser = humantime::parse_duration)]
    pub history_retention: Duration,

    /// How long a change feed cursor (GET /v1/changes) stays good, and so
    /// how long `<table>_changes` keeps a change (a TTL, plus a minute); an
    /// older cursor is answered 410 cursor-expired, e.g. 1h or 30m.
    #[arg(long, env = "STATEHOUSE_WATCH_RETENTION", default_value = "1h", value_parser = parse_watch_retention)]
    pub watch_retention: Duration,

    /// File of bearer tokens, one `<role> <token> [<name>] [scope=<glob>,...]
    /// [expires=<RFC 3339>]` per line (role: read, write or admin; `<role>
    /// sha256:<hex>` keeps the token itself off disk; the name is who history
    /// says made a change; scope limits the state_ids it may name). Read
    /// again on SIGHUP and when it changes.
    #[arg(long, env = "STATEHOUSE_TOKENS_FILE")]
    pub tokens_file: Option<std::path::PathBuf>,

    /// JSON file of JWT issuers whose tokens the gateway accepts (workload
    /// identity: Kubernetes service accounts, GitHub Actions, GitLab CI),
    /// each with its key set, audience and bindings of claims to a role, a
    /// scope and a name; see "Workload identity" in docs/operations.md.
    /// Read again on SIGHUP.
    #[arg(long, env = "STATEHOUSE_JWT_ISSUERS")]
    pub jwt_issuers: Option<std::path::PathBuf>,

    /// How often an issuer's key set is fetched again.
    #[arg(long, env = "STATEHOUSE_JWT_KEYS_REFRESH", default_value = "5m", value_parser = humantime::parse_duration, hide = true)]
    pub jwt_keys_refresh: Duration,

    /// The least time between two fetches of one issuer's key set (for an
    /// unknown kid, or while it has never answered). Tests shorten it.
    #[arg(long, env = "STATEHOUSE_JWT_KEYS_MIN_GAP", default_value = "30s", value_parser = humantime::parse_duration, hide = true)]
    pub jwt_keys_min_gap: Duration,

    /// Bearer tokens as `<role> <token>` entries separated by commas.
    #[arg(long, env = "STATEHOUSE_TOKENS", hide_env_values = true)]
    pub tokens: Option<String>,

    /// Require a read token for /metrics too.
    #[arg(long, env = "STATEHOUSE_PROTECT_METRICS", num_args = 0..=1, default_missing_value = "true", default_value = "false")]
    pub protect_metrics: bool,

    /// Serve a --listen address beyond loopback without tokens, to anyone
    /// who reaches it; without this, such a start is refused (exit 2).
    #[arg(long, env = "STATEHOUSE_ALLOW_UNAUTHENTICATED", num_args = 0..=1, default_missing_value = "true", default_value = "false")]
    pub allow_unauthenticated: bool,

    /// Log format: text for people, json for log pipelines.
    #[arg(long, env = "STATEHOUSE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// PEM certificate chain (the gateway's certificate first): with
    /// --tls-key-file the gateway serves HTTPS only. SIGHUP reads both again.
    #[arg(long, env = "STATEHOUSE_TLS_CERT_FILE", requires = "tls_key_file")]
    pub tls_cert_file: Option<std::path::PathBuf>,

    /// PEM private key of --tls-cert-file.
    #[arg(long, env = "STATEHOUSE_TLS_KEY_FILE", requires = "tls_cert_file")]
    pub tls_key_file: Option<std::path::PathBuf>,

    /// PEM CA file: clients must present a certificate signed by it (mTLS)
    /// for everything but /healthz, /readyz and the dashboard page.
    #[arg(
        long,
        env = "STATEHOUSE_TLS_CLIENT_CA_FILE",
        requires = "tls_cert_file"
    )]
    pub tls_client_ca_file: Option<std::path::PathBuf>,

    /// PEM CA file that peer gateways' certificates must chain to, for
    /// https:// advertise URLs (default: the system's CAs).
    #[arg(long, env = "STATEHOUSE_PEER_CA_FILE")]
    pub peer_ca_file: Option<std::path::PathBuf>,
}

/// `serve`'s arguments alone, for [`super::Config::from_serve_args`].
#[derive(Parser)]
pub(super) struct ServeOnly {
    #[command(flatten)]
    pub(super) args: ServeArgs,
}

/// A watch retention: a duration of at least a second (a TTL is whole seconds).
fn parse_watch_retention(raw: &str) -> Result<Duration, String> {
    match humantime::parse_duration(raw) {
        Ok(retention) if retention >= Duration::from_secs(1) => Ok(retention),
        Ok(_) => Err(format!("{raw:?} is shorter than a second")),
        Err(err) => Err(format!(
            "{raw:?} is not a duration ({err}), such as 1h or 30m"
        )),
    }
}

/// A share of a limit: a number above 0 and at most 1.
fn parse_share(raw: &str) -> Result<f64, String> {
    match raw.parse::<f64>() {
        Ok(share) if share > 0.0 && share <= 1.0 => Ok(share),
        _ => Err(format!(
            "{raw:?} is not a share: give a number above 0 and at most 1, such as 0.5"
        )),
    }
}
