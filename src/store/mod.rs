//! ClickHouse: one client, every round trip under the query timeout and
//! measured, every value a bound parameter. One module per table.

mod http_client;
mod lease_table;
mod state_table;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clickhouse::Client;

pub use lease_table::{Candidate, LeaseRecord, LeaseState, LeaseStore, LeaseVersion, StoredLease};
pub use state_table::{StateStore, StateSummary, StoredRow, StoredState};

use crate::config::{ClickHouseTarget, Identifier};
use crate::domain::CorruptState;
use crate::metrics::Metrics;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("ClickHouse did not answer within {0:?}")]
    Timeout(Duration),
    #[error("ClickHouse request failed: {}", with_causes(.0))]
    ClickHouse(#[from] clickhouse::error::Error),
    #[error("state {id:?} in ClickHouse cannot be read: {source}")]
    Corrupt { id: String, source: CorruptState },
}

#[derive(Clone)]
pub struct ClickHouse {
    client: Client,
    timeout: Duration,
    metrics: Arc<Metrics>,
}

impl ClickHouse {
    pub fn new(target: &ClickHouseTarget, timeout: Duration, metrics: Arc<Metrics>) -> Self {
        // ClickHouse 26.3+ batches inserts asynchronously by default, which
        // would acknowledge a write before it is readable and let lock
        // candidates settle out of order; every query here is synchronous.
        // max_execution_time stops server-side work we gave up on.
        let http = http_client::builder().build(http_client::connector(target));
        let client = Client::with_http_client(http)
            .with_url(target.endpoint())
            .with_user(&target.user)
            .with_password(&target.password)
            .with_database(&target.database)
            .with_setting("async_insert", "0")
            .with_setting("max_execution_time", timeout.as_secs().max(1).to_string());
        Self {
            client,
            timeout,
            metrics,
        }
    }

    /// Runs one ClickHouse round trip under the query timeout and records it.
    async fn timed<T>(
        &self,
        operation: &'static str,
        call: impl Future<Output = Result<T, clickhouse::error::Error>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let result = match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(err)) => Err(StoreError::ClickHouse(err)),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        };
        self.metrics
            .observe_query(operation, started.elapsed().as_secs_f64(), result.is_ok());
        result
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        self.timed("ping", self.client.query("SELECT 1").fetch_one::<u8>())
            .await
            .map(drop)
    }
}

/// The gateway's tables: `schema`.`table` for state, `schema`.`table_lease` for locks.
#[derive(Clone)]
pub struct Store {
    pub clickhouse: ClickHouse,
    pub states: StateStore,
    pub leases: LeaseStore,
    schema: Identifier,
}

impl Store {
    pub fn new(ch: ClickHouse, schema: Identifier, table: &Identifier) -> Self {
        let qualified = |name: &str| format!("`{}`.`{name}`", schema.as_str());
        Self {
            states: StateStore::new(ch.clone(), qualified(table.as_str())),
            leases: LeaseStore::new(ch.clone(), qualified(&format!("{}_lease", table.as_str()))),
            clickhouse: ch,
            schema,
        }
    }

    /// Creates the database and both tables if missing.
    pub async fn ensure_schema(&self) -> Result<(), StoreError> {
        let create_db = format!("CREATE DATABASE IF NOT EXISTS `{}`", self.schema.as_str());
        self.clickhouse
            .timed(
                "ensure_schema",
                self.clickhouse.client.query(&create_db).execute(),
            )
            .await?;
        self.states.ensure_table().await?;
        self.leases.ensure_table().await
    }
}

/// An error and its causes on one line: "client error (connect)" alone does
/// not say that the certificate was not trusted.
fn with_causes(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(inner) = cause {
        let inner_text = inner.to_string();
        if !text.contains(&inner_text) {
            text.push_str(": ");
            text.push_str(&inner_text);
        }
        cause = inner.source();
    }
    text
}

/// This machine's clock in milliseconds since the epoch, as versions and lease times are kept.
pub(crate) fn now_ms() -> i64 {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX)
}
