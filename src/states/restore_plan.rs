//! A restore's plan, with no I/O: for each id, what it is now against what
//! it was at the instant, and so what putting it back does (restore, delete
//! or nothing), with each stream's bookmark from and to.

use std::collections::BTreeMap;

use crate::domain::{Json, StateDocument, StateId, Version};
use crate::store::StoredRow;

/// What a restore does to one id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// The document at the instant becomes a new version (the id is created
    /// again when it was deleted since).
    Restore,
    /// The id did not exist at the instant.
    Delete,
    /// It is as it was.
    Unchanged,
    /// Another holds its lease: left as it is.
    SkippedLocked,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Restore => "restore",
            Self::Delete => "delete",
            Self::Unchanged => "unchanged",
            Self::SkippedLocked => "skipped-locked",
        }
    }
}

/// One stream whose bookmark the restore moves.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamMove {
    pub stream: String,
    /// Its bookmark now (None: the stream has none).
    pub from: Option<Json>,
    /// Its bookmark at the instant.
    pub to: Option<Json>,
}

/// One id of the plan.
#[derive(Clone, Debug)]
pub struct Planned {
    pub id: StateId,
    pub action: Action,
    /// The version it is at now (None: it does not exist).
    pub from_version: Option<Version>,
    /// The version it had at the instant (None: it did not exist).
    pub to_version: Option<Version>,
    pub streams: Vec<StreamMove>,
    /// The document to write back (None for a delete, or nothing to write).
    pub doc: Option<StateDocument>,
}

/// Each id of `now` (the current rows) and `then` (the rows at the
/// instant), in byte order, with what restoring it does. A current row
/// that cannot be read is restored over (it differs from any document).
pub fn plan(now: Vec<StoredRow>, then: Vec<StoredRow>) -> Vec<Planned> {
    let mut ids: BTreeMap<StateId, (Option<StoredRow>, Option<StoredRow>)> = BTreeMap::new();
    for row in now {
        let id = row.id.clone();
        ids.entry(id).or_default().0 = Some(row);
    }
    for row in then {
        let id = row.id.clone();
        ids.entry(id).or_default().1 = Some(row);
    }
    ids.into_iter()
        .map(|(id, (now, then))| planned(id, now, then))
        .collect()
}

fn planned(id: StateId, now: Option<StoredRow>, then: Option<StoredRow>) -> Planned {
    let from_version = now
        .as_ref()
        .map(|row| Version::from_millis(row.updated_at_ms));
    let to_version = then
        .as_ref()
        .map(|row| Version::from_millis(row.updated_at_ms));
    let current = now.and_then(|row| row.parse().ok()).map(|state| state.doc);
    let target = then.and_then(|row| row.parse().ok()).map(|state| state.doc);
    let action = match (&current, &target, from_version) {
        (_, None, _) => Action::Delete,
        (Some(current), Some(target), _) if current == target => Action::Unchanged,
        _ => Action::Restore,
    };
    let streams = if action == Action::Unchanged {
        Vec::new()
    } else {
        moves(current.as_ref(), target.as_ref())
    };
    Planned {
        id,
        action,
        from_version,
        to_version,
        streams,
        doc: target,
    }
}

/// The streams whose bookmark differs between `from` and `to`, in byte order.
fn moves(from: Option<&StateDocument>, to: Option<&StateDocument>) -> Vec<StreamMove> {
    let bookmarks = |doc: Option<&StateDocument>| doc.and_then(StateDocument::bookmarks);
    let (from, to) = (bookmarks(from), bookmarks(to));
    let mut streams: BTreeMap<&str, (Option<&Json>, Option<&Json>)> = BTreeMap::new();
    for (stream, bookmark) in from.iter().flat_map(|b| b.iter()) {
        streams.entry(stream).or_default().0 = Some(bookmark);
    }
    for (stream, bookmark) in to.iter().flat_map(|b| b.iter()) {
        streams.entry(stream).or_default().1 = Some(bookmark);
    }
    streams
        .into_iter()
        .filter(|(_, (from, to))| from != to)
        .map(|(stream, (from, to))| StreamMove {
            stream: stream.to_owned(),
            from: from.cloned(),
            to: to.cloned(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn row(id: &str, at: i64, orders: u64) -> StoredRow {
        let doc = json!({"completed": {"singer_state": {"bookmarks": {
            "orders": {"replication_key_value": orders}, "users": {"replication_key_value": 1}
        }}}});
        let doc = StateDocument::from_request(doc.to_string().as_bytes()).unwrap();
        let id = StateId::parse(id.to_owned()).unwrap();
        StoredRow::written(&id, doc, Version::from_millis(at)).0
    }

    #[test]
    fn each_id_is_restored_deleted_or_left() {
        let now = vec![row("a", 30, 3), row("b", 20, 1), row("d", 10, 4)];
        let then = vec![row("a", 5, 2), row("c", 6, 5), row("d", 10, 4)];
        let planned = plan(now, then);
        let actions: Vec<(&str, Action)> =
            planned.iter().map(|p| (p.id.as_str(), p.action)).collect();
        assert_eq!(
            actions,
            [
                ("a", Action::Restore),
                ("b", Action::Delete),
                ("c", Action::Restore),
                ("d", Action::Unchanged),
            ]
        );
        let a = &planned[0];
        assert_eq!(a.from_version, Some(Version::from_millis(30)));
        assert_eq!(a.to_version, Some(Version::from_millis(5)));
        let streams: Vec<&str> = a.streams.iter().map(|s| s.stream.as_str()).collect();
        assert_eq!(streams, ["orders"], "only the streams that move");
        assert_eq!(planned[1].streams.len(), 2, "a delete drops every stream");
        assert!(planned[1].doc.is_none());
        assert_eq!(planned[2].from_version, None, "c comes back");
        assert!(planned[3].streams.is_empty());
    }
}
