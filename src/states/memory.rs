//! What a gateway remembers between writes: the state of ids it is the
//! authority for, and the versions of failed writes. Shared by the request
//! path and the group commit's task, which updates it for every batch,
//! also for a change whose client has gone.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use uuid::Uuid;

use crate::domain::{StateId, Version};
use crate::locks::LockManager;
use crate::store::StoredRow;

pub(super) struct Memory {
    known: Known,
    /// Versions of failed writes whose history rows may have landed (see
    /// [`Memory::failed_version`]); an entry goes with the next write that
    /// lands. Only kept with history on.
    failed: Mutex<HashMap<StateId, Version>>,
    /// When each id was last forgotten (a write of it landed, or may have):
    /// a row read before that may be stale (see [`Memory::untouched_since`]).
    touched: Mutex<Touched>,
    history: bool,
    locks: Arc<LockManager>,
}

/// The last state read or written of ids this gateway is the authority for,
/// each under the claim it was taken under (`LockManager::authority_claim`):
/// once that claim is gone, another gateway may have written, and the entry
/// counts for nothing. `None` is a state known not to exist.
#[derive(Default)]
struct Known {
    rows: Mutex<KnownRows>,
}

#[derive(Default)]
struct KnownRows {
    by_id: HashMap<StateId, (Uuid, Option<StoredRow>)>,
    /// Size after the last sweep of entries whose claim is gone; the next
    /// sweep runs when the map doubles.
    swept_at: usize,
}

/// The ids forgotten lately, and when.
#[derive(Default)]
struct Touched {
    at: HashMap<StateId, Instant>,
    /// Size after the last sweep of entries too old to matter; the next
    /// sweep runs when the map doubles.
    swept_at: usize,
}

/// Larger states are read from ClickHouse each time: a gateway holding many
/// claims must not hold many large documents.
const MAX_KNOWN_BYTES: usize = 1 << 20;

impl Memory {
    pub fn new(history: bool, locks: Arc<LockManager>) -> Self {
        Self {
            known: Known::default(),
            failed: Mutex::default(),
            touched: Mutex::default(),
            history,
            locks,
        }
    }

    /// The row known of `id` under `claim`: `Some(None)` for a state known
    /// not to exist, None when nothing is known.
    pub fn known(&self, id: &StateId, claim: Uuid) -> Option<Option<StoredRow>> {
        let rows = self.known.rows.lock().unwrap_or_else(|p| p.into_inner());
        rows.by_id
            .get(id)
            .filter(|(under, _)| *under == claim)
            .map(|(_, row)| row.clone())
    }

    /// Keeps `row` as `id`'s state under `claim`, unless a write may still
    /// land on the id (one whose outcome is unknown, or another gateway's
    /// under a ticket): until it can no longer, the id is read afresh.
    pub fn keep(&self, id: &StateId, claim: Uuid, row: Option<StoredRow>) {
        let mut rows = self.known.rows.lock().unwrap_or_else(|p| p.into_inner());
        if !self.locks.nothing_landing(id) {
            rows.by_id.remove(id);
            return;
        }
        if row.as_ref().is_some_and(|r| r.size() > MAX_KNOWN_BYTES) {
            rows.by_id.remove(id);
            return;
        }
        rows.by_id.insert(id.clone(), (claim, row));
        if rows.by_id.len() >= 2 * rows.swept_at.max(64) {
            rows.by_id
                .retain(|id, (under, _)| self.locks.authority_claim(id) == Some(*under));
            rows.swept_at = rows.by_id.len();
        }
    }

    /// Forgets each of `ids`: a write of theirs has landed, or may have. A
    /// row of theirs read before now may be stale from now on.
    pub fn forget_each<'a>(&self, ids: impl IntoIterator<Item = &'a StateId>) {
        let mut rows = self.known.rows.lock().unwrap_or_else(|p| p.into_inner());
        let mut touched = self.touched.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        for id in ids {
            rows.by_id.remove(id);
            touched.at.insert(id.clone(), now);
        }
        if touched.at.len() >= 2 * touched.swept_at.max(64) {
            // A row read longer ago than this is never used (`seen_fresh`):
            // older entries decide nothing.
            let fresh = self.locks.seen_fresh();
            touched.at.retain(|_, at| at.elapsed() < fresh);
            touched.swept_at = touched.at.len();
        }
    }

    /// Whether no write of `id` landed, or may have, since `at` (as far as
    /// `seen_fresh` looks back): a row read that was asked for at `at` is
    /// still the id's state as this gateway left it.
    pub fn untouched_since(&self, id: &StateId, at: Instant) -> bool {
        let touched = self.touched.lock().unwrap_or_else(|p| p.into_inner());
        touched.at.get(id).is_none_or(|last| *last < at)
    }

    /// A version whose history row landed but whose state write failed: the
    /// next write of the id on this gateway stamps a later one, so that no
    /// two changes share a version.
    pub fn failed_version(&self, id: &StateId) -> Option<Version> {
        let failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        failed.get(id).map(|v| Version::from_millis(v.millis() + 1))
    }

    pub fn remember_failed(&self, id: &StateId, version: Version) {
        if self.history {
            let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
            failed.insert(id.clone(), version);
        }
    }

    pub fn forget_failed(&self, id: &StateId) {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        if !failed.is_empty() {
            failed.remove(id);
        }
    }
}
