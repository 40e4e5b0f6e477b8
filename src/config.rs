//! Command line and environment: every setting has a flag and a `STATEHOUSE_*` variable.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use percent_encoding::percent_decode_str;
use rustls::pki_types::CertificateDer;
use url::Url;
use uuid::Uuid;

use crate::auth::{TokenError, Tokens};
pub use crate::domain::{Coordination, RegressionMode};
pub use crate::store::{ClickHouseTarget, ClusterName, History, Identifier};
pub use crate::telemetry::LogFormat;
use crate::tls::{ServerTls, TlsError};

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
    /// runs of one pipeline overlap: exits with the command's status, 75
    /// when another holds the lock past --wait, 76 when the lease was lost.
    #[command(arg_required_else_help = true)]
    Lock(Box<crate::run_lease::LockArgs>),
    /// Started by `statehouse lock` to stop its command's process group
    /// should the runner die; not for use by hand.
    #[command(hide = true)]
    LockWatchdog(crate::run_lease::WatchdogArgs),
}

#[derive(Debug, Clone, Args)]
pub struct HealthcheckArgs {
    /// The gateway's listen address (0.0.0.0 and :: are probed on loopback).
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

    /// A claim with no lease and no waiter is released after this long, so
    /// other gateways can take it without waiting for it to expire.
    #[arg(long, env = "STATEHOUSE_CLAIM_IDLE", default_value = "10s", value_parser = humantime::parse_duration)]
    pub claim_idle: Duration,

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
    #[arg(long, env = "STATEHOUSE_BOOKMARK_REGRESSION", value_enum, default_value_t = RegressionMode::Warn)]
    pub bookmark_regression: RegressionMode,

    /// Keep a version of every change made through the gateway in
    /// `<table>_history` (see --history-retention); false records none, and
    /// the history endpoints answer 404 saying so.
    #[arg(long, env = "STATEHOUSE_HISTORY", num_args = 0..=1, default_missing_value = "true", default_value = "true")]
    pub history: bool,

    /// How long history keeps a version (a ClickHouse TTL on the history
    /// table), e.g. 90d or 12h; 0 keeps every version forever.
    #[arg(long, env = "STATEHOUSE_HISTORY_RETENTION", default_value = "90d", value_parser = humantime::parse_duration)]
    pub history_retention: Duration,

    /// File of bearer tokens, one `<role> <token> [<name>]` per line (role:
    /// read, write or admin; `<role> sha256:<hex>` keeps the token itself off
    /// disk; the name is who history says made a change).
    #[arg(long, env = "STATEHOUSE_TOKENS_FILE")]
    pub tokens_file: Option<std::path::PathBuf>,

    /// Bearer tokens as `<role> <token>` entries separated by commas.
    #[arg(long, env = "STATEHOUSE_TOKENS", hide_env_values = true)]
    pub tokens: Option<String>,

    /// Require a read token for /metrics too.
    #[arg(long, env = "STATEHOUSE_PROTECT_METRICS", num_args = 0..=1, default_missing_value = "true", default_value = "false")]
    pub protect_metrics: bool,

    /// Without tokens the gateway serves on loopback only; this serves on
    /// --listen as given, unauthenticated.
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

/// How this gateway takes part in the lock protocol (see `locks`).
#[derive(Clone, Debug)]
pub struct LockSettings {
    pub gateway_id: Uuid,
    /// How long a claim candidate waits before checking whether it is the earliest.
    pub settle: Duration,
    /// How long a claim lives without renewal; renewed every third of it.
    pub claim_ttl: Duration,
    /// A claim with no lease and no waiter for this long is released.
    pub claim_idle: Duration,
    /// How peer gateways reach this one (`http://host:port` or
    /// `https://host:port`), stored with its claims so they can forward to it.
    pub advertise_url: Option<String>,
    /// Where claims are kept and how they are won.
    pub coordination: Coordination,
    /// How this gateway checks `https://` peers, and the certificate it
    /// shows them when they ask for one.
    pub peer_tls: Arc<rustls::ClientConfig>,
}

/// How much work the gateway takes on at once; beyond it, requests are shed.
#[derive(Clone, Copy, Debug)]
pub struct Concurrency {
    pub requests: u32,
    pub lock_waiters: u32,
}

/// How long a client may take over each part of its request.
#[derive(Clone, Copy, Debug)]
pub struct ClientTimeouts {
    pub header_read: Duration,
    pub body_read: Duration,
    pub idle: Duration,
}

/// Everything `serve` needs, validated.
#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    pub clickhouse: ClickHouseTarget,
    pub schema: Identifier,
    pub table: Identifier,
    /// `--cluster`: ON CLUSTER and Replicated engines (see `store::Placement`).
    pub cluster: Option<ClusterName>,
    pub query_timeout: Duration,
    pub startup_timeout: Duration,
    pub body_limit: usize,
    pub shutdown_timeout: Duration,
    pub concurrency: Concurrency,
    pub client_timeouts: ClientTimeouts,
    pub log_format: LogFormat,
    pub locks: LockSettings,
    pub history: History,
    pub bookmark_regression: RegressionMode,
    pub tokens: Tokens,
    pub protect_metrics: bool,
    pub allow_unauthenticated: bool,
    /// HTTPS, when a certificate and key are configured.
    pub tls: Option<ServerTls>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "no ClickHouse URL: set --clickhouse-url or STATEHOUSE_CLICKHOUSE_URL (clickhouse://user:password@host:8123/database)"
    )]
    MissingUrl,
    #[error("invalid ClickHouse URL: {0}")]
    InvalidUrl(String),
    #[error("invalid --advertise-url / STATEHOUSE_ADVERTISE_URL {0}")]
    AdvertiseUrl(String),
    #[error(
        "invalid {what} {value:?}: use letters, digits and underscores, starting with a letter or underscore"
    )]
    Identifier { what: String, value: String },
    #[error(
        "invalid --cluster / STATEHOUSE_CLUSTER {0:?}: use the cluster's name as in system.clusters (letters, digits, _ - . and macros such as {{cluster}})"
    )]
    Cluster(String),
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
    #[error("--claim-ttl must be at least 300ms")]
    ClaimTtl,
    #[error("cannot use the CA file {path}: {reason}")]
    CaFile { path: String, reason: String },
    #[error("cannot read the tokens file {path}: {source}")]
    TokensFile {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid token entry: {0}")]
    Token(#[from] TokenError),
    #[error(
        "{0}; set --tls-cert-file and --tls-key-file (STATEHOUSE_TLS_CERT_FILE, STATEHOUSE_TLS_KEY_FILE) to a PEM chain and its key"
    )]
    Tls(#[from] TlsError),
}

impl TryFrom<ServeArgs> for Config {
    type Error = ConfigError;

    fn try_from(args: ServeArgs) -> Result<Self, ConfigError> {
        let raw = args
            .clickhouse_url
            .as_deref()
            .ok_or(ConfigError::MissingUrl)?;
        let mut target = parse_clickhouse_url(raw)?;
        if let Some(host) = args.clickhouse_host {
            target.host = host;
        }
        if let Some(secure) = args.clickhouse_secure {
            if args.clickhouse_port.is_none() && target.port == default_port(target.secure) {
                target.port = default_port(secure);
            }
            target.secure = secure;
        }
        if let Some(port) = args.clickhouse_port {
            target.port = port;
        }
        if let Some(database) = args.clickhouse_database {
            target.database = database;
        }
        if let Some(user) = args.clickhouse_user {
            target.user = user;
        }
        if let Some(password) = args.clickhouse_password {
            target.password = password;
        }
        if let Some(path) = &args.clickhouse_ca_file {
            target.extra_roots = read_ca_file(path)?;
        }
        if args.query_timeout.is_zero() {
            return Err(ConfigError::Zero("--query-timeout"));
        }
        if args.body_limit == 0 {
            return Err(ConfigError::Zero("--body-limit"));
        }
        for (value, flag) in [
            (args.max_concurrent_requests, "--max-concurrent-requests"),
            (args.max_lock_waiters, "--max-lock-waiters"),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero(flag));
            }
        }
        for (value, flag) in [
            (args.header_read_timeout, "--header-read-timeout"),
            (args.body_read_timeout, "--body-read-timeout"),
            (args.idle_timeout, "--idle-timeout"),
        ] {
            if value.is_zero() {
                return Err(ConfigError::Zero(flag));
            }
        }
        if args.claim_ttl < Duration::from_millis(300) {
            return Err(ConfigError::ClaimTtl);
        }
        let mut tokens = Tokens::default();
        if let Some(path) = &args.tokens_file {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::TokensFile {
                path: path.display().to_string(),
                source,
            })?;
            tokens.add(&path.display().to_string(), &text, '\n')?;
        }
        if let Some(text) = &args.tokens {
            tokens.add("STATEHOUSE_TOKENS", text, ',')?;
        }
        let tls = match (&args.tls_cert_file, &args.tls_key_file) {
            (Some(cert), Some(key)) => Some(ServerTls::new(
                cert,
                key,
                args.tls_client_ca_file.as_deref(),
            )?),
            _ => None,
        };
        let peer_roots = args.peer_ca_file.as_deref().map(read_ca_file).transpose()?;
        let peer_tls = crate::tls::peer_client_config(
            peer_roots.as_deref(),
            tls.as_ref().map(|tls| tls.identity.clone()),
        );
        Ok(Self {
            listen: args.listen,
            clickhouse: target,
            schema: identifier("schema", &args.schema)?,
            table: identifier("table", &args.table)?,
            cluster: args
                .cluster
                .as_deref()
                .map(|raw| ClusterName::parse(raw).map_err(|e| ConfigError::Cluster(e.0)))
                .transpose()?,
            query_timeout: args.query_timeout,
            startup_timeout: args.startup_timeout,
            body_limit: args.body_limit,
            shutdown_timeout: args.shutdown_timeout,
            concurrency: Concurrency {
                requests: args.max_concurrent_requests,
                lock_waiters: args.max_lock_waiters,
            },
            client_timeouts: ClientTimeouts {
                header_read: args.header_read_timeout,
                body_read: args.body_read_timeout,
                idle: args.idle_timeout,
            },
            log_format: args.log_format,
            locks: LockSettings {
                gateway_id: args.gateway_id.unwrap_or_else(Uuid::new_v4),
                settle: args.claim_settle,
                claim_ttl: args.claim_ttl,
                claim_idle: args.claim_idle,
                advertise_url: args
                    .advertise_url
                    .as_deref()
                    .map(parse_advertise_url)
                    .transpose()?,
                coordination: args.coordination,
                peer_tls,
            },
            history: match (args.history, args.history_retention) {
                (false, _) => History::Off,
                (true, Duration::ZERO) => History::Kept(None),
                (true, retention) => History::Kept(Some(retention)),
            },
            bookmark_regression: args.bookmark_regression,
            tokens,
            protect_metrics: args.protect_metrics,
            allow_unauthenticated: args.allow_unauthenticated,
            tls,
        })
    }
}

/// `serve`'s arguments alone, for [`Config::from_serve_args`].
#[derive(Parser)]
struct ServeOnly {
    #[command(flatten)]
    args: ServeArgs,
}

impl Config {
    /// The configuration `statehouse serve ARGS...` would run with, flags
    /// and environment included: how tests and benches get the real defaults.
    pub fn from_serve_args(args: &[&str]) -> Result<Self, Box<dyn std::error::Error>> {
        let argv = ["statehouse serve"].into_iter().chain(args.iter().copied());
        Ok(Self::try_from(ServeOnly::try_parse_from(argv)?.args)?)
    }
}

fn read_ca_file(path: &std::path::Path) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let fail = |reason: String| ConfigError::CaFile {
        path: path.display().to_string(),
        reason,
    };
    crate::tls::read_certificates(path).map_err(fail)
}

fn identifier(what: &str, raw: &str) -> Result<Identifier, ConfigError> {
    Identifier::parse(raw).map_err(|_| ConfigError::Identifier {
        what: what.to_owned(),
        value: raw.to_owned(),
    })
}

/// An `http://` or `https://` base URL peers can reach; no path, query or credentials.
fn parse_advertise_url(raw: &str) -> Result<String, ConfigError> {
    let bad = |why: &str| ConfigError::AdvertiseUrl(format!("{raw:?}: {why}"));
    let url = Url::parse(raw).map_err(|e| bad(&e.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(bad(
            "peers speak HTTP or HTTPS to each other: use http:// or https://",
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(bad("it needs a host"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(bad("it must not carry credentials"));
    }
    if url.path() != "/" || url.query().is_some() || url.fragment().is_some() {
        return Err(bad("it must be a base URL, without a path or query"));
    }
    Ok(url.as_str().trim_end_matches('/').to_owned())
}

fn default_port(secure: bool) -> u16 {
    if secure { 8443 } else { 8123 }
}

/// Parses the seed plugin's URI form; http(s):// is taken too, for people who
/// paste ClickHouse's own HTTP address.
pub fn parse_clickhouse_url(raw: &str) -> Result<ClickHouseTarget, ConfigError> {
    let invalid = |why: &str| {
        ConfigError::InvalidUrl(format!(
            "{why} (expected clickhouse://user:password@host:8123/database)"
        ))
    };
    let url = Url::parse(raw).map_err(|e| invalid(&e.to_string()))?;
    let secure = match url.scheme() {
        "clickhouse" | "http" => false,
        "clickhouses" | "https" => true,
        other => return Err(invalid(&format!("unsupported scheme {other:?}"))),
    };
    let host = url
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| invalid("no host"))?
        .to_owned();
    let decode = |part: &str| {
        percent_decode_str(part)
            .decode_utf8()
            .map(|s| s.into_owned())
            .map_err(|_| invalid("user or password is not valid UTF-8 once percent-decoded"))
    };
    let user = match url.username() {
        "" => "default".to_owned(),
        u => decode(u)?,
    };
    let password = decode(url.password().unwrap_or(""))?;
    let database = match url.path().trim_start_matches('/') {
        "" => "default".to_owned(),
        db if db.contains('/') => return Err(invalid("the path must be a single database name")),
        db => decode(db)?,
    };
    Ok(ClickHouseTarget {
        secure,
        port: url.port().unwrap_or(default_port(secure)),
        host,
        database,
        user,
        password,
        extra_roots: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> ServeArgs {
        let argv = ["statehouse serve"]
            .into_iter()
            .chain(extra.iter().copied());
        ServeOnly::try_parse_from(argv).unwrap().args
    }

    #[test]
    fn parses_the_seed_uri_form_with_percent_encoded_credentials() {
        let t = parse_clickhouse_url("clickhouse://us%3Aer:p%40ss%2Fw@ch.example:9000/analytics")
            .unwrap();
        assert_eq!(
            t,
            ClickHouseTarget {
                secure: false,
                host: "ch.example".into(),
                port: 9000,
                database: "analytics".into(),
                user: "us:er".into(),
                password: "p@ss/w".into(),
                extra_roots: Vec::new(),
            }
        );
    }

    #[test]
    fn defaults_port_user_and_database_and_knows_tls() {
        let t = parse_clickhouse_url("clickhouse://localhost").unwrap();
        assert_eq!(
            (t.port, t.user.as_str(), t.database.as_str()),
            (8123, "default", "default")
        );
        let t = parse_clickhouse_url("clickhouses://h/db").unwrap();
        assert!(t.secure);
        assert_eq!(t.endpoint(), "https://h:8443");
    }

    #[test]
    fn rejects_malformed_uris() {
        for raw in [
            "",
            "localhost:8123",
            "postgres://h/db",
            "clickhouse:///db",
            "clickhouse://h/a/b",
        ] {
            assert!(parse_clickhouse_url(raw).is_err(), "{raw}");
        }
    }

    #[test]
    fn each_part_has_its_own_override() {
        let cfg = Config::try_from(args(&[
            "--clickhouse-url=clickhouse://u:p@h:1/d",
            "--clickhouse-host=h2",
            "--clickhouse-port=2",
            "--clickhouse-database=d2",
            "--clickhouse-user=u2",
            "--clickhouse-password=p2",
        ]))
        .unwrap();
        assert_eq!(cfg.clickhouse.endpoint(), "http://h2:2");
        assert_eq!(cfg.clickhouse.database, "d2");
        assert_eq!(
            (
                cfg.clickhouse.user.as_str(),
                cfg.clickhouse.password.as_str()
            ),
            ("u2", "p2")
        );
    }

    #[test]
    fn secure_flag_moves_the_default_port_only() {
        let cfg = Config::try_from(args(&[
            "--clickhouse-url=clickhouse://h",
            "--clickhouse-secure",
        ]))
        .unwrap();
        assert_eq!(cfg.clickhouse.endpoint(), "https://h:8443");
        let cfg = Config::try_from(args(&[
            "--clickhouse-url=clickhouse://h:9999",
            "--clickhouse-secure=true",
        ]))
        .unwrap();
        assert_eq!(cfg.clickhouse.endpoint(), "https://h:9999");
    }

    #[test]
    fn missing_url_and_bad_identifiers_are_errors() {
        assert!(matches!(
            Config::try_from(args(&[])),
            Err(ConfigError::MissingUrl)
        ));
        for bad in [
            "--schema=me-ltano",
            "--table=1state",
            "--table=a;b",
            "--schema=",
        ] {
            let result = Config::try_from(args(&["--clickhouse-url=clickhouse://h", bad]));
            assert!(
                matches!(result, Err(ConfigError::Identifier { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn defaults_follow_the_contract() {
        let cfg = Config::try_from(args(&["--clickhouse-url=clickhouse://h"])).unwrap();
        assert_eq!(cfg.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(
            (cfg.schema.as_str(), cfg.table.as_str()),
            ("meltano", "state")
        );
        assert_eq!(cfg.body_limit, 16_777_216);
    }

    #[test]
    fn coordination_is_table_and_no_cluster_unless_asked() {
        use clap::CommandFactory;
        // Read from the flags' definitions, not a parse: the environment may
        // set STATEHOUSE_COORDINATION for a whole test run.
        let command = ServeOnly::command();
        let default_of = |id: &str| {
            command
                .get_arguments()
                .find(|arg| arg.get_id() == id)
                .map(|arg| arg.get_default_values().to_vec())
                .unwrap()
        };
        assert_eq!(default_of("coordination"), ["table"]);
        assert!(default_of("cluster").is_empty());
        let cfg = Config::try_from(args(&[
            "--clickhouse-url=clickhouse://h",
            "--coordination=keeper",
            "--cluster={cluster}",
        ]))
        .unwrap();
        assert_eq!(cfg.locks.coordination, Coordination::Keeper);
        assert_eq!(cfg.cluster.unwrap().as_str(), "{cluster}");
        let cfg = Config::try_from(args(&[
            "--clickhouse-url=clickhouse://h",
            "--coordination",
            "table",
        ]))
        .unwrap();
        assert_eq!(cfg.locks.coordination, Coordination::Table);
    }

    #[test]
    fn bad_coordination_and_cluster_values_are_errors() {
        let argv = ["statehouse serve", "--coordination=zookeeper"];
        assert!(ServeOnly::try_parse_from(argv).is_err());
        for bad in ["--cluster=a b", "--cluster=x'y", "--cluster="] {
            let result = Config::try_from(args(&["--clickhouse-url=clickhouse://h", bad]));
            assert!(matches!(result, Err(ConfigError::Cluster(_))), "{bad}");
        }
    }

    #[test]
    fn limits_and_client_timeouts_must_be_positive() {
        for zero in [
            "--max-concurrent-requests=0",
            "--max-lock-waiters=0",
            "--header-read-timeout=0s",
            "--body-read-timeout=0s",
            "--idle-timeout=0s",
        ] {
            let result = Config::try_from(args(&["--clickhouse-url=clickhouse://h", zero]));
            assert!(matches!(result, Err(ConfigError::Zero(_))), "{zero}");
        }
        let cfg = Config::try_from(args(&[
            "--clickhouse-url=clickhouse://h",
            "--max-concurrent-requests=3",
            "--idle-timeout=2s",
        ]))
        .unwrap();
        assert_eq!(cfg.concurrency.requests, 3);
        assert_eq!(cfg.client_timeouts.idle, Duration::from_secs(2));
    }

    #[test]
    fn advertise_urls_are_http_or_https_base_urls() {
        assert_eq!(
            parse_advertise_url("https://gw-a.internal:8080/").unwrap(),
            "https://gw-a.internal:8080"
        );
        assert_eq!(
            parse_advertise_url("http://10.0.0.5:8080").unwrap(),
            "http://10.0.0.5:8080"
        );
        for bad in ["ftp://h:1", "https://h:1/path", "https://u:p@h:1"] {
            assert!(parse_advertise_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tls_takes_a_certificate_and_a_key_together_and_names_a_file_that_does_not_load() {
        let url = "--clickhouse-url=clickhouse://h";
        let lone = ServeOnly::try_parse_from(["statehouse serve", url, "--tls-cert-file=c.pem"]);
        assert!(lone.is_err(), "a certificate without its key");
        let err = Config::try_from(args(&[
            url,
            "--tls-cert-file=/nonexistent/c.pem",
            "--tls-key-file=/nonexistent/k.pem",
        ]))
        .unwrap_err()
        .to_string();
        assert!(err.contains("/nonexistent/c.pem"), "{err}");
        assert!(err.contains("--tls-cert-file"), "{err}");
        assert!(Config::try_from(args(&[url])).unwrap().tls.is_none());
    }
}
