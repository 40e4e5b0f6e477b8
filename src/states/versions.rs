//! A state's versions as the API shows them: history pages, one version,
//! the versions that moved bookmarks backwards.

use super::{StateError, States};
use crate::domain::{
    PageLimit, Scope, StateDocument, StateId, StatePattern, Version, VersionCursor,
};
use crate::store::{
    HistoryStore, LastChange, RegressedVersion, Selection, StoreError, StoredVersion, VersionMeta,
};

/// A state's history, as the API shows it.
pub struct HistoryPage {
    pub versions: Vec<ListedVersion>,
    pub has_more: bool,
}

pub struct ListedVersion {
    pub meta: VersionMeta,
    /// The version the state is at now: never one a failed change left.
    pub current: bool,
    /// Its document, when the page was asked with documents (None for a
    /// tombstone).
    pub doc: Option<StateDocument>,
}

impl States {
    pub(super) fn history(&self) -> Result<&HistoryStore, StateError> {
        self.journal.versions().ok_or(StateError::HistoryOff)
    }

    /// Versions of `id`, newest first, each marked whether it is current,
    /// with its document when `documents`.
    pub async fn history_page(
        &self,
        id: &StateId,
        cursor: Option<VersionCursor>,
        limit: PageLimit,
        documents: bool,
    ) -> Result<HistoryPage, StateError> {
        let history = self.history()?;
        let (stored, has_more) = history
            .list(id, cursor.map(|c| c.0), limit.get(), documents)
            .await?;
        let current = self.current_version(history, id).await?;
        let versions = stored
            .into_iter()
            .map(|version| ListedVersion {
                current: current == Some((version.meta.version, version.meta.deleted)),
                meta: version.meta,
                doc: version.doc,
            })
            .collect();
        Ok(HistoryPage { versions, has_more })
    }

    /// The newest versions that moved a stream's bookmark backwards, of the
    /// ids `pattern` matches within `scope`.
    pub async fn regressed_versions(
        &self,
        pattern: StatePattern,
        scope: Scope,
        limit: PageLimit,
    ) -> Result<Vec<RegressedVersion>, StateError> {
        let selection = Selection::Matching(pattern, scope);
        Ok(self.history()?.regressed(&selection, limit.get()).await?)
    }

    /// Whether each stream's newest change regressed it, for the states
    /// listed (none known with history off).
    pub async fn last_changes_regressed(
        &self,
        states: &[(&StateId, Version)],
    ) -> Result<Vec<LastChange>, StoreError> {
        self.journal.last_changes_regressed(states).await
    }

    /// One version of `id` with its document, and whether it is current.
    pub async fn version(
        &self,
        id: &StateId,
        version: Version,
    ) -> Result<Option<(StoredVersion, bool)>, StateError> {
        let history = self.history()?;
        let Some(stored) = history.get(id, version).await? else {
            return Ok(None);
        };
        let current = self.current_version(history, id).await?
            == Some((stored.meta.version, stored.meta.deleted));
        Ok(Some((stored, current)))
    }

    /// The version `id` is at, with whether it is a tombstone: the state's
    /// own version, or, when it does not exist, its newest tombstone.
    async fn current_version(
        &self,
        history: &HistoryStore,
        id: &StateId,
    ) -> Result<Option<(Version, bool)>, StoreError> {
        if let Some(version) = self.store.version(id).await? {
            return Ok(Some((version, false)));
        }
        Ok(history.newest_tombstone(id).await?.map(|v| (v, true)))
    }
}
