//! The one ClickHouse client: every round trip under the query timeout and
//! measured, every read that must see the latest write asking for it, and
//! every statement sent in a traced span carrying its `traceparent`.

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clickhouse::Client;
use clickhouse::sql::Identifier as SqlIdentifier;

use super::ddl::{Placement, create_database_sql};
use super::error::StoreError;
use super::http_client;
use super::ping::Pinger;
use super::target::ClickHouseTarget;
use crate::metrics::Metrics;
use crate::traces;

#[derive(Clone)]
pub struct ClickHouse {
    /// Statements are built on [`Self::client`], which adds the trace.
    client: Client,
    /// The same connection settings without the URI's database, which may not
    /// exist yet: it creates it.
    bootstrap: Client,
    pub(super) database: String,
    pinger: Arc<Pinger>,
    timeout: Duration,
    pub(super) metrics: Arc<Metrics>,
    /// Reads that must see the latest committed write ask for it
    /// (`select_sequential_consistency`): set when tables have replicas.
    pub(super) sequential_reads: bool,
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
            pinger: Arc::new(Pinger::new(target)),
            timeout,
            metrics,
            sequential_reads: false,
        }
    }

    /// The client to build a statement on: with traces on, a clone that
    /// sends the current span's `traceparent`, so ClickHouse records the
    /// statement in the request's trace (or its batch's).
    pub(super) fn client(&self) -> Cow<'_, Client> {
        match traces::traceparent().and_then(|value| value.to_str().ok().map(str::to_owned)) {
            Some(traceparent) => Cow::Owned(
                self.client
                    .clone()
                    .with_header(traces::TRACEPARENT, traceparent),
            ),
            None => Cow::Borrowed(&self.client),
        }
    }

    /// A query for a read that must see every write acknowledged before it
    /// (what a state or lease row holds now), on any replica.
    pub(super) fn latest_read(&self, sql: &str) -> clickhouse::query::Query {
        let query = self.client().query(sql);
        if self.sequential_reads {
            query.with_setting("select_sequential_consistency", "1")
        } else {
            query
        }
    }

    /// The engine of database `name` (`Atomic`, `Replicated`, ...); empty if it does not exist.
    pub(super) async fn database_engine(&self, name: &str) -> Result<String, StoreError> {
        let query = self
            .bootstrap
            .query("SELECT any(engine) FROM system.databases WHERE name = {name:String}")
            .param("name", name);
        self.timed("ensure_schema", query.fetch_one::<String>())
            .await
    }

    /// Runs one DDL statement of the schema's set-up (a CREATE or ALTER).
    pub(super) async fn ddl(&self, sql: &str) -> Result<(), StoreError> {
        self.timed("ensure_schema", self.client().query(sql).execute())
            .await
    }

    /// Runs one ClickHouse round trip under the query timeout and records it.
    pub(super) async fn timed<T, E: Into<StoreError>>(
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
    pub(super) async fn ensure_database(
        &self,
        name: &str,
        placement: &Placement,
    ) -> Result<(), StoreError> {
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
        let sql = create_database_sql(placement);
        let create = self.bootstrap.query(&sql).bind(SqlIdentifier(name));
        self.timed("ensure_schema", create.execute()).await
    }

    /// The columns of `database`.`table`, with their types.
    pub(super) async fn columns(
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
    pub(super) async fn present_tables(
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
