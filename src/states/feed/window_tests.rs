use super::*;
use crate::store::StoredRow;

const S: i64 = 1_000_000;

fn id(name: &str) -> StateId {
    StateId::parse(name.to_owned()).unwrap()
}

fn glob(raw: &str) -> StatePattern {
    StatePattern::parse(raw).unwrap()
}

/// A change of `name` to `version` (a tombstone when `deleted`) inserted at
/// `seen` seconds, read while the state's row was at `row` (None: no row).
fn record(name: &str, version: i64, deleted: bool, seen: i64, row: Option<i64>) -> ChangeRecord {
    ChangeRecord {
        id: id(name),
        version_ms: version,
        deleted,
        seen_us: seen * S,
        current: row.map(|v| StoredRow::from_columns(id(name), Some("{}".into()), None, v)),
    }
}

fn window(from: i64, read_at: i64, rows: Vec<ChangeRecord>) -> Window {
    Window::read(
        from * S,
        ChangeRead {
            read_at_us: read_at * S,
            rows,
        },
    )
}

fn names(delivery: &Delivery) -> Vec<&str> {
    delivery.changes.iter().map(|c| c.id.as_str()).collect()
}

fn all(window: &Window, since: Option<&FeedCursor>) -> Delivery {
    deliver(window, since, &glob("*"), &Scope::everything(), 100)
}

#[test]
fn a_first_call_delivers_nothing_and_settles_what_lies_behind_the_re_read() {
    let w = window(0, 100, vec![record("a", 1, false, 99, Some(1))]);
    let first = all(&w, None);
    assert!(first.changes.is_empty());
    assert_eq!(first.cursor.read_at_us, 100 * S);
    assert_eq!(first.cursor.settled_us, 100 * S - micros(RE_READ));
    assert_eq!(first.cursor.fingerprint.count, 1, "a's change is in (P, R]");
}

#[test]
fn each_id_is_delivered_once_with_its_current_row_and_never_again() {
    let w = window(0, 100, vec![]);
    let start = all(&w, None).cursor;
    let w = window(
        0,
        110,
        vec![
            record("a", 1, false, 101, Some(2)),
            record("a", 2, false, 102, Some(2)),
            record("b", 5, false, 103, Some(5)),
        ],
    );
    let got = all(&w, Some(&start));
    assert_eq!(names(&got), ["a", "b"]);
    assert_eq!(
        got.changes[0].updated_at_ms, 2,
        "the current row, not the first change"
    );
    assert_eq!(got.changes[0].seen_us, 102 * S);
    let again = all(&w, Some(&got.cursor));
    assert!(again.changes.is_empty(), "nothing new: nothing repeated");
}

#[test]
fn a_change_that_lands_late_behind_the_cursor_is_delivered_again_with_its_window() {
    let w = window(0, 110, vec![record("a", 1, false, 108, Some(1))]);
    let start = all(&w, None).cursor;
    // b was inserted at 107 but became visible only after the read at 110.
    let w = window(
        0,
        111,
        vec![
            record("a", 1, false, 108, Some(1)),
            record("b", 3, false, 107, Some(3)),
        ],
    );
    let got = all(&w, Some(&start));
    assert_eq!(names(&got), ["b", "a"], "b is not lost; a repeats");
    assert!(all(&w, Some(&got.cursor)).changes.is_empty());
}

#[test]
fn a_tombstone_delivers_deleted_without_an_etag_even_before_its_row_is_gone() {
    let w = window(0, 100, vec![]);
    let start = all(&w, None).cursor;
    let w = window(
        0,
        110,
        vec![
            record("gone", 7, true, 101, None),
            record("going", 9, true, 102, Some(8)),
            record("back", 11, false, 103, Some(11)),
            record("back", 10, true, 102, Some(11)),
        ],
    );
    let got = all(&w, Some(&start));
    let by_id = |name: &str| got.changes.iter().find(|c| c.id.as_str() == name).unwrap();
    assert!(by_id("gone").deleted && by_id("gone").etag.is_none());
    assert_eq!(by_id("gone").updated_at_ms, 7);
    assert!(by_id("going").deleted, "the row's DELETE is on its way");
    assert!(!by_id("back").deleted, "recreated after its delete");
    assert!(by_id("back").etag.is_some());
}

#[test]
fn only_ids_under_the_glob_and_in_the_scope_are_delivered() {
    let w = window(0, 100, vec![]);
    let start = deliver(&w, None, &glob("prod:*"), &Scope::everything(), 100).cursor;
    let w = window(
        0,
        110,
        vec![
            record("prod:a", 1, false, 101, Some(1)),
            record("prod:b", 1, false, 101, Some(1)),
            record("dev:a", 1, false, 101, Some(1)),
        ],
    );
    let scope = Scope::of(vec![glob("*:a")]);
    let got = deliver(&w, Some(&start), &glob("prod:*"), &scope, 100);
    assert_eq!(names(&got), ["prod:a"]);
}

#[test]
fn a_limit_cuts_in_insert_order_and_the_rest_follows() {
    let w = window(0, 100, vec![]);
    let start = all(&w, None).cursor;
    let w = window(
        0,
        110,
        vec![
            record("a", 1, false, 101, Some(4)),
            record("b", 2, false, 102, Some(2)),
            record("c", 3, false, 103, Some(3)),
            record("a", 4, false, 104, Some(4)),
        ],
    );
    let first = deliver(&w, Some(&start), &glob("*"), &Scope::everything(), 2);
    assert_eq!(
        names(&first),
        ["b", "c"],
        "a's last change is the newest of all"
    );
    assert_eq!(first.cursor.read_at_us, 103 * S);
    let rest = deliver(&w, Some(&first.cursor), &glob("*"), &Scope::everything(), 2);
    assert_eq!(names(&rest), ["a"]);
    assert!(all(&w, Some(&rest.cursor)).changes.is_empty());
}

#[test]
fn merging_a_read_replaces_the_re_read_part_and_trimming_moves_the_start() {
    let mut w = window(
        0,
        100,
        vec![
            record("a", 1, false, 90, Some(1)),
            record("b", 1, false, 99, Some(1)),
        ],
    );
    w.merge(
        95 * S,
        ChangeRead {
            read_at_us: 101 * S,
            rows: vec![
                record("b", 1, false, 99, Some(1)),
                record("c", 1, false, 96, Some(1)),
            ],
        },
    );
    let seen: Vec<&str> = w.changes.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(seen, ["a", "c", "b"]);
    assert_eq!(w.read_at_us, 101 * S);
    w.trim(95 * S);
    assert_eq!(w.from_us, 95 * S);
    assert!(!w.current.contains_key(&id("a")));
    let cursor = |settled: i64, read_at: i64| FeedCursor {
        settled_us: settled * S,
        read_at_us: read_at * S,
        fingerprint: Fingerprint::default(),
        cut: None,
    };
    assert!(w.covers(&cursor(96, 100)));
    assert!(!w.covers(&cursor(94, 100)), "before the start");
    assert!(!w.covers(&cursor(96, 102)), "read later than the window");
}

#[test]
fn one_inserts_ids_share_an_instant_and_a_limit_cuts_between_them_without_a_loss() {
    let w = window(0, 100, vec![]);
    let mut cursor = all(&w, None).cursor;
    let rows = (0..7)
        .map(|n| record(&format!("id{n}"), 1, false, 101, Some(1)))
        .collect();
    let w = window(0, 110, rows);
    let mut seen = Vec::new();
    for _ in 0..4 {
        let got = deliver(&w, Some(&cursor), &glob("*"), &Scope::everything(), 3);
        seen.extend(got.changes.iter().map(|c| c.id.as_str().to_owned()));
        cursor = got.cursor;
    }
    seen.sort();
    let want: Vec<String> = (0..7).map(|n| format!("id{n}")).collect();
    assert_eq!(seen, want, "each once, none lost");
}

#[test]
fn the_cursor_after_each_change_resumes_after_it() {
    let w = window(0, 100, vec![]);
    let start = all(&w, None).cursor;
    let w = window(
        0,
        110,
        vec![
            record("a", 1, false, 101, Some(1)),
            record("b", 1, false, 102, Some(1)),
            record("c", 1, false, 102, Some(1)),
        ],
    );
    let got = all(&w, Some(&start));
    assert_eq!(got.changes.len(), 3);
    assert_eq!(
        got.changes[2].cursor, got.cursor,
        "the last one's is the answer's"
    );
    for (index, change) in got.changes.iter().enumerate() {
        let rest = all(&w, Some(&change.cursor));
        let want: Vec<&str> = names(&got)[index + 1..].to_vec();
        assert_eq!(names(&rest), want, "after {}", change.id.as_str());
    }
}
