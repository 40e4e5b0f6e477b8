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
use crate::store::{ClickHouse, Store, StoreError};

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

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("ClickHouse at {endpoint} not usable after {waited:?}: {source}")]
    ClickHouse {
        endpoint: String,
        waited: Duration,
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
        let store = Store::new(clickhouse.clone(), config.schema.clone(), &config.table);
        prepare_clickhouse(&store, config).await?;
        let locks = Arc::new(LockManager::new(
            config.locks.clone(),
            store.leases,
            metrics.clone(),
        ));
        let listen = guarded_listen_address(config);
        let listener = TcpListener::bind(listen)
            .await
            .map_err(|source| StartError::Listen {
                addr: listen,
                source,
            })?;
        Ok(Self {
            listener,
            ctx: AppContext {
                states: Arc::new(States::new(store.states, locks.clone())),
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
        // Hand the claims back so other gateways need not wait for them to lapse;
        // leases stay recorded and the next claim holder adopts them.
        let withdrawn =
            tokio::time::timeout(self.shutdown_timeout, locks.withdraw_all_claims()).await;
        if withdrawn.is_err() {
            tracing::warn!("claims not all withdrawn at shutdown; the rest lapse by themselves");
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

/// Waits for ClickHouse (bounded by the startup timeout) and creates the schema.
async fn prepare_clickhouse(store: &Store, config: &Config) -> Result<(), StartError> {
    let started = Instant::now();
    let mut delay = Duration::from_millis(100);
    loop {
        let attempt = async {
            store.clickhouse.ping().await?;
            store.ensure_schema().await
        };
        match attempt.await {
            Ok(()) => return Ok(()),
            Err(source) if started.elapsed() + delay >= config.startup_timeout => {
                return Err(StartError::ClickHouse {
                    endpoint: config.clickhouse.endpoint(),
                    waited: started.elapsed(),
                    source,
                });
            }
            Err(err) => {
                tracing::warn!(error = %err, retry_in = ?delay, "ClickHouse not usable yet");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
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
