//! The history switch (`--history`), thrown in one place: what the gateway
//! keeps of the past. With history kept, every change is a version in
//! `<table>_history` (whose view writes the state table) and every lease a
//! row in `<table>_lease_history`, and every run in `<table>_runs`; with it
//! off, there are none of these, and the state table is all there is.

use std::sync::Arc;

use super::ddl::Placement;
use super::{
    ClickHouse, History, HistoryStore, Identifier, LastChange, LeaseHistoryStore, RunStore,
    StoreError, companion,
};
use crate::domain::{StateId, Version};

/// The past, kept (`Some`) or not; cheap to clone.
#[derive(Clone)]
pub struct Journal(Option<Arc<Kept>>);

struct Kept {
    /// Each state's versions.
    versions: HistoryStore,
    /// Each id's leases, kept as long as its versions.
    leases: LeaseHistoryStore,
    /// Each id's runs, kept as long as its versions.
    runs: RunStore,
}

impl Journal {
    /// What `history` asks to keep, in the companions of `table`;
    /// `qualified` names a table in the schema.
    pub(super) fn new(
        ch: &ClickHouse,
        history: History,
        table: &Identifier,
        qualified: impl Fn(&str) -> String,
    ) -> Self {
        let History::Kept(retention) = history else {
            return Self(None);
        };
        let named = |suffix: &str| qualified(&companion(table, suffix));
        Self(Some(Arc::new(Kept {
            versions: HistoryStore::new(
                ch.clone(),
                named("history"),
                named("history_writes"),
                qualified(table.as_str()),
                retention,
            ),
            leases: LeaseHistoryStore::new(
                ch.clone(),
                named("lease_history"),
                named("lease_history_writes"),
                named("lease"),
                retention,
            ),
            runs: RunStore::new(ch.clone(), named("runs"), named("history"), retention),
        })))
    }

    /// Whether the past is kept.
    pub fn is_kept(&self) -> bool {
        self.0.is_some()
    }

    /// The states' versions, when they are kept.
    pub fn versions(&self) -> Option<&HistoryStore> {
        self.0.as_ref().map(|kept| &kept.versions)
    }

    /// The ids' past leases, when they are kept.
    pub fn leases(&self) -> Option<&LeaseHistoryStore> {
        self.0.as_ref().map(|kept| &kept.leases)
    }

    /// The ids' runs, when the past is kept.
    pub fn runs(&self) -> Option<&RunStore> {
        self.0.as_ref().map(|kept| &kept.runs)
    }

    /// Whether each stream's newest change regressed it, for the states
    /// listed (see [`HistoryStore::last_changes_regressed`]); none is known
    /// with history off.
    pub async fn last_changes_regressed(
        &self,
        states: &[(&StateId, Version)],
    ) -> Result<Vec<LastChange>, StoreError> {
        match self.versions() {
            Some(versions) => versions.last_changes_regressed(states).await,
            None => Ok(Vec::new()),
        }
    }

    /// Creates what is missing of the journal's tables and views, brings
    /// their TTL to the retention and adds the columns an earlier version
    /// lacked; with history off, nothing. `present` are the tables of
    /// `schema` that exist, with their engines, among them the journal's
    /// companions of `table`. The state and lease tables have their columns
    /// by then (the views read them).
    pub(super) async fn ensure(
        &self,
        ch: &ClickHouse,
        (schema, table): (&str, &Identifier),
        present: &[(String, String)],
        placement: &Placement,
    ) -> Result<(), StoreError> {
        let Some(kept) = &self.0 else {
            return Ok(());
        };
        let Kept {
            versions,
            leases,
            runs,
        } = kept.as_ref();
        let engine_of = |suffix: &str| {
            let name = companion(table, suffix);
            present
                .iter()
                .find(|(table, _)| *table == name)
                .map(|(_, engine)| engine.as_str())
        };
        match engine_of("history") {
            None => versions.ensure_table(placement).await?,
            Some(engine) => {
                versions.ensure_retention(engine, placement).await?;
                let columns = ch.columns(schema, &companion(table, "history")).await?;
                versions.upgrade_table(&columns, placement).await?;
            }
        }
        if engine_of("history_writes").is_none() {
            versions.ensure_view(placement).await?;
        }
        leases
            .ensure(
                engine_of("lease_history"),
                engine_of("lease_history_writes").is_some(),
                placement,
            )
            .await?;
        runs.ensure(engine_of("runs"), placement).await
    }
}
