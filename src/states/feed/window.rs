//! What the feed knows of the changes table: every change inserted after a
//! point (a [`Window`]), and what a follower at a cursor is delivered from
//! it ([`deliver`]). Pure, so the rules are unit tested without ClickHouse.

use std::collections::HashMap;
use std::time::Duration;

use super::cursor::{FeedCursor, Fingerprint};
use crate::domain::{ETag, Scope, StateId, StatePattern};
use crate::store::{ChangeRead, ChangeRecord};

/// How far behind its read time a reader looks again: a change can become
/// visible this long after its insert time and still be delivered.
pub const RE_READ: Duration = Duration::from_secs(5);

/// One change, as the window keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub id: StateId,
    /// The changed version, milliseconds.
    pub version_ms: i64,
    /// A tombstone.
    pub deleted: bool,
    /// ClickHouse's insert time, microseconds.
    pub seen_us: i64,
}

/// A state's row as last read: what the feed delivers for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Current {
    pub updated_at_ms: i64,
    /// The ETag `GET` sends for this row.
    pub etag: ETag,
}

/// Every change inserted in (`from_us`, `read_at_us`], and the current row
/// of each id among them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Window {
    /// Every change inserted after this is here.
    pub from_us: i64,
    /// ClickHouse's clock at the newest read.
    pub read_at_us: i64,
    /// In insert order.
    pub changes: Vec<Change>,
    /// Each id's row at the newest read that saw one of its changes; None
    /// when it had none.
    pub current: HashMap<StateId, Option<Current>>,
}

/// One delivered change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivered {
    pub id: StateId,
    /// None when deleted.
    pub etag: Option<ETag>,
    pub deleted: bool,
    /// The row's `updated_at`, or the tombstone's version.
    pub updated_at_ms: i64,
    /// The insert time of its newest change: the delay's start.
    pub seen_us: i64,
}

/// What a follower is answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    pub changes: Vec<Delivered>,
    pub cursor: FeedCursor,
}

fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

impl Window {
    /// What one read of every change after `from_us` answered.
    pub fn read(from_us: i64, read: ChangeRead) -> Self {
        let mut window = Self {
            from_us,
            read_at_us: from_us,
            ..Self::default()
        };
        window.merge(from_us, read);
        window
    }

    /// Takes in a read of every change after `from_us` (at least this
    /// window's start): it replaces what the window held after that.
    pub fn merge(&mut self, from_us: i64, read: ChangeRead) {
        let from_us = from_us.max(self.from_us);
        self.changes.retain(|change| change.seen_us <= from_us);
        for record in read.rows {
            let ChangeRecord {
                id,
                version_ms,
                deleted,
                seen_us,
                current,
            } = record;
            if seen_us <= from_us {
                continue;
            }
            let current = current.map(|row| Current {
                updated_at_ms: row.updated_at_ms,
                etag: row.etag(),
            });
            self.current.insert(id.clone(), current);
            self.changes.push(Change {
                id,
                version_ms,
                deleted,
                seen_us,
            });
        }
        self.changes
            .sort_by(|a, b| (a.seen_us, &a.id).cmp(&(b.seen_us, &b.id)));
        self.read_at_us = self.read_at_us.max(read.read_at_us);
    }

    /// Forgets the changes inserted at or before `until_us`.
    pub fn trim(&mut self, until_us: i64) {
        if until_us <= self.from_us {
            return;
        }
        self.from_us = until_us;
        self.changes.retain(|change| change.seen_us > until_us);
        let kept: std::collections::HashSet<&StateId> =
            self.changes.iter().map(|change| &change.id).collect();
        self.current.retain(|id, _| kept.contains(id));
    }

    /// Whether a follower at `cursor` can be answered from here: the window
    /// holds every change after its settled position, and has read at least
    /// as late as the answer that made it (so no row here is older than one
    /// it was delivered).
    pub fn covers(&self, cursor: &FeedCursor) -> bool {
        cursor.settled_us >= self.from_us && cursor.read_at_us <= self.read_at_us
    }
}

/// What a follower at `since` (None: a first call, which delivers nothing)
/// is delivered from `window`, which covers it: the ids under `pattern` and
/// in `scope` changed after it, each once with its current row, at most
/// `limit` of them, and the cursor after them.
pub fn deliver(
    window: &Window,
    since: Option<&FeedCursor>,
    pattern: &StatePattern,
    scope: &Scope,
    limit: usize,
) -> Delivery {
    let mine: Vec<&Change> = window
        .changes
        .iter()
        .filter(|change| pattern.matches(&change.id) && scope.allows(&change.id))
        .collect();
    let Some(since) = since else {
        return Delivery {
            changes: Vec::new(),
            cursor: settle(&mine, window.from_us, window.read_at_us),
        };
    };
    let seen = fingerprint(&mine, since.settled_us, since.read_at_us);
    // A change landed late in (P, R]: deliver from P again.
    let after = if seen == since.fingerprint {
        since.read_at_us
    } else {
        since.settled_us
    };
    // Per id: its newest change, and the insert time of its last one.
    let mut newest: HashMap<&StateId, (&Change, i64)> = HashMap::new();
    for change in mine.iter().filter(|change| change.seen_us > after) {
        let entry = newest.entry(&change.id).or_insert((change, change.seen_us));
        if (change.version_ms, change.deleted) > (entry.0.version_ms, entry.0.deleted) {
            entry.0 = change;
        }
        entry.1 = entry.1.max(change.seen_us);
    }
    let mut ids: Vec<(&StateId, &Change, i64)> = newest
        .into_iter()
        .map(|(id, (change, last_seen))| (id, change, last_seen))
        .collect();
    ids.sort_by(|a, b| (a.2, a.0).cmp(&(b.2, b.0)));
    // Cut after the limit: every id changed up to the last one taken is
    // delivered, and every other has a later change, delivered next time.
    let until = if ids.len() > limit {
        ids.truncate(limit);
        ids.last().map_or(window.read_at_us, |last| last.2)
    } else {
        window.read_at_us
    };
    let changes = ids
        .into_iter()
        .map(|(id, change, last_seen)| delivered(window, id, change, last_seen))
        .collect();
    Delivery {
        changes,
        cursor: settle(&mine, since.settled_us, until),
    }
}

/// The cursor of a reader that has read through `read_at_us`, whose
/// changes up to `settled_us` are delivered: it settles what lies more
/// than [`RE_READ`] behind its read.
fn settle(mine: &[&Change], settled_us: i64, read_at_us: i64) -> FeedCursor {
    let settled_us = settled_us.max(read_at_us - micros(RE_READ)).min(read_at_us);
    FeedCursor {
        settled_us,
        read_at_us,
        fingerprint: fingerprint(mine, settled_us, read_at_us),
    }
}

fn fingerprint(mine: &[&Change], after_us: i64, until_us: i64) -> Fingerprint {
    let mut fingerprint = Fingerprint::default();
    for change in mine
        .iter()
        .filter(|change| change.seen_us > after_us && change.seen_us <= until_us)
    {
        fingerprint.add(&change.id, change.version_ms, change.deleted);
    }
    fingerprint
}

/// The change of `id` to deliver: its current row, unless its newest change
/// is a tombstone at or after that row (the row's DELETE is on its way), or
/// it has no row.
fn delivered(window: &Window, id: &StateId, newest: &Change, last_seen: i64) -> Delivered {
    let current = window.current.get(id).cloned().flatten();
    match current {
        Some(row) if !(newest.deleted && newest.version_ms >= row.updated_at_ms) => Delivered {
            id: id.clone(),
            etag: Some(row.etag),
            deleted: false,
            updated_at_ms: row.updated_at_ms,
            seen_us: last_seen,
        },
        _ => Delivered {
            id: id.clone(),
            etag: None,
            deleted: true,
            updated_at_ms: newest.version_ms,
            seen_us: last_seen,
        },
    }
}

#[cfg(test)]
#[path = "window_tests.rs"]
mod tests;
