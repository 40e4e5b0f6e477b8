//! statehouse: an HTTP gateway that keeps Meltano pipeline state in ClickHouse.
//!
//! A request goes `http` (routes, extractors, errors) → `states` (the API's
//! rules, per-id write serialization) or `locks` (claims and leases) →
//! `store` (ClickHouse tables).

pub mod auth;
pub mod config;
pub mod domain;
pub mod healthcheck;
pub mod http;
mod keyed_mutex;
pub mod locks;
pub mod metrics;
pub mod run_lease;
pub mod states;
pub mod store;
pub mod telemetry;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;

use crate::auth::Tokens;
use crate::config::{ClientTimeouts, Config};
use crate::http::Admission;
use crate::locks::LockManager;
use crate::metrics::Metrics;
use crate::states::States;
use crate::store::{Blocker, ClickHouse, Store, StoreError};

/// What every handler shares; cheap to clone.
#[derive(Clone)]
pub struct AppContext {
    pub states: Arc<States>,
    pub locks: Arc<LockManager>,
    pub clickhouse: ClickHouse,
    pub metrics: Arc<Metrics>,
    pub body_limit: usize,
    pub body_read_timeout: Duration,
    pub admission: Arc<Admission>,
    pub tokens: Arc<Tokens>,
    pub protect_metrics: bool,
}

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
    client_timeouts: ClientTimeouts,
    shutdown_timeout: Duration,
}

impl App {
    pub async fn build(config: &Config) -> Result<Self, StartError> {
        let metrics = Arc::new(Metrics::default());
        let clickhouse = ClickHouse::new(&config.clickhouse, config.query_timeout, metrics.clone());
        let store = Store::new(
            clickhouse.clone(),
            config.schema.clone(),
            &config.table,
            config.history,
        );
        prepare_clickhouse(&store, config).await?;
        let locks = Arc::new(LockManager::new(
            config.locks.clone(),
            store.leases,
            metrics.clone(),
        ));
        match &config.locks.advertise_url {
            Some(url) => {
                tracing::info!(advertise_url = %url, "peers forward lock operations to this gateway")
            }
            None => tracing::info!(
                "no --advertise-url: other gateways cannot forward to this one, so its locks are served only by it; give every gateway behind one load balancer its URL"
            ),
        }
        let listen = guarded_listen_address(config);
        let listener = http::bind(listen).map_err(|source| StartError::Listen {
            addr: listen,
            source,
        })?;
        Ok(Self {
            listener,
            ctx: AppContext {
                states: Arc::new(States::new(store.states, store.history, locks.clone())),
                locks,
                clickhouse,
                metrics,
                body_limit: config.body_limit,
                body_read_timeout: config.client_timeouts.body_read,
                admission: Arc::new(Admission::new(config.concurrency)),
                tokens: Arc::new(config.tokens.clone()),
                protect_metrics: config.protect_metrics,
            },
            client_timeouts: config.client_timeouts,
            shutdown_timeout: config.shutdown_timeout,
        })
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
        let signal = async move {
            shutdown.await;
            tracing::info!("shutting down: draining in-flight requests");
            let _ = begin_drain.send(());
        };
        let locks = self.ctx.locks.clone();
        let maintenance = tokio::spawn(locks.clone().maintain());
        let metrics = self.ctx.metrics.clone();
        let server = http::serve(
            self.listener,
            http::router(self.ctx),
            self.client_timeouts,
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
        // Hand the claims back so other gateways need not wait for them to
        // lapse; the next claim holder adopts the leases.
        let handed_back = tokio::time::timeout(self.shutdown_timeout, locks.hand_back()).await;
        if handed_back.is_err() {
            tracing::warn!("claims not all handed back at shutdown; the rest lapse by themselves");
        }
        result
    }
}

/// Without tokens anyone who reaches the port can write state, so unless told
/// otherwise the gateway keeps to loopback, on the port it was given.
fn guarded_listen_address(config: &Config) -> SocketAddr {
    let wanted = config.listen;
    if !config.tokens.is_empty() {
        tracing::info!(
            tokens = config.tokens.len(),
            "bearer-token authentication on"
        );
        return wanted;
    }
    if wanted.ip().is_loopback() || config.allow_unauthenticated {
        tracing::warn!(listen = %wanted, "no tokens configured: authentication is off");
        return wanted;
    }
    let loopback = SocketAddr::from(([127, 0, 0, 1], wanted.port()));
    tracing::warn!(
        requested = %wanted,
        listen = %loopback,
        "no tokens configured: serving on loopback only (set STATEHOUSE_TOKENS_FILE, or --allow-unauthenticated to serve {wanted} without authentication)"
    );
    loopback
}

/// Waits for ClickHouse (bounded by the startup timeout) and creates the
/// databases and tables; gives up at once on what waiting cannot fix.
async fn prepare_clickhouse(store: &Store, config: &Config) -> Result<(), StartError> {
    let started = Instant::now();
    let mut delay = Duration::from_millis(100);
    loop {
        let attempt = async {
            store.clickhouse.ping().await?;
            store.ensure_schema().await
        };
        let source = match attempt.await {
            Ok(()) => return Ok(()),
            Err(source) => source,
        };
        if let Some(blocker) = source.blocker() {
            return Err(blocked(blocker, config, source));
        }
        let remaining = config.startup_timeout.saturating_sub(started.elapsed());
        if remaining.is_zero() {
            return Err(StartError::ClickHouse {
                endpoint: config.clickhouse.endpoint(),
                // Milliseconds are enough for people reading it.
                waited: Duration::from_millis(
                    u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                ),
                source,
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
