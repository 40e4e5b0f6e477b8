//! ClickHouse: one client, every round trip under the query timeout and
//! measured, every value a bound parameter. One module per table.

mod ddl;
mod diagnosis;
mod gateways_table;
mod history_table;
mod http_client;
mod keeper_claims;
mod lease_table;
mod ping;
mod read_batch;
mod state_table;
mod target;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clickhouse::Client;
use clickhouse::sql::Identifier as SqlIdentifier;

pub use ddl::{ClusterName, InvalidClusterName, Placement};
pub use diagnosis::Blocker;
pub use gateways_table::GatewayStore;
pub use history_table::{
    ChangeContext, History, HistoryStore, NewVersion, Operation, StoredVersion, VersionMeta,
};
pub use keeper_claims::{ClaimHolder, ClaimRead, KeeperClaim, KeeperClaimStore, NewClaim, Outcome};
pub use lease_table::{
    Candidate, IdLocks, LeaseRecord, LeaseState, LeaseStore, LeaseVersion, StoredLease,
};
pub use state_table::{Selection, StateStore, StateSummary, StoredRow, StoredState, next_version};
pub use target::{ClickHouseTarget, Identifier, InvalidIdentifier};

use crate::domain::{Coordination, CorruptState};
use crate::metrics::Metrics;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("ClickHouse did not answer within {0:?}")]
    Timeout(Duration),
    #[error("ClickHouse request failed: {}", with_causes(.0))]
    ClickHouse(#[from] clickhouse::error::Error),
    /// An answer without a ClickHouse exception that is not a result either:
    /// a proxy's error page, or another server altogether.
    #[error("the answer is not ClickHouse's: HTTP {}: {excerpt}", status_line(*.status))]
    Unrecognized { status: u16, excerpt: String },
    #[error("state {id:?} in ClickHouse cannot be read: {source}")]
    Corrupt { id: String, source: CorruptState },
    /// The query of a batch failed: the INSERT of writes (see
    /// `states::group_commit`) or a coalesced read (see `read_batch`).
    #[error("{0}")]
    InBatch(Arc<StoreError>),
    #[error("the write was abandoned: the gateway is shutting down")]
    Abandoned,
}

impl StoreError {
    /// Whether ClickHouse surely did not apply the request that failed so:
    /// it answered with an exception. After a timeout, a cut connection or
    /// an answer that is not ClickHouse's, the request may still be applied.
    pub fn surely_not_applied(&self) -> bool {
        match self {
            Self::ClickHouse(clickhouse::error::Error::BadResponse(_)) => true,
            Self::InBatch(inner) => inner.surely_not_applied(),
            _ => false,
        }
    }
}

#[derive(Clone)]
pub struct ClickHouse {
    client: Client,
    /// The same connection settings without the URI's database, which may not
    /// exist yet: it creates it.
    bootstrap: Client,
    database: String,
    pinger: Arc<ping::Pinger>,
    timeout: Duration,
    metrics: Arc<Metrics>,
    /// Reads that must see the latest committed write ask for it
    /// (`select_sequential_consistency`): set when tables have replicas.
    sequential_reads: bool,
}

impl ClickHouse {
    pub fn new(target: &ClickHouseTarget, timeout: Duration, metrics: Arc<Metrics>) -> Self {
        // ClickHouse 26.3+ batches inserts asynchronously by default, which
        // would acknowledge a write before it is readable and let lock
        // candidates settle out of order; every query here is synchronous.
        // max_execution_time stops server-side work we gave up on.
        let http = http_client::builder().build(http_client::connector(target));
        let bootstrap = Client::with_http_client(http)
            .with_url(target.endpoint())
            .with_user(&target.user)
            .with_password(&target.password)
            .with_setting("async_insert", "0")
            .with_setting("max_execution_time", timeout.as_secs().max(1).to_string());
        Self {
            client: bootstrap.clone().with_database(&target.database),
            bootstrap,
            database: target.database.clone(),
            pinger: Arc::new(ping::Pinger::new(target)),
            timeout,
            metrics,
            sequential_reads: false,
        }
    }

    /// A query for a read that must see every write acknowledged before it
    /// (what a state or lease row holds now), on any replica.
    fn latest_read(&self, sql: &str) -> clickhouse::query::Query {
        let query = self.client.query(sql);
        if self.sequential_reads {
            query.with_setting("select_sequential_consistency", "1")
        } else {
            query
        }
    }

    /// The engine of database `name` (`Atomic`, `Replicated`, ...); empty if it does not exist.
    async fn database_engine(&self, name: &str) -> Result<String, StoreError> {
        let query = self
            .bootstrap
            .query("SELECT any(engine) FROM system.databases WHERE name = {name:String}")
            .param("name", name);
        self.timed("ensure_schema", query.fetch_one::<String>())
            .await
    }

    /// Runs one ClickHouse round trip under the query timeout and records it.
    async fn timed<T, E: Into<StoreError>>(
        &self,
        operation: &'static str,
        call: impl Future<Output = Result<T, E>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let result = match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(err)) => Err(err.into()),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        };
        self.metrics
            .observe_query(operation, started.elapsed().as_secs_f64(), result.is_ok());
        result
    }

    /// `SELECT 1` as the configured user, without the URI's database.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.timed("ping", self.pinger.ping()).await
    }

    /// Creates a database unless it exists: `CREATE DATABASE IF NOT EXISTS`
    /// needs the grant even when there is nothing to create, and a user
    /// without it can still use a database an administrator made.
    async fn ensure_database(&self, name: &str, placement: &Placement) -> Result<(), StoreError> {
        let exists = self
            .bootstrap
            .query("SELECT count() FROM system.databases WHERE name = {name:String}")
            .param("name", name);
        if self
            .timed("ensure_schema", exists.fetch_one::<u64>())
            .await?
            > 0
        {
            return Ok(());
        }
        let sql = ddl::create_database_sql(placement);
        let create = self.bootstrap.query(&sql).bind(SqlIdentifier(name));
        self.timed("ensure_schema", create.execute()).await
    }

    /// The columns of `database`.`table`, with their types.
    async fn columns(
        &self,
        database: &str,
        table: &str,
    ) -> Result<Vec<(String, String)>, StoreError> {
        let query = self
            .bootstrap
            .query(
                "SELECT name, type FROM system.columns
                 WHERE database = {database:String} AND table = {table:String}",
            )
            .param("database", database)
            .param("table", table);
        self.timed("ensure_schema", query.fetch_all::<(String, String)>())
            .await
    }

    /// The tables of `database` among `tables`, with their engines in full.
    async fn present_tables(
        &self,
        database: &str,
        tables: &[&str],
    ) -> Result<Vec<(String, String)>, StoreError> {
        let query = self
            .bootstrap
            .query(
                "SELECT name, engine_full FROM system.tables
                 WHERE database = {database:String} AND has({names:Array(String)}, name)",
            )
            .param("database", database)
            .param("names", tables);
        self.timed("ensure_schema", query.fetch_all::<(String, String)>())
            .await
    }
}

/// How the gateway's tables are laid out beyond their names: the claim
/// protocol (keeper mode adds the claims table) and the `--cluster`.
#[derive(Clone, Debug)]
pub struct Layout {
    pub coordination: Coordination,
    pub cluster: Option<ClusterName>,
}

impl Default for Layout {
    fn default() -> Self {
        Self {
            coordination: Coordination::Table,
            cluster: None,
        }
    }
}

/// The gateway's tables: `schema`.`table` for state, `schema`.`table_lease`
/// for locks, `schema`.`table_history` for versions (unless history is off),
/// `schema`.`table_gateways` for the gateways serving them, and in keeper
/// mode `schema`.`table_claims` (KeeperMap) for claims.
#[derive(Clone)]
pub struct Store {
    pub clickhouse: ClickHouse,
    pub states: StateStore,
    pub leases: LeaseStore,
    pub history: Option<HistoryStore>,
    pub gateways: GatewayStore,
    pub claims: KeeperClaimStore,
    schema: Identifier,
    table: Identifier,
    layout: Layout,
}

impl Store {
    /// The tables of a single node in table mode.
    pub fn new(ch: ClickHouse, schema: Identifier, table: &Identifier, history: History) -> Self {
        Self::with_layout(ch, schema, table, history, Layout::default())
    }

    pub fn with_layout(
        mut ch: ClickHouse,
        schema: Identifier,
        table: &Identifier,
        history: History,
        layout: Layout,
    ) -> Self {
        ch.sequential_reads = layout.cluster.is_some();
        let qualified = |name: &str| format!("`{}`.`{name}`", schema.as_str());
        let claims_table = claims_table_name(table);
        Self {
            states: StateStore::new(ch.clone(), qualified(table.as_str())),
            leases: LeaseStore::new(ch.clone(), qualified(&lease_table_name(table))),
            gateways: GatewayStore::new(ch.clone(), qualified(&gateways_table_name(table))),
            claims: KeeperClaimStore::new(
                ch.clone(),
                qualified(&claims_table),
                keeper_claims::keeper_path(schema.as_str(), &claims_table),
            ),
            history: match history {
                History::Off => None,
                History::Kept(retention) => Some(HistoryStore::new(
                    ch.clone(),
                    qualified(&history_table_name(table)),
                    qualified(&history_view_name(table)),
                    qualified(table.as_str()),
                    retention,
                )),
            },
            clickhouse: ch,
            schema,
            table: table.clone(),
            layout,
        }
    }

    /// Creates what is missing of the URI's database, `schema` and the tables,
    /// and brings the history table's TTL to the retention.
    pub async fn ensure_schema(&self) -> Result<(), StoreError> {
        let ch = &self.clickhouse;
        // A new database takes the server's default engine, which `default`
        // has too: Replicated on ClickHouse Cloud, where ON CLUSTER is refused.
        let databases = Placement::new(
            self.layout.cluster.clone(),
            &ch.database_engine("default").await?,
        );
        if !ch.database.is_empty() {
            ch.ensure_database(&ch.database, &databases).await?;
        }
        ch.ensure_database(self.schema.as_str(), &databases).await?;
        let placement = Placement::new(
            self.layout.cluster.clone(),
            &ch.database_engine(self.schema.as_str()).await?,
        );
        let lease_table = lease_table_name(&self.table);
        let history_table = history_table_name(&self.table);
        let history_view = history_view_name(&self.table);
        let gateways_table = gateways_table_name(&self.table);
        let present = ch
            .present_tables(
                self.schema.as_str(),
                &[
                    self.table.as_str(),
                    &lease_table,
                    &history_table,
                    &history_view,
                    &gateways_table,
                ],
            )
            .await?;
        let engine_of = |name: &str| {
            present
                .iter()
                .find(|(table, _)| table == name)
                .map(|(_, engine)| engine.as_str())
        };
        if engine_of(self.table.as_str()).is_none() {
            self.states.ensure_table(&placement).await?;
        }
        if engine_of(&lease_table).is_none() {
            self.leases.ensure_table(&placement).await?;
        } else {
            let columns = ch.columns(self.schema.as_str(), &lease_table).await?;
            self.leases.upgrade_table(&columns, &placement).await?;
        }
        if let Some(history) = &self.history {
            match engine_of(&history_table) {
                None => history.ensure_table(&placement).await?,
                Some(engine) => {
                    history.ensure_retention(engine, &placement).await?;
                    let columns = ch.columns(self.schema.as_str(), &history_table).await?;
                    history.upgrade_table(&columns, &placement).await?;
                }
            }
            if engine_of(&history_view).is_none() {
                history.ensure_view(&placement).await?;
            }
        }
        if engine_of(&gateways_table).is_none() {
            self.gateways.ensure_table(&placement).await?;
        }
        Ok(())
    }

    /// In keeper mode, creates the claims table if missing and reads a key:
    /// fails unless the server runs KeeperMap and reaches its Keeper now (a
    /// table made earlier proves nothing about that). In table mode, nothing.
    pub async fn ensure_claims(&self) -> Result<(), StoreError> {
        if self.layout.coordination != Coordination::Keeper {
            return Ok(());
        }
        let ch = &self.clickhouse;
        let claims_table = claims_table_name(&self.table);
        let present = ch
            .present_tables(self.schema.as_str(), &[&claims_table])
            .await?;
        if present.is_empty() {
            let placement = Placement::new(
                self.layout.cluster.clone(),
                &ch.database_engine(self.schema.as_str()).await?,
            );
            self.claims.ensure_table(&placement).await?;
        }
        self.claims.probe().await
    }
}

fn history_table_name(table: &Identifier) -> String {
    format!("{}_history", table.as_str())
}

fn history_view_name(table: &Identifier) -> String {
    format!("{}_history_writes", table.as_str())
}

fn lease_table_name(table: &Identifier) -> String {
    format!("{}_lease", table.as_str())
}

fn gateways_table_name(table: &Identifier) -> String {
    format!("{}_gateways", table.as_str())
}

fn claims_table_name(table: &Identifier) -> String {
    format!("{}_claims", table.as_str())
}

/// An error and its causes on one line: "client error (connect)" alone does
/// not say that the certificate was not trusted, and a server's message may
/// span lines.
fn with_causes(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = String::new();
    for cause in diagnosis::causes(err) {
        let cause_text = one_line(&cause.to_string());
        if !text.contains(&cause_text) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&cause_text);
        }
    }
    text
}

fn status_line(status: u16) -> String {
    let reason = hyper::StatusCode::from_u16(status)
        .ok()
        .and_then(|status| status.canonical_reason());
    match reason {
        Some(reason) => format!("{status} {reason}"),
        None => status.to_string(),
    }
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// This machine's clock in milliseconds since the epoch, as versions and lease times are kept.
pub(crate) fn now_ms() -> i64 {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX)
}
