//! The guard's comparisons: what regresses, what is lost, and what is
//! neither.

use super::*;

fn regressions(before: &StateDocument, after: &StateDocument) -> Vec<Regression> {
    Findings::of(before, after).regressions
}

fn losses(before: &StateDocument, after: &StateDocument) -> Vec<String> {
    Findings::of(before, after).lost_streams()
}

fn doc(json: &str) -> StateDocument {
    StateDocument::from_request(json.as_bytes()).unwrap()
}

fn bookmark(stream: &str, key: &str, value: &str) -> StateDocument {
    doc(&format!(
        r#"{{"completed": {{"singer_state": {{"bookmarks": {{"{stream}": {{"replication_key": "{key}", "replication_key_value": {value}}}}}}}}}}}"#
    ))
}

fn regressed(from: &str, to: &str) -> bool {
    !regressions(&bookmark("s", "k", from), &bookmark("s", "k", to)).is_empty()
}

#[test]
fn timestamps_compare_by_instant_whatever_their_offsets() {
    assert!(regressed(
        r#""2024-05-01T10:00:00Z""#,
        r#""2024-05-01T09:59:59Z""#
    ));
    assert!(!regressed(
        r#""2024-05-01T10:00:00Z""#,
        r#""2024-05-01T10:00:00Z""#
    ));
    // 12:00+02:00 is 10:00Z: the same instant, no regression.
    assert!(!regressed(
        r#""2024-05-01T10:00:00Z""#,
        r#""2024-05-01T12:00:00+02:00""#
    ));
    assert!(regressed(
        r#""2024-05-01T10:00:00Z""#,
        r#""2024-05-01T11:00:00+02:00""#
    ));
    assert!(regressed(
        r#""2024-05-01T10:00:00.500Z""#,
        r#""2024-05-01T10:00:00.49Z""#
    ));
    // A space for the `T`, and no offset (UTC): 04:00Z is earlier.
    assert!(regressed(
        r#""2024-05-01 10:00:00""#,
        r#""2024-04-30T23:00:00-05:00""#
    ));
}

#[test]
fn dates_compare_by_day_and_with_timestamps() {
    assert!(regressed(r#""2024-05-02""#, r#""2024-05-01""#));
    assert!(!regressed(r#""2024-05-01""#, r#""2024-05-02""#));
    assert!(regressed(r#""2024-05-02""#, r#""2024-05-01T23:59:59Z""#));
}

#[test]
fn numbers_compare_by_value_at_full_precision() {
    assert!(regressed("10", "9"));
    assert!(!regressed("9", "10"));
    assert!(!regressed("1e3", "1000.0"));
    assert!(regressed("1.5e3", "1499.9999"));
    assert!(regressed("-1", "-2"));
    assert!(regressed("0", "-0.0001"));
    assert!(!regressed("-0", "0"));
    // Beyond f64: these differ in the 20th digit.
    assert!(regressed("123456789012345678901", "123456789012345678900"));
    assert!(regressed("2E-3", "0.0019999999999999999999"));
}

#[test]
fn other_values_a_changed_key_and_new_or_removed_streams_are_not_regressions() {
    assert!(!regressed(r#""b""#, r#""a""#), "plain strings");
    assert!(!regressed("10", r#""9""#), "a number then a string");
    assert!(regressions(&bookmark("s", "k", "10"), &bookmark("s", "other", "9")).is_empty());
    assert!(regressions(&bookmark("s", "k", "10"), &bookmark("t", "k", "9")).is_empty());
    assert!(regressions(&doc("{}"), &bookmark("s", "k", "9")).is_empty());
}

#[test]
fn partitions_compare_one_by_one_by_context() {
    let state = |a: u32, b: u32| {
        doc(&format!(
            r#"{{"completed": {{"singer_state": {{"bookmarks": {{"orders": {{"partitions": [
                {{"context": {{"shop": "a"}}, "replication_key": "id", "replication_key_value": {a}}},
                {{"context": {{"shop": "b"}}, "replication_key": "id", "replication_key_value": {b}}}
            ]}}}}}}}}}}"#
        ))
    };
    assert!(regressions(&state(5, 5), &state(6, 7)).is_empty());
    let found = regressions(&state(5, 5), &state(6, 4));
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].stream, "orders");
    assert_eq!((found[0].from.get(), found[0].to.get()), ("5", "4"));
    assert_eq!(
        serde_json::to_string(&found[0].context).unwrap(),
        r#"{"shop":"b"}"#
    );
}

#[test]
fn an_allow_header_names_streams_or_all() {
    assert!(AllowedStreams::parse("*").allows("any"));
    let some = AllowedStreams::parse(" orders, users ");
    assert!(some.allows("users") && !some.allows("items"));
    assert_eq!(AllowedStreams::parse(" , "), AllowedStreams::None);
}

#[test]
fn the_effective_state_counts_partial_over_completed() {
    let before = bookmark("s", "k", "10");
    let after = doc(
        r#"{"completed": {"singer_state": {"bookmarks": {"s": {"replication_key": "k", "replication_key_value": 11}}}},
            "partial": {"singer_state": {"bookmarks": {"s": {"replication_key": "k", "replication_key_value": 8}}}}}"#,
    );
    assert_eq!(regressions(&before, &after).len(), 1);
}

fn two_streams() -> StateDocument {
    doc(r#"{"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "id", "replication_key_value": 5},
        "refunds": {"replication_key": "id", "replication_key_value": 7}}}}}"#)
}

#[test]
fn a_stream_gone_or_its_value_gone_or_null_is_lost() {
    let gone = doc(r#"{"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "id", "replication_key_value": 6}}}}}"#);
    let found = Findings::of(&two_streams(), &gone);
    assert_eq!(found.lost_streams(), ["refunds"]);
    assert_eq!(found.losses[0].from.get(), "7");
    assert!(found.regressions.is_empty());
    let valueless = doc(r#"{"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "id", "replication_key_value": null},
        "refunds": {"replication_key": "id"}}}}}"#);
    assert_eq!(losses(&two_streams(), &valueless), ["orders", "refunds"]);
}

#[test]
fn an_emptied_state_loses_every_stream() {
    for empty in [
        "{}",
        r#"{"completed": {}, "partial": {}}"#,
        r#"{"completed": {"singer_state": {"bookmarks": {}}}}"#,
    ] {
        assert_eq!(
            losses(&two_streams(), &doc(empty)),
            ["orders", "refunds"],
            "{empty}"
        );
    }
}

#[test]
fn a_changed_key_a_new_stream_or_a_moved_value_is_no_loss() {
    let after = doc(r#"{"completed": {"singer_state": {"bookmarks": {
        "orders": {"replication_key": "created_at", "replication_key_value": "2024-01-01"},
        "refunds": {"replication_key": "id", "replication_key_value": 3},
        "items": {"replication_key": "id", "replication_key_value": 1}}}}}"#);
    let found = Findings::of(&two_streams(), &after);
    assert!(found.losses.is_empty());
    assert_eq!(
        found.regressed_streams(),
        ["refunds"],
        "backwards is a regression"
    );
    assert!(losses(&doc("{}"), &two_streams()).is_empty());
    // A stream that never had a value has nothing to lose.
    let keyless = doc(r#"{"completed": {"singer_state": {"bookmarks": {"s": {"version": 1}}}}}"#);
    assert!(losses(&keyless, &doc("{}")).is_empty());
}

#[test]
fn a_partition_gone_is_lost_with_its_context_and_value() {
    let state = |partitions: &str| {
        doc(&format!(
            r#"{{"completed": {{"singer_state": {{"bookmarks": {{"orders": {{"partitions": [{partitions}]}}}}}}}}}}"#
        ))
    };
    let a = r#"{"context": {"shop": "a"}, "replication_key": "id", "replication_key_value": 5}"#;
    let b = r#"{"context": {"shop": "b"}, "replication_key": "id", "replication_key_value": 9}"#;
    let before = state(&format!("{a}, {b}"));
    assert!(
        Findings::of(&before, &state(&format!("{b}, {a}")))
            .losses
            .is_empty()
    );
    let found = Findings::of(&before, &state(a));
    assert_eq!(found.losses.len(), 1);
    assert_eq!(found.losses[0].from.get(), "9");
    assert_eq!(
        serde_json::to_string(&found.losses[0].context).unwrap(),
        r#"{"shop":"b"}"#
    );
    assert_eq!(Findings::of(&before, &state("")).losses.len(), 2);
    assert_eq!(Findings::of(&before, &doc("{}")).losses.len(), 2);
    // One bookmark with a value for the stream keeps it.
    let flat = bookmark("orders", "id", "10");
    assert!(Findings::of(&before, &flat).losses.is_empty());
    // And a flat bookmark that moved into partitions with values is kept.
    assert!(Findings::of(&flat, &before).losses.is_empty());
    assert_eq!(losses(&flat, &state("")), ["orders"]);
}

#[test]
fn the_effective_state_is_what_loses() {
    let partial_only = doc(r#"{"completed": {"singer_state": {"bookmarks": {}}},
        "partial": {"singer_state": {"bookmarks": {"s": {"replication_key": "k", "replication_key_value": 1}}}}}"#);
    assert_eq!(losses(&partial_only, &doc(r#"{"completed": {}}"#)), ["s"]);
    let both = doc(
        r#"{"completed": {"singer_state": {"bookmarks": {"s": {"replication_key": "k", "replication_key_value": 1}}}},
        "partial": {"singer_state": {"bookmarks": {"s": {"replication_key": "k", "replication_key_value": 2}}}}}"#,
    );
    assert!(losses(&both, &bookmark("s", "k", "2")).is_empty());
}

#[test]
fn partition_values_are_what_a_loss_names() {
    let before = doc(
        r#"{"completed": {"singer_state": {"bookmarks": {"orders": {"partitions": [
        {"context": {"shop": "a"}, "replication_key": "id", "replication_key_value": 9},
        {"context": {"shop": "b"}, "replication_key_value": null}, 7]}, "flat": {"replication_key_value": 1}}}}}"#,
    );
    let bookmarks = before.bookmarks().unwrap();
    let shown = serde_json::to_value(partition_values(bookmarks.get("orders").unwrap())).unwrap();
    assert_eq!(
        shown,
        serde_json::json!([
            {"context": {"shop": "a"}, "replication_key_value": 9},
            {"context": {"shop": "b"}, "replication_key_value": null},
        ]),
        "a null value is none, and an item that is no object is passed over"
    );
    assert!(partition_values(bookmarks.get("flat").unwrap()).is_none());
    let lost: Vec<Loss> = Findings::of(&before, &doc("{}"))
        .losses
        .into_iter()
        .filter(|l| l.stream == "orders")
        .collect();
    assert_eq!(lost.len(), 1);
    assert_eq!(
        serde_json::to_value(&lost[0]).unwrap()["from"],
        shown[0]["replication_key_value"]
    );
    assert_eq!(
        serde_json::to_value(&lost[0]).unwrap()["context"],
        shown[0]["context"]
    );
}
