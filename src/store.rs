//! The ClickHouse repository: the state table, read with FINAL, written with
//! explicit versions. Every value travels as a bound parameter.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clickhouse::Client;
use serde::{Deserialize, Serialize};

use crate::config::{ClickHouseTarget, Identifier};
use crate::domain::{CorruptState, PageCursor, PageLimit, StateDocument, StateId, StatePattern};
use crate::metrics::Metrics;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("ClickHouse did not answer within {0:?}")]
    Timeout(Duration),
    #[error("ClickHouse request failed: {0}")]
    ClickHouse(#[from] clickhouse::error::Error),
    #[error("state {id:?} in ClickHouse cannot be read: {source}")]
    Corrupt { id: String, source: CorruptState },
}

/// One state as ClickHouse holds it now, before its JSON is parsed: a
/// replacing write needs only its version, and should succeed even over a
/// row another writer left unreadable.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredRow {
    pub id: StateId,
    completed: Option<String>,
    partial: Option<String>,
    /// `updated_at` in milliseconds since the epoch: the row's version.
    pub updated_at_ms: i64,
}

impl StoredRow {
    /// A strong validator: changes whenever the version or the content does.
    pub fn etag(&self) -> String {
        let mut hash = Fnv1a::default();
        hash.write(&self.updated_at_ms.to_le_bytes());
        for text in [&self.completed, &self.partial] {
            match text {
                Some(text) => {
                    hash.write(&[1]);
                    hash.write(text.as_bytes());
                }
                None => hash.write(&[0]),
            }
        }
        format!("\"{:016x}\"", hash.0)
    }

    pub fn parse(self) -> Result<StoredState, StoreError> {
        let doc = StateDocument::from_stored(self.completed.as_deref(), self.partial.as_deref())
            .map_err(|source| StoreError::Corrupt {
                id: self.id.to_string(),
                source,
            })?;
        Ok(StoredState {
            etag: self.etag(),
            id: self.id,
            doc,
            updated_at_ms: self.updated_at_ms,
        })
    }
}

/// One state, parsed.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredState {
    pub id: StateId,
    pub doc: StateDocument,
    pub updated_at_ms: i64,
    pub etag: String,
}

/// One entry of a listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateSummary {
    pub id: StateId,
    pub updated_at_ms: i64,
}

#[derive(clickhouse::Row, Serialize)]
struct StateRowOut {
    state_id: String,
    partial_state: Option<String>,
    completed_state: Option<String>,
    updated_at: i64,
}

#[derive(clickhouse::Row, Deserialize)]
struct StateRowIn {
    partial_state: Option<String>,
    completed_state: Option<String>,
    updated_at_ms: i64,
}

#[derive(clickhouse::Row, Deserialize)]
struct SummaryRow {
    state_id: String,
    updated_at_ms: i64,
}

#[derive(Clone)]
pub struct StateStore {
    client: Client,
    schema: Identifier,
    /// `schema`.`table`, ready to splice into SQL (both parts are plain identifiers).
    table: String,
    timeout: Duration,
    metrics: Arc<Metrics>,
}

impl StateStore {
    pub fn new(
        target: &ClickHouseTarget,
        schema: Identifier,
        table: &Identifier,
        timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        // ClickHouse 26.3+ batches inserts asynchronously by default, which
        // would acknowledge a write before it is readable; every query here
        // is synchronous. max_execution_time stops server-side work we gave up on.
        let client = Client::default()
            .with_url(target.endpoint())
            .with_user(&target.user)
            .with_password(&target.password)
            .with_database(&target.database)
            .with_setting("async_insert", "0")
            .with_setting("max_execution_time", timeout.as_secs().max(1).to_string());
        let table = format!("`{}`.`{}`", schema.as_str(), table.as_str());
        Self {
            client,
            schema,
            table,
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

    /// Creates the database and the state table if missing. The table's layout
    /// is the seed plugin's, so either can serve a database the other wrote.
    pub async fn ensure_schema(&self) -> Result<(), StoreError> {
        let create_db = format!("CREATE DATABASE IF NOT EXISTS `{}`", self.schema.as_str());
        self.timed("ensure_schema", self.client.query(&create_db).execute())
            .await?;
        let create_table = format!(
            "CREATE TABLE IF NOT EXISTS {} (
                state_id String,
                partial_state Nullable(String),
                completed_state Nullable(String),
                updated_at DateTime64(3) DEFAULT now64(3)
            ) ENGINE = ReplacingMergeTree(updated_at) ORDER BY state_id",
            self.table
        );
        self.timed("ensure_schema", self.client.query(&create_table).execute())
            .await
    }

    pub async fn get(&self, id: &StateId) -> Result<Option<StoredRow>, StoreError> {
        let sql = format!(
            "SELECT partial_state, completed_state, toUnixTimestamp64Milli(updated_at) AS updated_at_ms
             FROM {} FINAL WHERE state_id = {{id:String}} LIMIT 1",
            self.table
        );
        let query = self.client.query(&sql).param("id", id.as_str());
        let row = self
            .timed("get", query.fetch_optional::<StateRowIn>())
            .await?;
        Ok(row.map(|row| StoredRow {
            id: id.clone(),
            completed: row.completed_state,
            partial: row.partial_state,
            updated_at_ms: row.updated_at_ms,
        }))
    }

    /// Writes a new version of `id`. Its `updated_at` is after both this
    /// gateway's clock and the version it replaces, so it wins even over a
    /// row another writer stamped with a clock ahead of ours, and two writes
    /// in one millisecond still resolve to the later one.
    pub async fn put(
        &self,
        id: &StateId,
        doc: StateDocument,
        replacing: Option<&StoredRow>,
    ) -> Result<StoredState, StoreError> {
        let floor = replacing.map_or(i64::MIN, |current| current.updated_at_ms + 1);
        let row = StoredRow {
            id: id.clone(),
            completed: Some(doc.completed_json()),
            partial: Some(doc.partial_json()),
            updated_at_ms: now_ms().max(floor),
        };
        let out = StateRowOut {
            state_id: id.as_str().to_owned(),
            partial_state: row.partial.clone(),
            completed_state: row.completed.clone(),
            updated_at: row.updated_at_ms,
        };
        self.timed("put", async {
            let mut insert = self
                .client
                .insert_unescaped::<StateRowOut>(&self.table)
                .await?;
            insert.write(&out).await?;
            insert.end().await
        })
        .await?;
        Ok(StoredState {
            etag: row.etag(),
            id: row.id,
            doc,
            updated_at_ms: row.updated_at_ms,
        })
    }

    pub async fn delete(&self, id: &StateId) -> Result<(), StoreError> {
        let sql = format!("DELETE FROM {} WHERE state_id = {{id:String}}", self.table);
        let query = self
            .client
            .query(&sql)
            .param("id", id.as_str())
            .with_setting("lightweight_deletes_sync", "2");
        self.timed("delete", query.execute()).await
    }

    /// Deletes every state whose id matches; answers how many there were.
    pub async fn delete_matching(&self, pattern: &StatePattern) -> Result<u64, StoreError> {
        let filter = PatternFilter::new(pattern);
        let count_sql = format!(
            "SELECT count() FROM {} FINAL WHERE {}",
            self.table, filter.sql
        );
        let count = self
            .timed(
                "delete_matching",
                filter
                    .bind(self.client.query(&count_sql))
                    .fetch_one::<u64>(),
            )
            .await?;
        if count == 0 {
            return Ok(0);
        }
        let delete_sql = format!("DELETE FROM {} WHERE {}", self.table, filter.sql);
        let delete = filter
            .bind(self.client.query(&delete_sql))
            .with_setting("lightweight_deletes_sync", "2");
        self.timed("delete_matching", delete.execute()).await?;
        Ok(count)
    }

    /// Up to `limit` ids matching `pattern`, in byte order, after `cursor`.
    /// Also answers whether more follow.
    pub async fn list(
        &self,
        pattern: &StatePattern,
        cursor: Option<&PageCursor>,
        limit: PageLimit,
    ) -> Result<(Vec<StateSummary>, bool), StoreError> {
        let filter = PatternFilter::new(pattern);
        let sql = format!(
            "SELECT state_id, toUnixTimestamp64Milli(updated_at) AS updated_at_ms
             FROM {} FINAL
             WHERE state_id > {{after:String}} AND {}
             ORDER BY state_id LIMIT {{limit:UInt32}}",
            self.table, filter.sql
        );
        let after = cursor.map_or("", |c| c.last_seen().as_str());
        let query = filter
            .bind(self.client.query(&sql))
            .param("after", after)
            // One more than asked tells whether another page exists.
            .param("limit", limit.get() + 1);
        let rows = self.timed("list", query.fetch_all::<SummaryRow>()).await?;
        let has_more = rows.len() > limit.get() as usize;
        let summaries = rows
            .into_iter()
            .take(limit.get() as usize)
            .filter_map(|row| {
                // Another writer may have stored an empty id, which no request can name.
                StateId::parse(row.state_id).ok().map(|id| StateSummary {
                    id,
                    updated_at_ms: row.updated_at_ms,
                })
            })
            .collect();
        Ok((summaries, has_more))
    }
}

/// The WHERE condition for a glob: a key-range prefix (so ClickHouse can use
/// the primary key) plus the full match, skipped when the glob is all stars.
struct PatternFilter {
    sql: &'static str,
    prefix: String,
    regex: Option<String>,
}

impl PatternFilter {
    fn new(pattern: &StatePattern) -> Self {
        if pattern.matches_everything() {
            return Self {
                sql: "1",
                prefix: String::new(),
                regex: None,
            };
        }
        Self {
            sql: "startsWith(state_id, {prefix:String}) AND match(state_id, {regex:String})",
            prefix: pattern.literal_prefix().to_owned(),
            regex: Some(pattern.to_regex()),
        }
    }

    fn bind(&self, query: clickhouse::query::Query) -> clickhouse::query::Query {
        match &self.regex {
            Some(regex) => query.param("prefix", &self.prefix).param("regex", regex),
            None => query,
        }
    }
}

fn now_ms() -> i64 {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX)
}

/// FNV-1a, 64 bit: stable across builds and platforms, which ETags need
/// (std's hasher may change between Rust releases).
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}
