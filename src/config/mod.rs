//! Command line and environment: every setting has a flag and a `STATEHOUSE_*` variable.
//! This file checks `serve`'s flags into the [`Config`] the gateway runs with; the
//! flags themselves are in `cli`, the URLs' parsing in `urls`.

mod cli;
mod error;
mod urls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use rustls::pki_types::CertificateDer;
use uuid::Uuid;

pub use cli::{Cli, Command, HealthcheckArgs, ServeArgs};
pub use error::ConfigError;
pub use urls::parse_clickhouse_url;

use self::cli::ServeOnly;
use self::urls::{default_port, parse_advertise_url};
use crate::auth::{TokenSources, Tokens};
pub use crate::domain::{Coordination, GuardMode};
pub use crate::store::{ClickHouseTarget, ClusterName, History, Identifier};
pub use crate::telemetry::LogFormat;
use crate::tls::ServerTls;

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
    /// The longest lock-delay a lease may carry (`--max-lock-delay`).
    pub max_lock_delay: Duration,
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
    /// Long-polls waiting at once (`--max-watchers`).
    pub watchers: u32,
    /// The part of each limit one token name may hold, in (0, 1].
    pub max_share: f64,
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
    /// How long a change feed cursor stays good (`--watch-retention`).
    pub watch_retention: Duration,
    pub bookmark_regression: GuardMode,
    pub bookmark_loss: GuardMode,
    pub tokens: Tokens,
    /// What a reload (SIGHUP, a change of the file) reads the tokens from.
    pub token_sources: TokenSources,
    pub protect_metrics: bool,
    /// HTTPS, when a certificate and key are configured.
    pub tls: Option<ServerTls>,
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
            (args.max_watchers, "--max-watchers"),
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
        let token_sources = TokenSources {
            file: args.tokens_file.clone(),
            inline: args.tokens.clone(),
        };
        let tokens = token_sources.load()?;
        // Without tokens anyone who reaches the port can write state, so an
        // address beyond loopback needs --allow-unauthenticated to say that
        // is meant. Refused, not narrowed to loopback: that left a container
        // healthy on loopback and closed to every client.
        if tokens.is_empty() && !args.listen.ip().is_loopback() && !args.allow_unauthenticated {
            return Err(ConfigError::Unauthenticated(args.listen));
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
                watchers: args.max_watchers,
                max_share: args.max_share,
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
                max_lock_delay: args.max_lock_delay,
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
            watch_retention: args.watch_retention,
            bookmark_regression: args.bookmark_regression,
            bookmark_loss: args.bookmark_loss,
            tokens,
            token_sources,
            protect_metrics: args.protect_metrics,
            tls,
        })
    }
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
    fn an_address_beyond_loopback_needs_tokens_or_allow_unauthenticated() {
        let url = "--clickhouse-url=clickhouse://h";
        for open in [
            "--listen=0.0.0.0:8080",
            "--listen=[::]:8080",
            "--listen=10.0.0.5:80",
        ] {
            let err = Config::try_from(args(&[url, open])).unwrap_err();
            assert!(matches!(err, ConfigError::Unauthenticated(_)), "{open}");
            assert_eq!(err.exit_status(), 2);
            let line = err.to_string();
            assert!(line.contains("--tokens-file") && line.contains("--allow-unauthenticated"));
            let allowed = Config::try_from(args(&[url, open, "--allow-unauthenticated"])).unwrap();
            assert_eq!(
                allowed.listen.to_string(),
                open.trim_start_matches("--listen=")
            );
            let with_tokens =
                Config::try_from(args(&[url, open, "--tokens=write writer-token-0123456789"]))
                    .unwrap();
            assert!(!with_tokens.tokens.is_empty(), "{open}");
        }
        for loopback in ["--listen=127.0.0.1:8080", "--listen=[::1]:8080"] {
            assert!(
                Config::try_from(args(&[url, loopback])).is_ok(),
                "{loopback}"
            );
        }
        assert_eq!(ConfigError::MissingUrl.exit_status(), 1);
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
