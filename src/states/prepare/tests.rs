//! Deciding changes, unit-tested with no I/O.
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
    let unreadable = StoredRow::from_columns(id(), Some("{not json".to_owned()), None, NOW - 10);
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
