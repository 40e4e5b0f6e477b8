//! ClickHouse: one client, every round trip under the query timeout and
//! measured, every value a bound parameter. One module per table; this file
//! holds the set of tables ([`Store`]) and how they are created.

mod changes_table;
mod checked_insert;
mod client;
mod clock;
mod ddl;
mod decision_read;
mod diagnosis;
mod error;
mod gateways_table;
mod history_at;
mod history_regressed;
mod history_table;
mod http_client;
mod journal;
mod keeper_claims;
mod lease_history;
mod lease_rows;
mod lease_table;
mod members_table;
mod ping;
mod read_ahead;
mod read_batch;
mod route_read;
mod runs_table;
mod state_table;
mod stored;
mod target;

pub use changes_table::{ChangeRead, ChangeRecord, ChangesStore};
pub use checked_insert::Expected;
pub use client::ClickHouse;
pub(crate) use clock::now_ms;
pub use ddl::{ClusterName, InvalidClusterName, Placement};
pub use diagnosis::Blocker;
pub use error::StoreError;
pub use gateways_table::GatewayStore;
pub use history_regressed::{LastChange, RegressedVersion};
pub use history_table::{History, HistoryStore, NewVersion, Operation, StoredVersion, VersionMeta};
pub use journal::Journal;
pub use keeper_claims::{ClaimHolder, ClaimRead, KeeperClaim, KeeperClaimStore, NewClaim, Outcome};
pub use lease_history::{LeaseEnd, LeaseHistoryStore, PastLease};
pub use lease_rows::{Candidate, IdLocks, LeaseRecord, LeaseRows, StoredLease};
pub use lease_table::LeaseStore;
pub use members_table::MemberStore;
pub use runs_table::{RunEnd, RunQuery, RunStart, RunStore, StoredRun};
pub use state_table::{Selection, StateStore, StateSummary, next_version};
pub use stored::{StoredRow, StoredState};
pub use target::{ClickHouseTarget, Identifier, InvalidIdentifier};

use self::changes_table::ChangesTables;
use crate::domain::Coordination;

/// How long the change feed's cursors stay good unless configured.
pub const DEFAULT_WATCH_RETENTION: std::time::Duration = std::time::Duration::from_secs(3600);

/// How the gateway's tables are laid out beyond their names: the claim
/// protocol (keeper mode adds the claims table) and the `--cluster`.
#[derive(Clone, Debug)]
pub struct Layout {
    pub coordination: Coordination,
    pub cluster: Option<ClusterName>,
    /// How long the changes table keeps a change (`--watch-retention`).
    pub watch_retention: std::time::Duration,
}

impl Default for Layout {
    fn default() -> Self {
        Self {
            coordination: Coordination::Table,
            cluster: None,
            watch_retention: DEFAULT_WATCH_RETENTION,
        }
    }
}

/// The gateway's tables: `schema`.`table` for state, `schema`.`table_lease`
/// for locks, `schema`.`table_history` for versions (unless history is off),
/// `schema`.`table_lease_history` for each id's leases and `schema`.`table_runs`
/// for their runs (with history),
/// `schema`.`table_gateways` for the gateways serving them,
/// `schema`.`table_members` for the gateways taking part in table-mode claims,
/// `schema`.`table_pool_lease` for pools, and in keeper mode
/// `schema`.`table_claims` and `schema`.`table_pool_claims` (KeeperMap) for claims.
#[derive(Clone)]
pub struct Store {
    pub clickhouse: ClickHouse,
    pub states: StateStore,
    pub leases: LeaseStore,
    /// The pools' leases: the lock tables over again, one row per lease.
    pub pool_leases: LeaseStore,
    pub pool_claims: KeeperClaimStore,
    /// Each state's versions and each id's leases, unless history is off.
    pub journal: Journal,
    pub gateways: GatewayStore,
    /// The gateways taking part in table-mode claims (see `locks::claim::membership`).
    pub members: MemberStore,
    pub claims: KeeperClaimStore,
    /// Every change, in insert order, for the change feed.
    pub changes: ChangesStore,
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
        let claims_table = companion(table, "claims");
        let journal = Journal::new(&ch, history, table, qualified);
        // A write's routing read files the id's row here for its write.
        let read_ahead = std::sync::Arc::new(read_ahead::ReadAhead::default());
        let members = MemberStore::new(
            ch.clone(),
            qualified(&companion(table, "members")),
            qualified(&companion(table, "gateways")),
        );
        Self {
            states: StateStore::new(ch.clone(), qualified(table.as_str()), read_ahead.clone()),
            leases: LeaseStore::new(
                ch.clone(),
                qualified(&companion(table, "lease")),
                LeaseRows::PerId,
            )
            .routing_writes_to(qualified(table.as_str()), read_ahead)
            .with_members(members.clone()),
            pool_leases: LeaseStore::new(
                ch.clone(),
                qualified(&companion(table, "pool_lease")),
                LeaseRows::PerLease,
            )
            .with_members(members.clone()),
            pool_claims: KeeperClaimStore::new(
                ch.clone(),
                qualified(&companion(table, "pool_claims")),
                keeper_claims::keeper_path(schema.as_str(), &companion(table, "pool_claims")),
            ),
            gateways: GatewayStore::new(ch.clone(), qualified(&companion(table, "gateways"))),
            members,
            claims: KeeperClaimStore::new(
                ch.clone(),
                qualified(&claims_table),
                keeper_claims::keeper_path(schema.as_str(), &claims_table),
            ),
            changes: ChangesStore::new(
                ch.clone(),
                ChangesTables {
                    table: qualified(&companion(table, "changes")),
                    writes_view: qualified(&companion(table, "changes_writes")),
                    deletes_view: qualified(&companion(table, "changes_deletes")),
                    state_table: qualified(table.as_str()),
                    history_table: journal
                        .is_kept()
                        .then(|| qualified(&companion(table, "history"))),
                },
                layout.watch_retention,
            ),
            journal,
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
        let lease_table = companion(&self.table, "lease");
        let history_table = companion(&self.table, "history");
        let history_view = companion(&self.table, "history_writes");
        let gateways_table = companion(&self.table, "gateways");
        let members_table = companion(&self.table, "members");
        let lease_history_table = companion(&self.table, "lease_history");
        let lease_history_view = companion(&self.table, "lease_history_writes");
        let runs_table = companion(&self.table, "runs");
        let pool_lease_table = companion(&self.table, "pool_lease");
        let changes_table = companion(&self.table, "changes");
        let changes_writes = companion(&self.table, "changes_writes");
        let changes_deletes = companion(&self.table, "changes_deletes");
        let present = ch
            .present_tables(
                self.schema.as_str(),
                &[
                    self.table.as_str(),
                    &lease_table,
                    &history_table,
                    &history_view,
                    &gateways_table,
                    &members_table,
                    &lease_history_table,
                    &lease_history_view,
                    &runs_table,
                    &pool_lease_table,
                    &changes_table,
                    &changes_writes,
                    &changes_deletes,
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
        if engine_of(&pool_lease_table).is_none() {
            self.pool_leases.ensure_table(&placement).await?;
        }
        self.journal
            .ensure(
                ch,
                (self.schema.as_str(), &self.table),
                &present,
                &placement,
            )
            .await?;
        if engine_of(&gateways_table).is_none() {
            self.gateways.ensure_table(&placement).await?;
        }
        if engine_of(&members_table).is_none() {
            self.members.ensure_table(&placement).await?;
        }
        self.changes
            .ensure(
                engine_of(&changes_table),
                engine_of(&changes_writes).is_some(),
                engine_of(&changes_deletes).is_some(),
                &placement,
            )
            .await?;
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
        let claims_table = companion(&self.table, "claims");
        let pool_claims_table = companion(&self.table, "pool_claims");
        let present = ch
            .present_tables(self.schema.as_str(), &[&claims_table, &pool_claims_table])
            .await?;
        let placement = Placement::new(
            self.layout.cluster.clone(),
            &ch.database_engine(self.schema.as_str()).await?,
        );
        for (name, store) in [
            (&claims_table, &self.claims),
            (&pool_claims_table, &self.pool_claims),
        ] {
            if !present.iter().any(|(table, _)| table == name) {
                store.ensure_table(&placement).await?;
            }
        }
        self.claims.probe().await
    }
}

/// The name of one of the state table's companions, `<table>_<suffix>`.
fn companion(table: &Identifier, suffix: &str) -> String {
    format!("{}_{suffix}", table.as_str())
}

/// The tables' statements together: each table's module makes its own, and
/// all of them must be placed alike.
#[cfg(test)]
mod tests {
    use super::*;

    fn one_node() -> Placement {
        Placement::new(None, "Atomic")
    }

    fn cluster() -> Placement {
        Placement::new(Some(ClusterName::parse("prod-1").unwrap()), "Atomic")
    }

    fn replicated_database() -> Placement {
        Placement::new(Some(ClusterName::parse("default").unwrap()), "Replicated")
    }

    /// Every statement the gateway creates or alters its tables with, as
    /// placed by `placement`.
    fn every_statement(placement: &Placement) -> Vec<String> {
        let retention = Some(std::time::Duration::from_secs(86_400));
        vec![
            state_table::create_table_sql("`m`.`state`", placement),
            lease_rows::create_table_sql("`m`.`state_lease`", placement, LeaseRows::PerId),
            history_table::create_table_sql("`m`.`state_history`", retention, placement),
            history_table::create_view_sql(
                "`m`.`state_history_writes`",
                "`m`.`state`",
                "`m`.`state_history`",
                placement,
            ),
            history_table::retention_sql(
                "`m`.`state_history`",
                retention,
                "MergeTree ORDER BY (state_id, version)",
                placement,
            )
            .unwrap(),
            gateways_table::create_table_sql("`m`.`state_gateways`", placement),
            members_table::create_table_sql("`m`.`state_members`", placement),
            keeper_claims::create_table_sql(
                "`m`.`state_claims`",
                "/statehouse/m/state_claims",
                placement,
            ),
            lease_history::create_table_sql("`m`.`state_lease_history`", retention, placement),
            lease_history::create_view_sql(
                "`m`.`state_lease_history_writes`",
                "`m`.`state_lease`",
                "`m`.`state_lease_history`",
                placement,
            ),
            lease_history::retention_sql(
                "`m`.`state_lease_history`",
                retention,
                "ReplacingMergeTree(version) ORDER BY (state_id, lease_id)",
                placement,
            )
            .unwrap(),
            lease_rows::create_table_sql("`m`.`state_pool_lease`", placement, LeaseRows::PerLease),
            keeper_claims::create_table_sql(
                "`m`.`state_pool_claims`",
                "/statehouse/m/state_pool_claims",
                placement,
            ),
        ]
    }

    fn engine(statement: &str) -> Option<&str> {
        let rest = statement.split("ENGINE = ").nth(1)?;
        Some(&rest[..rest.find('(')?])
    }

    #[test]
    fn on_one_node_every_table_is_plain() {
        let statements = every_statement(&one_node());
        let engines: Vec<_> = statements.iter().filter_map(|s| engine(s)).collect();
        assert_eq!(
            engines,
            [
                "ReplacingMergeTree",
                "ReplacingMergeTree",
                "MergeTree",
                "ReplacingMergeTree",
                "ReplacingMergeTree",
                "KeeperMap",
                "ReplacingMergeTree",
                "ReplacingMergeTree",
                "KeeperMap"
            ]
        );
        for statement in &statements {
            assert!(!statement.contains("ON CLUSTER"), "{statement}");
        }
        assert!(statements[0].contains("ReplacingMergeTree(updated_at) ORDER BY state_id"));
        assert!(statements[1].contains("ReplacingMergeTree(version)"));
    }

    #[test]
    fn with_a_cluster_every_statement_is_on_it_and_every_merge_tree_replicated() {
        let statements = every_statement(&cluster());
        let engines: Vec<_> = statements.iter().filter_map(|s| engine(s)).collect();
        assert_eq!(
            engines,
            [
                "ReplicatedReplacingMergeTree",
                "ReplicatedReplacingMergeTree",
                "ReplicatedMergeTree",
                "ReplicatedReplacingMergeTree",
                "ReplicatedReplacingMergeTree",
                "KeeperMap",
                "ReplicatedReplacingMergeTree",
                "ReplicatedReplacingMergeTree",
                "KeeperMap"
            ]
        );
        for statement in &statements {
            // Right after the statement's table, once.
            assert_eq!(
                statement.matches("` ON CLUSTER 'prod-1' ").count(),
                1,
                "{statement}"
            );
        }
        assert!(
            statements[0]
                .contains("ENGINE = ReplicatedReplacingMergeTree(updated_at) ORDER BY state_id")
        );
        assert!(statements[1].contains("ENGINE = ReplicatedReplacingMergeTree(version)"));
        assert!(
            statements[2]
                .contains("ENGINE = ReplicatedMergeTree() ORDER BY (state_id, version) TTL")
        );
        assert!(statements[3].starts_with(
            "CREATE MATERIALIZED VIEW IF NOT EXISTS `m`.`state_history_writes` ON CLUSTER 'prod-1' TO `m`.`state`"
        ));
        assert!(
            statements[7]
                .contains("ENGINE = KeeperMap('/statehouse/m/state_claims') PRIMARY KEY state_id")
        );
    }

    #[test]
    fn in_a_replicated_database_nothing_is_on_cluster_and_every_merge_tree_replicated() {
        for placement in [replicated_database(), Placement::new(None, "Replicated")] {
            let statements = every_statement(&placement);
            let engines: Vec<_> = statements.iter().filter_map(|s| engine(s)).collect();
            assert_eq!(
                engines,
                [
                    "ReplicatedReplacingMergeTree",
                    "ReplicatedReplacingMergeTree",
                    "ReplicatedMergeTree",
                    "ReplicatedReplacingMergeTree",
                    "ReplicatedReplacingMergeTree",
                    "KeeperMap",
                    "ReplicatedReplacingMergeTree",
                    "ReplicatedReplacingMergeTree",
                    "KeeperMap"
                ]
            );
            for statement in &statements {
                assert!(!statement.contains("ON CLUSTER"), "{statement}");
            }
            assert!(placement.replicated());
        }
    }
}
