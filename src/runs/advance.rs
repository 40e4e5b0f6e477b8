//! Which streams a run moved: each stream's bookmark as the guards read it
//! (its `replication_key_value`, or the whole bookmark when it has none,
//! such as a partitioned one), in the effective state at the run's start
//! and at its end.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use crate::domain::StateDocument;

/// One stream whose bookmark differs between the run's start and end
/// (null: no bookmark).
#[derive(Debug, PartialEq, Serialize)]
pub struct Advance {
    pub stream: String,
    pub from: Value,
    pub to: Value,
}

/// The streams whose bookmark differs from `before` to `after` (None: no
/// state), in stream byte order.
pub fn advanced(before: Option<&StateDocument>, after: Option<&StateDocument>) -> Vec<Advance> {
    let (mut before, after) = (bookmarks(before), bookmarks(after));
    let mut moved = Vec::new();
    for (stream, to) in after {
        let from = before.remove(&stream).unwrap_or(Value::Null);
        if from != to {
            moved.push(Advance { stream, from, to });
        }
    }
    for (stream, from) in before {
        moved.push(Advance {
            stream,
            from,
            to: Value::Null,
        });
    }
    moved.sort_by(|a, b| a.stream.cmp(&b.stream));
    moved
}

fn bookmarks(doc: Option<&StateDocument>) -> BTreeMap<String, Value> {
    let Some(streams) = doc.and_then(StateDocument::bookmarks) else {
        return BTreeMap::new();
    };
    streams
        .iter()
        .map(|(stream, bookmark)| {
            let read = bookmark.member("replication_key_value").unwrap_or(bookmark);
            let value = serde_json::to_value(read).expect("a bookmark always serializes");
            (stream.to_owned(), value)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(orders: &str, customers: &str) -> StateDocument {
        let text = format!(
            r#"{{"singer_state":{{"bookmarks":{{
                "orders":{{"replication_key":"day","replication_key_value":"{orders}"}},
                "customers":{{"replication_key":"id","replication_key_value":"{customers}"}}}}}}}}"#
        );
        StateDocument::from_stored(Some(&text), None).unwrap()
    }

    #[test]
    fn only_the_streams_whose_bookmark_moved_are_named() {
        let before = state("2026-01-01", "9");
        let after = state("2026-01-05", "9");
        assert_eq!(
            advanced(Some(&before), Some(&after)),
            vec![Advance {
                stream: "orders".into(),
                from: "2026-01-01".into(),
                to: "2026-01-05".into(),
            }]
        );
    }

    #[test]
    fn a_state_created_or_deleted_moves_every_stream_from_or_to_null() {
        let after = state("2026-01-05", "9");
        let created = advanced(None, Some(&after));
        assert_eq!(created.len(), 2);
        assert_eq!(created[0].stream, "customers");
        assert_eq!(created[0].from, Value::Null);
        let deleted = advanced(Some(&after), None);
        assert_eq!(deleted[1].to, Value::Null);
    }
}
