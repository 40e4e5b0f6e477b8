//! statehouse: an HTTP gateway that keeps Meltano pipeline state in ClickHouse.
//!
//! A request goes `http` (routes, extractors, errors) → `states` (the API's
//! rules, per-id write serialization) or `locks` (claims and leases) →
//! `store` (ClickHouse tables).

pub mod agreement;
pub mod auth;
pub mod client;
pub mod config;
pub mod domain;
pub mod hangup;
pub mod healthcheck;
pub mod http;
mod keyed_mutex;
pub mod locks;
pub mod metrics;
pub mod restorer;
mod retry;
pub mod run_lease;
pub mod runs;
pub mod runs_cli;
pub mod states;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod traces;
pub mod waiter;
mod worker;

pub use http::AppContext;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

use crate::agreement::{Disagreement, Registration};
use crate::auth::TokenSources;
use crate::auth::live::LiveTokens;
use crate::config::{ClientTimeouts, Config};
use crate::domain::GuardModes;
use crate::hangup::Hangups;
use crate::http::{Admission, OwnHosts, Readiness};
use crate::locks::LockManager;
use crate::metrics::Metrics;
use crate::states::States;
use crate::store::{Blocker, ClickHouse, Layout, Store, StoreError};
use crate::tls::ServerTls;

/// How long the spans still queued at shutdown may take to reach the collector.
const TRACES_FLUSH: Duration = Duration::from_secs(5);

/// Why the gateway did not start; each says what to change.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("ClickHouse at {endpoint} not usable after {waited:?}: {source}")]
    ClickHouse {
        endpoint: String,
        waited: Duration,
        source: StoreError,
    },
    #[error(
        "ClickHouse at {endpoint} refused user {user:?}, wrong user or password: {source}; set the password with --clickhouse-password or STATEHOUSE_CLICKHOUSE_PASSWORD (the user with --clickhouse-user, or both in --clickhouse-url)"
    )]
    Credentials {
        endpoint: String,
        user: String,
        source: StoreError,
    },
    #[error(
        "ClickHouse user {user:?} may not create the gateway's database or tables: {source}; grant what ClickHouse names (the gateway needs CREATE DATABASE, CREATE TABLE, SELECT, INSERT and ALTER DELETE on {schema}.*), have an administrator create them, or use databases the user has: --schema (STATEHOUSE_SCHEMA) and the database in --clickhouse-url"
    )]
    Permission {
        user: String,
        schema: String,
        source: StoreError,
    },
    #[error(
        "ClickHouse at {endpoint} presented a TLS certificate the gateway does not trust: {source}; pass the CA that signed it with --clickhouse-ca-file or STATEHOUSE_CLICKHOUSE_CA_FILE, and name the host the certificate is for in --clickhouse-url"
    )]
    UntrustedCertificate {
        endpoint: String,
        source: StoreError,
    },
    #[error(
        "{endpoint} does not speak ClickHouse's HTTP interface: {source}; point --clickhouse-url (STATEHOUSE_CLICKHOUSE_URL) at ClickHouse's HTTP port (clickhouse://host:8123, or clickhouses://host:8443 for TLS), not the native port 9000 or another service"
    )]
    NotClickHouse {
        endpoint: String,
        source: StoreError,
    },
    #[error(
        "ClickHouse at {endpoint} cannot keep lock claims for --coordination keeper, the server setting {setting} is missing: {source}; ask its administrator to set {setting} in the server's config (KeeperMap needs both <zookeeper> or <keeper>, naming a reachable ClickHouse Keeper or ZooKeeper, and keeper_map_path_prefix), or use --coordination table (STATEHOUSE_COORDINATION) with a single ClickHouse node"
    )]
    Keeper {
        endpoint: String,
        setting: &'static str,
        source: StoreError,
    },
    #[error(
        "ClickHouse at {endpoint} did not reach its Keeper for --coordination keeper within {waited:?}: {source}; check the server setting <zookeeper> (the ClickHouse Keeper or ZooKeeper nodes it names must be up and reachable from ClickHouse), or use --coordination table (STATEHOUSE_COORDINATION) with a single ClickHouse node"
    )]
    KeeperUnreachable {
        endpoint: String,
        waited: Duration,
        source: StoreError,
    },
    #[error("tables {tables} at {endpoint}: {source}")]
    Coordination {
        endpoint: String,
        tables: String,
        source: Disagreement,
    },
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// A gateway that has reached ClickHouse, created its tables and bound its
/// port, but does not serve yet.
pub struct App {
    listener: TcpListener,
    ctx: AppContext,
    /// None for a user that may not write (see [`Registration::join`]).
    registration: Option<Registration>,
    client_timeouts: ClientTimeouts,
    shutdown_timeout: Duration,
    tls: Option<ServerTls>,
    token_sources: TokenSources,
    /// SIGHUP, taken over when the gateway is built: it is ready (and says
    /// so) before it serves, and a SIGHUP from then on must not end it.
    hangups: Hangups,
}

impl App {
    pub async fn build(config: &Config) -> Result<Self, StartError> {
        let metrics = Arc::new(Metrics::default());
        let clickhouse = ClickHouse::new(&config.clickhouse, config.query_timeout, metrics.clone());
        let store = Store::with_layout(
            clickhouse.clone(),
            config.schema.clone(),
            &config.table,
            config.history,
            Layout {
                coordination: config.locks.coordination,
                cluster: config.cluster.clone(),
                watch_retention: config.watch_retention,
            },
        );
        prepare_clickhouse(&store, config).await?;
        // One lock core for state_ids, one for pools, over tables of their own.
        let lock_core = |leases, claims| {
            Arc::new(LockManager::new(
                config.locks.clone(),
                config.query_timeout,
                leases,
                claims,
                metrics.clone(),
            ))
        };
        let locks = lock_core(store.leases, store.claims);
        let pools = lock_core(store.pool_leases, store.pool_claims);
        match &config.locks.advertise_url {
            Some(url) => {
                tracing::info!(advertise_url = %url, "peers forward lock operations to this gateway")
            }
            None => tracing::info!(
                "no --advertise-url: other gateways cannot forward to this one, so its locks are served only by it; give every gateway behind one load balancer its URL"
            ),
        }
        log_authentication(config);
        let listener = http::bind(config.listen).map_err(|source| StartError::Listen {
            addr: config.listen,
            source,
        })?;
        // Last, so that no record is left by a start that fails after it.
        let registration = Registration::join(
            store.gateways.clone(),
            config.locks.gateway_id,
            config.locks.coordination,
        )
        .await
        .map_err(|source| StartError::Coordination {
            endpoint: config.clickhouse.endpoint(),
            tables: format!("{}.{}", config.schema.as_str(), config.table.as_str()),
            source,
        })?;
        Ok(Self {
            listener,
            registration,
            ctx: AppContext {
                states: Arc::new(States::new(
                    store.states,
                    store.journal.clone(),
                    store.changes,
                    locks.clone(),
                    metrics.clone(),
                    GuardModes {
                        regression: config.bookmark_regression,
                        loss: config.bookmark_loss,
                    },
                )),
                locks,
                pools,
                readiness: Arc::new(Readiness::new(clickhouse.clone())),
                journal: store.journal,
                clickhouse,
                metrics,
                body_limit: config.body_limit,
                body_read_timeout: config.client_timeouts.body_read,
                admission: Arc::new(Admission::new(config.concurrency)),
                tokens: Arc::new(LiveTokens::new(config.tokens.clone(), config.jwt.clone())),
                protect_metrics: config.protect_metrics,
                own_hosts: Arc::new(OwnHosts {
                    advertised: config.locks.advertise_url.as_deref().and_then(|url| {
                        url::Url::parse(url)
                            .ok()?
                            .host_str()
                            .map(|h| h.trim_matches(['[', ']']).to_ascii_lowercase())
                    }),
                    loopback_only: config.listen.ip().is_loopback(),
                }),
                client_certificates_required: config
                    .tls
                    .as_ref()
                    .is_some_and(|tls| tls.client_certificates_required),
            },
            client_timeouts: config.client_timeouts,
            shutdown_timeout: config.shutdown_timeout,
            tls: config.tls.clone(),
            token_sources: config.token_sources.clone(),
            hangups: Hangups::listen(),
        })
    }

    /// `https` when the gateway serves TLS, else `http`.
    pub fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Serves until `shutdown` resolves, then lets in-flight requests finish
    /// for at most the shutdown timeout.
    pub async fn serve(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let (begin_drain, draining) = tokio::sync::oneshot::channel::<()>();
        let watches = self.ctx.states.watches().clone();
        let signal = async move {
            shutdown.await;
            tracing::info!("shutting down: draining in-flight requests");
            // Long-polls answer now with what they know, rather than hold
            // the drain up to their deadlines.
            watches.close();
            let _ = begin_drain.send(());
        };
        let (locks, pools) = (self.ctx.locks.clone(), self.ctx.pools.clone());
        let maintenance = tokio::spawn(locks.clone().maintain());
        let pool_maintenance = tokio::spawn(pools.clone().maintain());
        let heartbeat = self
            .registration
            .clone()
            .map(|registration| tokio::spawn(registration.heartbeat()));
        let metrics = self.ctx.metrics.clone();
        // SIGHUP reloads what can be reloaded, and never ends the gateway.
        let hangups = self.hangups;
        let mut reloading = Vec::new();
        if let Some(tls) = &self.tls {
            reloading.push(tokio::spawn(tls::reload_on_hangup(
                tls.identity.clone(),
                hangups.subscribe(),
            )));
        }
        if let Some(path) = self.token_sources.file.clone() {
            reloading.push(tokio::spawn(auth::reload::keep_current(
                self.ctx.tokens.clone(),
                self.token_sources.clone(),
                path,
                hangups.subscribe(),
            )));
        }
        if let Some(jwt) = self.ctx.tokens.jwt() {
            reloading.push(jwt.start(hangups.subscribe()));
        }
        let server = http::serve(
            self.listener,
            http::router(self.ctx),
            self.client_timeouts,
            self.tls.map(|tls| TlsAcceptor::from(tls.config)),
            metrics,
            signal,
        );
        let deadline = async move {
            if draining.await.is_ok() {
                tokio::time::sleep(self.shutdown_timeout).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        let result = tokio::select! {
            () = server => Ok(()),
            () = deadline => {
                tracing::warn!(timeout = ?self.shutdown_timeout, "requests still running at the shutdown timeout; exiting anyway");
                Ok(())
            }
        };
        maintenance.abort();
        pool_maintenance.abort();
        if let Some(heartbeat) = heartbeat {
            heartbeat.abort();
        }
        for reloading in reloading {
            reloading.abort();
        }
        drop(hangups);
        // Hand the claims back so other gateways need not wait for them to
        // lapse; the next claim holder adopts the leases.
        let handed_back = tokio::time::timeout(self.shutdown_timeout, async {
            tokio::join!(locks.hand_back(), pools.hand_back())
        })
        .await;
        if handed_back.is_err() {
            tracing::warn!("claims not all handed back at shutdown; the rest lapse by themselves");
        }
        if let Some(registration) = &self.registration {
            registration.leave().await;
        }
        // The spans of the last requests are still queued: they go now, on
        // the export thread, waited for no longer than a collector that
        // answers needs.
        tokio::task::spawn_blocking(|| traces::flush(TRACES_FLUSH))
            .await
            .ok();
        result
    }
}

/// Says whether requests are authenticated (an open address without tokens
/// was refused by [`Config`]).
fn log_authentication(config: &Config) {
    let issuers = config.jwt.as_ref().map_or(0, |jwt| jwt.len());
    if config.tokens.is_empty() && issuers == 0 {
        tracing::warn!(listen = %config.listen, "no tokens configured: authentication is off");
    } else {
        tracing::info!(
            tokens = config.tokens.len(),
            jwt_issuers = issuers,
            "bearer-token authentication on"
        );
    }
}

/// Waits for ClickHouse (bounded by the startup timeout) and creates the
/// databases and tables; gives up at once on what waiting cannot fix.
async fn prepare_clickhouse(store: &Store, config: &Config) -> Result<(), StartError> {
    let started = Instant::now();
    let mut delay = Duration::from_millis(100);
    // Once ClickHouse has answered but its Keeper has not, that is what the
    // start waits on: a ClickHouse stuck on a Keeper call may then time out
    // even a ping (the local one runs one query at a time).
    let mut keeper_failed = false;
    loop {
        // Which step failed: ClickHouse itself, or (keeper mode) its Keeper.
        let attempt = async {
            store.clickhouse.ping().await.map_err(|e| (false, e))?;
            store.ensure_schema().await.map_err(|e| (false, e))?;
            store.ensure_claims().await.map_err(|e| (true, e))
        };
        // No attempt outlasts the startup timeout, whatever it waits on.
        let left = config.startup_timeout.saturating_sub(started.elapsed());
        let bounded = tokio::time::timeout(left.max(Duration::from_millis(100)), attempt);
        let (keeper_step, source) = match bounded.await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(failed)) => failed,
            Err(_) => (false, StoreError::Timeout(left)),
        };
        keeper_failed |= keeper_step;
        if let Some(blocker) = source.blocker() {
            return Err(blocked(blocker, config, source));
        }
        let remaining = config.startup_timeout.saturating_sub(started.elapsed());
        if remaining.is_zero() {
            let endpoint = config.clickhouse.endpoint();
            // Milliseconds are enough for people reading it.
            let waited = Duration::from_millis(
                u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            );
            return Err(if keeper_failed {
                StartError::KeeperUnreachable {
                    endpoint,
                    waited,
                    source,
                }
            } else {
                StartError::ClickHouse {
                    endpoint,
                    waited,
                    source,
                }
            });
        }
        let delay_now = delay.min(remaining);
        tracing::warn!(error = %source, retry_in = ?delay_now, "ClickHouse not usable yet");
        tokio::time::sleep(delay_now).await;
        delay = (delay * 2).min(Duration::from_secs(2));
    }
}

fn blocked(blocker: Blocker, config: &Config, source: StoreError) -> StartError {
    let endpoint = config.clickhouse.endpoint();
    let user = config.clickhouse.user.clone();
    match blocker {
        Blocker::Credentials => StartError::Credentials {
            endpoint,
            user,
            source,
        },
        Blocker::Permission => StartError::Permission {
            user,
            schema: config.schema.as_str().to_owned(),
            source,
        },
        Blocker::UntrustedCertificate => StartError::UntrustedCertificate { endpoint, source },
        Blocker::NotClickHouse => StartError::NotClickHouse { endpoint, source },
        Blocker::NoKeeperMapPrefix => StartError::Keeper {
            endpoint,
            setting: "keeper_map_path_prefix",
            source,
        },
        Blocker::NoKeeper => StartError::Keeper {
            endpoint,
            setting: "<zookeeper>",
            source,
        },
    }
}

/// SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut sigterm) => {
                sigterm.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
}
