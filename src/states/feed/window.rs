//! What the feed knows of the changes table: every change inserted after a
//! point (a [`Window`]), and what a follower at a cursor is delivered from
//! it ([`deliver`]). Pure, so the rules are unit tested without ClickHouse.

use std::collections::HashMap;
use std::time::Duration;

use super::cursor::{FeedCursor, Fingerprint, id_hash};
use crate::domain::{ETag, Scope, StateId, StatePattern};
use crate::store::{ChangeRead, ChangeRecord};

/// How far behind its read time a reader looks again: a change can become
/// visible this long after its insert time and still be delivered.
pub const RE_READ: Duration = Duration::from_secs(5);

/// One change, as the window keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    /// The changed state.
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
    /// Its version, milliseconds.
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
    /// The changed state.
    pub id: StateId,
    /// None when deleted.
    pub etag: Option<ETag>,
    /// Gone: its newest change is a delete, or it has no row.
    pub deleted: bool,
    /// The row's `updated_at`, or the tombstone's version.
    pub updated_at_ms: i64,
    /// The insert time of its newest change: the delay's start.
    pub seen_us: i64,
    /// Where a follower that has this change, and those before it, stands.
    pub cursor: FeedCursor,
}

/// What a follower is answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    /// Each changed id once, in the order of their last changes.
    pub changes: Vec<Delivered>,
    /// Where the follower stands after them all.
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
/// `limit` of them, each with the cursor after it, and the cursor after
/// them all.
pub fn deliver(
    window: &Window,
    since: Option<&FeedCursor>,
    pattern: &StatePattern,
    scope: &Scope,
    limit: usize,
) -> Delivery {
    let mine = Mine::new(window, pattern, scope);
    let Some(since) = since else {
        return Delivery {
            changes: Vec::new(),
            cursor: mine.settle(window.from_us, window.read_at_us, None),
        };
    };
    // A change landed late in (P, R]: deliver from P again.
    let on_time = mine.fingerprint(since.settled_us, since.read_at_us) == since.fingerprint;
    let undelivered = |change: &Change| {
        if !on_time {
            return change.seen_us > since.settled_us;
        }
        change.seen_us > since.read_at_us
            || (change.seen_us == since.read_at_us
                && since.cut.is_some_and(|cut| id_hash(&change.id) > cut))
    };
    // Per id: its newest change, and the insert time of its last one.
    let mut newest: HashMap<&StateId, (&Change, i64)> = HashMap::new();
    for change in mine.changes.iter().copied().filter(|c| undelivered(c)) {
        let entry = newest.entry(&change.id).or_insert((change, change.seen_us));
        if (change.version_ms, change.deleted) > (entry.0.version_ms, entry.0.deleted) {
            entry.0 = change;
        }
        entry.1 = entry.1.max(change.seen_us);
    }
    let mut ids: Vec<(i64, u64, &StateId, &Change)> = newest
        .into_iter()
        .map(|(id, (change, last_seen))| (last_seen, id_hash(id), id, change))
        .collect();
    ids.sort_by(|a, b| (a.0, a.1, a.2).cmp(&(b.0, b.1, b.2)));
    // Cut after the limit: every id whose last change comes up to the last
    // one taken is delivered, every other has a later change, delivered
    // next time. Ids of one hash go together, so the cut never parts them.
    let mut taken = ids.len().min(limit);
    while taken > 0
        && taken < ids.len()
        && (ids[taken].0, ids[taken].1) == (ids[taken - 1].0, ids[taken - 1].1)
    {
        taken += 1;
    }
    let whole = taken == ids.len();
    ids.truncate(taken);
    let last = ids.len();
    let changes: Vec<Delivered> = ids
        .into_iter()
        .enumerate()
        .map(|(index, (last_seen, hash, id, change))| {
            let cursor = if whole && index + 1 == last {
                mine.settle(since.settled_us, window.read_at_us, None)
            } else {
                mine.settle(since.settled_us, last_seen, Some(hash))
            };
            delivered(window, id, change, last_seen, cursor)
        })
        .collect();
    let cursor = match changes.last() {
        Some(change) => change.cursor,
        None => mine.settle(since.settled_us, window.read_at_us, None),
    };
    Delivery { changes, cursor }
}

/// The window's changes under a glob and in a scope, in insert order, with
/// running fingerprints: the fingerprint of any range is a difference.
struct Mine<'a> {
    /// In insert order.
    changes: Vec<&'a Change>,
    /// `running[i]`: the fingerprint of the first `i` changes.
    running: Vec<Fingerprint>,
}

impl<'a> Mine<'a> {
    fn new(window: &'a Window, pattern: &StatePattern, scope: &Scope) -> Self {
        let changes: Vec<&Change> = window
            .changes
            .iter()
            .filter(|change| pattern.matches(&change.id) && scope.allows(&change.id))
            .collect();
        let mut running = Vec::with_capacity(changes.len() + 1);
        let mut sum = Fingerprint::default();
        running.push(sum);
        for change in &changes {
            sum.add(&change.id, change.version_ms, change.deleted);
            running.push(sum);
        }
        Self { changes, running }
    }

    /// The fingerprint of the changes inserted in (`after_us`, `until_us`].
    fn fingerprint(&self, after_us: i64, until_us: i64) -> Fingerprint {
        let upto = |at: i64| self.changes.partition_point(|change| change.seen_us <= at);
        self.running[upto(until_us)].minus(self.running[upto(after_us.min(until_us))])
    }

    /// The cursor of a reader that has read through `read_at_us` (up to
    /// `cut` among the ids last changed then), whose changes up to
    /// `settled_us` are delivered: it settles what lies more than
    /// [`RE_READ`] behind its read.
    fn settle(&self, settled_us: i64, read_at_us: i64, cut: Option<u64>) -> FeedCursor {
        let settled_us = settled_us.max(read_at_us - micros(RE_READ)).min(read_at_us);
        FeedCursor {
            settled_us,
            read_at_us,
            fingerprint: self.fingerprint(settled_us, read_at_us),
            cut,
        }
    }
}

/// The change of `id` to deliver: its current row, unless its newest change
/// is a tombstone at or after that row (the row's DELETE is on its way), or
/// it has no row.
fn delivered(
    window: &Window,
    id: &StateId,
    newest: &Change,
    last_seen: i64,
    cursor: FeedCursor,
) -> Delivered {
    let current = window.current.get(id).cloned().flatten();
    match current {
        Some(row) if !(newest.deleted && newest.version_ms >= row.updated_at_ms) => Delivered {
            id: id.clone(),
            etag: Some(row.etag),
            deleted: false,
            updated_at_ms: row.updated_at_ms,
            seen_us: last_seen,
            cursor,
        },
        _ => Delivered {
            id: id.clone(),
            etag: None,
            deleted: true,
            updated_at_ms: newest.version_ms,
            seen_us: last_seen,
            cursor,
        },
    }
}

#[cfg(test)]
#[path = "window_tests.rs"]
mod tests;
