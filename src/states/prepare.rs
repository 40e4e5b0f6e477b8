//! Deciding a change, with no I/O: from the id's current row, the change
//! and the policy (If-Match, the bookmark guard), what goes out to
//! ClickHouse, or why nothing may. Every change of the API (PUT, PATCH,
//! DELETE, rollback, stream reset, bulk import) is decided here, so each
//! rule of a write is written once.

use crate::domain::{
    AllowedRegressions, IfMatch, Regression, RegressionMode, StateDocument, StateId, Version,
    regressions,
};
use crate::store::{Operation, StoredRow, StoredState, next_version};

use super::error::StateError;

/// What a request asks to do to one state.
pub enum Change {
    /// Meltano `set` (PUT): the document replaces the state.
    Replace(StateDocument),
    /// Meltano `update` (PATCH): see [`StateDocument::updated_by`]; a
    /// missing state is created.
    Update(StateDocument),
    /// Remove one stream's bookmark from both halves of an existing state.
    ResetStream(String),
    /// Delete the state; deleting what does not exist changes nothing.
    Delete,
    /// Delete it as one match of a delete by pattern: as `Delete`, but so
    /// recorded in its history.
    DeleteByPattern,
    /// Roll back to a version: its document, or None for a tombstone.
    Restore(Option<StateDocument>),
    /// One entry of a bulk import: replaces the state, as a PUT does.
    Import(StateDocument),
}

impl Change {
    pub fn operation(&self) -> Operation {
        match self {
            Self::Replace(_) => Operation::Put,
            Self::Update(_) => Operation::Patch,
            Self::ResetStream(_) => Operation::ResetStream,
            Self::Delete => Operation::Delete,
            Self::DeleteByPattern => Operation::DeleteByPattern,
            Self::Restore(_) => Operation::Rollback,
            Self::Import(_) => Operation::Import,
        }
    }

    /// Rollbacks and stream resets are deliberate: a bookmark they move
    /// backwards is recorded, never refused.
    fn refusable(&self) -> bool {
        matches!(self, Self::Replace(_) | Self::Update(_) | Self::Import(_))
    }
}

/// The rules a change is held to besides the lock's.
pub struct Policy<'a> {
    pub if_match: Option<&'a IfMatch>,
    pub regression: RegressionMode,
    /// `Statehouse-Allow-Regression`: streams whose bookmarks may go back.
    pub allowed: &'a AllowedRegressions,
    /// Whether history is kept (it records each version's changed streams).
    pub history: bool,
}

/// A change decided and ready to go out.
pub struct Prepared {
    pub version: Version,
    pub operation: Operation,
    /// The row the state becomes, with the state as answered; None when
    /// the state goes (a tombstone in history, its row deleted).
    pub written: Option<(StoredRow, StoredState)>,
    /// Empty with history off, which records none.
    pub changed_streams: Vec<String>,
    /// Streams whose bookmarks the change moves backwards (recorded, and
    /// answered in `Statehouse-Bookmark-Regression`).
    pub regressed_streams: Vec<String>,
    /// How many regressions the bookmark guard found (partitions counted one
    /// by one), for the metric.
    pub regressions_found: usize,
    /// Whether the state did not exist before.
    pub created: bool,
}

/// Decides `change` of `id` against its `current` row. `failed` is the
/// version of an earlier write of the id that failed but may have landed,
/// and `now_ms` this gateway's clock: the version stamped comes after both
/// and after the current row's. Answers None when there is nothing to
/// write: a delete of a state that does not exist.
pub fn prepare(
    id: &StateId,
    current: Option<&StoredRow>,
    change: Change,
    policy: &Policy<'_>,
    failed: Option<Version>,
    now_ms: i64,
) -> Result<Option<Prepared>, StateError> {
    if let Some(precondition) = policy.if_match
        && !precondition.holds_for(current.map(StoredRow::etag).as_ref())
    {
        return Err(StateError::precondition_failed(current.is_some()));
    }
    let operation = change.operation();
    let refusable = change.refusable();
    let before = before(current, &change, policy)?;
    let after = match change {
        Change::Replace(doc) | Change::Import(doc) | Change::Restore(Some(doc)) => Some(doc),
        Change::Update(doc) => Some(StateDocument::updated_by(before.clone(), doc)),
        Change::ResetStream(stream) => {
            let Some(before) = &before else {
                return Err(StateError::NotFound(id.as_str().to_owned()));
            };
            Some(
                before
                    .without_stream(&stream)
                    .ok_or(StateError::NoBookmark(stream))?,
            )
        }
        Change::Delete | Change::DeleteByPattern | Change::Restore(None) if current.is_none() => {
            return Ok(None);
        }
        Change::Delete | Change::DeleteByPattern | Change::Restore(None) => None,
    };
    let found = match (&after, &before) {
        (Some(after), Some(before)) if policy.regression != RegressionMode::Off => {
            regressions(before, after)
        }
        _ => Vec::new(),
    };
    if refusable
        && policy.regression == RegressionMode::Reject
        && found.iter().any(|r| !policy.allowed.allows(&r.stream))
    {
        return Err(StateError::BookmarkRegression(found));
    }
    let changed_streams = if policy.history {
        StateDocument::changed_streams(before.as_ref(), after.as_ref())
    } else {
        Vec::new()
    };
    let version = next_version(current, failed, now_ms);
    Ok(Some(Prepared {
        version,
        operation,
        written: after.map(|doc| StoredRow::written(id, doc, version)),
        changed_streams,
        regressed_streams: streams_of(&found),
        regressions_found: found.len(),
        created: current.is_none(),
    }))
}

/// The current state, parsed only when the change needs it: PATCH and a
/// stream reset build on it (and refuse one that is unreadable); history's
/// changed streams and the bookmark guard compare against it (an
/// unreadable one, written by something else, changed every stream). A
/// replacement that neither history nor the guard looks at needs none.
fn before(
    current: Option<&StoredRow>,
    change: &Change,
    policy: &Policy<'_>,
) -> Result<Option<StateDocument>, StateError> {
    let Some(current) = current else {
        return Ok(None);
    };
    let lenient = || current.clone().parse().ok().map(|s| s.doc);
    Ok(match change {
        Change::Update(_) | Change::ResetStream(_) => Some(current.clone().parse()?.doc),
        Change::Replace(_) | Change::Import(_) | Change::Restore(Some(_))
            if !policy.history && policy.regression == RegressionMode::Off =>
        {
            None
        }
        Change::Delete | Change::DeleteByPattern | Change::Restore(None) if !policy.history => None,
        _ => lenient(),
    })
}

/// The names of the streams that regressed, each once.
fn streams_of(found: &[Regression]) -> Vec<String> {
    let mut streams: Vec<String> = found.iter().map(|r| r.stream.clone()).collect();
    streams.dedup();
    streams
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const NOW: i64 = 1_800_000_000_000;

    fn id() -> StateId {
        StateId::parse("dev:tap-orders-to-warehouse".to_owned()).unwrap()
    }

    fn doc(value: serde_json::Value) -> StateDocument {
        StateDocument::from_request(value.to_string().as_bytes()).unwrap()
    }

    fn bookmarked(orders: &str) -> StateDocument {
        doc(json!({"completed": {"singer_state": {"bookmarks": {
            "orders": {"replication_key": "updated_at", "replication_key_value": orders},
            "users": {"replication_key": "id", "replication_key_value": 7}
        }}}}))
    }

    fn row(doc: StateDocument, at_ms: i64) -> StoredRow {
        StoredRow::written(&id(), doc, Version::from_millis(at_ms)).0
    }

    fn policy(mode: RegressionMode) -> Policy<'static> {
        Policy {
            if_match: None,
            regression: mode,
            allowed: &AllowedRegressions::None,
            history: true,
        }
    }

    fn decide(current: Option<&StoredRow>, change: Change, policy: &Policy<'_>) -> Prepared {
        match prepare(&id(), current, change, policy, None, NOW) {
            Ok(Some(prepared)) => prepared,
            Ok(None) => panic!("expected a change to commit, got nothing"),
            Err(err) => panic!("expected a change to commit, got {err}"),
        }
    }

    fn written(prepared: &Prepared) -> &StateDocument {
        &prepared.written.as_ref().expect("expected a write").1.doc
    }

    #[test]
    fn a_put_of_a_new_state_creates_it_at_the_clock() {
        let prepared = decide(
            None,
            Change::Replace(bookmarked("2026-01-02")),
            &policy(RegressionMode::Warn),
        );
        assert!(prepared.created);
        assert_eq!(prepared.version, Version::from_millis(NOW));
        assert_eq!(prepared.operation, Operation::Put);
        assert_eq!(prepared.changed_streams, ["orders", "users"]);
    }

    #[test]
    fn the_version_comes_after_the_current_row_and_a_failed_write() {
        let ahead = row(bookmarked("2026-01-01"), NOW + 500);
        let prepared = decide(
            Some(&ahead),
            Change::Replace(bookmarked("2026-01-02")),
            &policy(RegressionMode::Warn),
        );
        assert_eq!(prepared.version, Version::from_millis(NOW + 501));
        let after_failed = prepare(
            &id(),
            None,
            Change::Replace(bookmarked("2026-01-02")),
            &policy(RegressionMode::Warn),
            Some(Version::from_millis(NOW + 900)),
            NOW,
        );
        let Ok(Some(prepared)) = after_failed else {
            panic!("expected a commit");
        };
        assert_eq!(prepared.version, Version::from_millis(NOW + 900));
    }

    #[test]
    fn if_match_refuses_a_stale_etag_and_a_missing_state() {
        let current = row(bookmarked("2026-01-01"), NOW - 10);
        let stale = IfMatch::OneOf(vec!["\"not-it\"".to_owned()]);
        let policy = Policy {
            if_match: Some(&stale),
            ..policy(RegressionMode::Warn)
        };
        for current in [Some(&current), None] {
            let refused = prepare(&id(), current, Change::Delete, &policy, None, NOW);
            assert!(
                matches!(refused, Err(StateError::PreconditionFailed(_))),
                "If-Match must refuse with 412"
            );
        }
    }

    #[test]
    fn if_match_with_the_current_etag_lets_the_change_through() {
        let current = row(bookmarked("2026-01-01"), NOW - 10);
        let matching = IfMatch::OneOf(vec![current.etag().as_str().to_owned()]);
        let policy = Policy {
            if_match: Some(&matching),
            ..policy(RegressionMode::Warn)
        };
        let prepared = decide(
            Some(&current),
            Change::Replace(bookmarked("2026-01-03")),
            &policy,
        );
        assert!(!prepared.created);
    }

    #[test]
    fn a_patch_merges_into_the_current_state() {
        let current = row(
            doc(json!({"completed": {}, "partial": {"a": 1, "b": {"c": 2}}})),
            NOW - 10,
        );
        let prepared = decide(
            Some(&current),
            Change::Update(doc(json!({"partial": {"b": {"d": 3}}}))),
            &policy(RegressionMode::Off),
        );
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&written(&prepared).partial_json()).unwrap(),
            json!({"a": 1, "b": {"c": 2, "d": 3}})
        );
        assert_eq!(prepared.operation, Operation::Patch);
    }

    #[test]
    fn a_delete_of_a_missing_state_changes_nothing() {
        let decided = prepare(
            &id(),
            None,
            Change::Delete,
            &policy(RegressionMode::Warn),
            None,
            NOW,
        );
        assert!(matches!(decided, Ok(None)));
        let restored = prepare(
            &id(),
            None,
            Change::Restore(None),
            &policy(RegressionMode::Warn),
            None,
            NOW,
        );
        assert!(matches!(restored, Ok(None)));
    }

    #[test]
    fn a_delete_is_a_tombstone_naming_every_stream_it_ends() {
        let current = row(bookmarked("2026-01-01"), NOW - 10);
        let prepared = decide(
            Some(&current),
            Change::Delete,
            &policy(RegressionMode::Warn),
        );
        assert!(prepared.written.is_none());
        assert_eq!(prepared.changed_streams, ["orders", "users"]);
        assert_eq!(prepared.operation, Operation::Delete);
        assert!(prepared.regressed_streams.is_empty());
    }

    #[test]
    fn a_rollback_to_a_tombstone_deletes_and_is_a_rollback() {
        let current = row(bookmarked("2026-01-01"), NOW - 10);
        let prepared = decide(
            Some(&current),
            Change::Restore(None),
            &policy(RegressionMode::Warn),
        );
        assert!(prepared.written.is_none());
        assert_eq!(prepared.operation, Operation::Rollback);
    }

    #[test]
    fn a_stream_reset_of_a_missing_state_or_stream_is_refused() {
        let missing = prepare(
            &id(),
            None,
            Change::ResetStream("orders".to_owned()),
            &policy(RegressionMode::Warn),
            None,
            NOW,
        );
        assert!(matches!(missing, Err(StateError::NotFound(_))));
        let current = row(bookmarked("2026-01-01"), NOW - 10);
        let no_stream = prepare(
            &id(),
            Some(&current),
            Change::ResetStream("invoices".to_owned()),
            &policy(RegressionMode::Warn),
            None,
            NOW,
        );
        assert!(matches!(no_stream, Err(StateError::NoBookmark(s)) if s == "invoices"));
    }

    #[test]
    fn a_stream_reset_removes_only_that_stream() {
        let current = row(bookmarked("2026-01-01"), NOW - 10);
        let prepared = decide(
            Some(&current),
            Change::ResetStream("orders".to_owned()),
            &policy(RegressionMode::Reject),
        );
        let bookmarks = written(&prepared).bookmarks().unwrap();
        assert!(bookmarks.get("orders").is_none());
        assert!(bookmarks.get("users").is_some());
        assert_eq!(prepared.changed_streams, ["orders"]);
    }

    #[test]
    fn reject_refuses_a_put_patch_or_import_whose_bookmark_goes_back() {
        let current = row(bookmarked("2026-03-01"), NOW - 10);
        for change in [
            Change::Replace(bookmarked("2026-02-01")),
            Change::Update(bookmarked("2026-02-01")),
            Change::Import(bookmarked("2026-02-01")),
        ] {
            let refused = prepare(
                &id(),
                Some(&current),
                change,
                &policy(RegressionMode::Reject),
                None,
                NOW,
            );
            let Err(StateError::BookmarkRegression(found)) = refused else {
                panic!("a regression must be refused under reject");
            };
            assert_eq!(found[0].stream, "orders");
        }
    }

    #[test]
    fn reject_lets_through_the_streams_a_request_allows() {
        let current = row(bookmarked("2026-03-01"), NOW - 10);
        let allowed = AllowedRegressions::parse("orders");
        let policy = Policy {
            allowed: &allowed,
            ..policy(RegressionMode::Reject)
        };
        let prepared = decide(
            Some(&current),
            Change::Replace(bookmarked("2026-02-01")),
            &policy,
        );
        assert_eq!(prepared.regressed_streams, ["orders"]);
        assert_eq!(prepared.regressions_found, 1);
    }

    #[test]
    fn a_rollback_that_goes_back_is_recorded_never_refused() {
        let current = row(bookmarked("2026-03-01"), NOW - 10);
        let prepared = decide(
            Some(&current),
            Change::Restore(Some(bookmarked("2026-02-01"))),
            &policy(RegressionMode::Reject),
        );
        assert_eq!(prepared.regressed_streams, ["orders"]);
        assert_eq!(prepared.operation, Operation::Rollback);
    }

    #[test]
    fn warn_writes_and_names_the_regressed_streams_off_compares_nothing() {
        let current = row(bookmarked("2026-03-01"), NOW - 10);
        let warned = decide(
            Some(&current),
            Change::Replace(bookmarked("2026-02-01")),
            &policy(RegressionMode::Warn),
        );
        assert_eq!(warned.regressed_streams, ["orders"]);
        let off = decide(
            Some(&current),
            Change::Replace(bookmarked("2026-02-01")),
            &policy(RegressionMode::Off),
        );
        assert!(off.regressed_streams.is_empty());
        assert_eq!(off.regressions_found, 0);
    }

    #[test]
    fn a_patch_of_an_unreadable_state_is_refused_a_put_replaces_it() {
        let unreadable =
            StoredRow::from_columns(id(), Some("{not json".to_owned()), None, NOW - 10);
        let patched = prepare(
            &id(),
            Some(&unreadable),
            Change::Update(bookmarked("2026-01-01")),
            &policy(RegressionMode::Warn),
            None,
            NOW,
        );
        assert!(matches!(patched, Err(StateError::Store(_))));
        let replaced = decide(
            Some(&unreadable),
            Change::Replace(bookmarked("2026-01-01")),
            &policy(RegressionMode::Warn),
        );
        assert!(!replaced.created);
        assert_eq!(replaced.changed_streams, ["orders", "users"]);
    }

    #[test]
    fn with_history_off_no_streams_are_listed() {
        let current = row(bookmarked("2026-01-01"), NOW - 10);
        let policy = Policy {
            history: false,
            ..policy(RegressionMode::Off)
        };
        let prepared = decide(Some(&current), Change::Delete, &policy);
        assert!(prepared.changed_streams.is_empty());
    }
}
