//! Deciding a change, with no I/O: from the id's current row, the change
//! and the policy (If-Match, the bookmark guard), what goes out to
//! ClickHouse, or why nothing may. Every change of the API (PUT, PATCH,
//! DELETE, rollback, stream reset, bulk import) is decided here, so each
//! rule of a write is written once.

use crate::domain::{
    Allowed, AllowedStreams, Findings, GuardMode, GuardModes, IfMatch, StateDocument, StateId,
    Version,
};
use crate::store::{Operation, StoredRow, StoredState, next_version};

use super::error::StateError;

/// What a request asks to do to one state.
#[derive(Clone)]
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

    /// Rollbacks, stream resets and deletes are deliberate: a bookmark they
    /// move backwards is recorded, never refused, and one they drop is
    /// neither (dropping bookmarks is what they are for).
    fn refusable(&self) -> bool {
        matches!(self, Self::Replace(_) | Self::Update(_) | Self::Import(_))
    }
}

/// The rules a change is held to besides the lock's.
pub struct Policy<'a> {
    pub if_match: Option<&'a IfMatch>,
    pub guard: GuardModes,
    /// The streams the request lets go back or away.
    pub allowed: &'a Allowed,
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
    /// Streams whose bookmarks the change drops (recorded, and answered in
    /// `Statehouse-Bookmark-Loss`).
    pub lost_streams: Vec<String>,
    /// How many bookmarks it drops (partitions counted one by one), for
    /// the metric.
    pub losses_found: usize,
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
    let found = guarded(before.as_ref(), after.as_ref(), refusable, policy)?;
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
        regressed_streams: found.regressed_streams(),
        regressions_found: found.regressions.len(),
        lost_streams: found.lost_streams(),
        losses_found: found.losses.len(),
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
            if !policy.history && policy.guard == GuardModes::off() =>
        {
            None
        }
        Change::Delete | Change::DeleteByPattern | Change::Restore(None) if !policy.history => None,
        _ => lenient(),
    })
}

/// What the bookmark guard finds in a change, as far as its modes look:
/// refused when a kind in reject mode finds a stream the request does not
/// allow. Losses are looked for only in the changes that may be refused.
fn guarded(
    before: Option<&StateDocument>,
    after: Option<&StateDocument>,
    refusable: bool,
    policy: &Policy<'_>,
) -> Result<Findings, StateError> {
    let (Some(before), Some(after)) = (before, after) else {
        return Ok(Findings::default());
    };
    let GuardModes { regression, loss } = policy.guard;
    let loss = if refusable { loss } else { GuardMode::Off };
    if regression == GuardMode::Off && loss == GuardMode::Off {
        return Ok(Findings::default());
    }
    let mut found = Findings::of(before, after);
    if regression == GuardMode::Off {
        found.regressions.clear();
    }
    if loss == GuardMode::Off {
        found.losses.clear();
    }
    let refused = |mode: GuardMode, allowed: &AllowedStreams, stream: &str| {
        refusable && mode == GuardMode::Reject && !allowed.allows(stream)
    };
    if found
        .regressions
        .iter()
        .any(|r| refused(regression, &policy.allowed.regressions, &r.stream))
    {
        return Err(StateError::BookmarkRegression(found.regressions));
    }
    if found
        .losses
        .iter()
        .any(|l| refused(loss, &policy.allowed.losses, &l.stream))
    {
        return Err(StateError::BookmarkLoss(found.losses));
    }
    Ok(found)
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

    static NONE_ALLOWED: Allowed = Allowed {
        regressions: AllowedStreams::None,
        losses: AllowedStreams::None,
    };

    fn policy(mode: GuardMode) -> Policy<'static> {
        Policy {
            if_match: None,
            guard: GuardModes {
                regression: mode,
                loss: mode,
            },
            allowed: &NONE_ALLOWED,
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
            &policy(GuardMode::Warn),
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
            &policy(GuardMode::Warn),
        );
        assert_eq!(prepared.version, Version::from_millis(NOW + 501));
        let after_failed = prepare(
            &id(),
            None,
            Change::Replace(bookmarked("2026-01-02")),
            &policy(GuardMode::Warn),
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
            ..policy(GuardMode::Warn)
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
            ..policy(GuardMode::Warn)
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
            &policy(GuardMode::Off),
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
            &policy(GuardMode::Warn),
            None,
            NOW,
        );
        assert!(matches!(decided, Ok(None)));
        let restored = prepare(
            &id(),
            None,
            Change::Restore(None),
            &policy(GuardMode::Warn),
            None,
            NOW,
        );
        assert!(matches!(restored, Ok(None)));
    }

    #[test]
    fn a_delete_is_a_tombstone_naming_every_stream_it_ends() {
        let current = row(bookmarked("2026-01-01"), NOW - 10);
        let prepared = decide(Some(&current), Change::Delete, &policy(GuardMode::Warn));
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
            &policy(GuardMode::Warn),
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
            &policy(GuardMode::Warn),
            None,
            NOW,
        );
        assert!(matches!(missing, Err(StateError::NotFound(_))));
        let current = row(bookmarked("2026-01-01"), NOW - 10);
        let no_stream = prepare(
            &id(),
            Some(&current),
            Change::ResetStream("invoices".to_owned()),
            &policy(GuardMode::Warn),
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
            &policy(GuardMode::Reject),
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
                &policy(GuardMode::Reject),
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
        let allowed = Allowed {
            regressions: AllowedStreams::parse("orders"),
            ..Allowed::default()
        };
        let policy = Policy {
            allowed: &allowed,
            ..policy(GuardMode::Reject)
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
    fn reject_refuses_a_loss_unless_allowed_and_a_reset_is_never_one() {
        let current = row(bookmarked("2026-03-01"), NOW - 10);
        let dropped = || doc(json!({"completed": {}}));
        for change in [Change::Replace(dropped()), Change::Import(dropped())] {
            let refused = prepare(
                &id(),
                Some(&current),
                change,
                &policy(GuardMode::Reject),
                None,
                NOW,
            );
            let Err(StateError::BookmarkLoss(found)) = refused else {
                panic!("a loss must be refused under reject");
            };
            assert_eq!(found.len(), 2);
        }
        let allowed = Allowed {
            losses: AllowedStreams::All,
            ..Allowed::default()
        };
        let policy_all = Policy {
            allowed: &allowed,
            ..policy(GuardMode::Reject)
        };
        let through = decide(Some(&current), Change::Replace(dropped()), &policy_all);
        assert_eq!(
            (through.lost_streams.as_slice(), through.losses_found),
            (&["orders".to_owned(), "users".to_owned()][..], 2)
        );
        let reset = decide(
            Some(&current),
            Change::ResetStream("orders".to_owned()),
            &policy(GuardMode::Reject),
        );
        assert!(reset.lost_streams.is_empty(), "a reset is never checked");
    }

    #[test]
    fn a_rollback_that_goes_back_is_recorded_never_refused() {
        let current = row(bookmarked("2026-03-01"), NOW - 10);
        let prepared = decide(
            Some(&current),
            Change::Restore(Some(bookmarked("2026-02-01"))),
            &policy(GuardMode::Reject),
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
            &policy(GuardMode::Warn),
        );
        assert_eq!(warned.regressed_streams, ["orders"]);
        let off = decide(
            Some(&current),
            Change::Replace(bookmarked("2026-02-01")),
            &policy(GuardMode::Off),
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
            &policy(GuardMode::Warn),
            None,
            NOW,
        );
        assert!(matches!(patched, Err(StateError::Store(_))));
        let replaced = decide(
            Some(&unreadable),
            Change::Replace(bookmarked("2026-01-01")),
            &policy(GuardMode::Warn),
        );
        assert!(!replaced.created);
        assert_eq!(replaced.changed_streams, ["orders", "users"]);
    }

    #[test]
    fn with_history_off_no_streams_are_listed() {
        let current = row(bookmarked("2026-01-01"), NOW - 10);
        let policy = Policy {
            history: false,
            ..policy(GuardMode::Off)
        };
        let prepared = decide(Some(&current), Change::Delete, &policy);
        assert!(prepared.changed_streams.is_empty());
    }
}
