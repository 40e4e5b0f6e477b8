//! `--until`: whether a stream's bookmark in a state's effective state
//! (partial merged over completed) has reached a value, compared as the
//! regression guard compares (`domain::compare_values`): RFC 3339 instants
//! across offsets, dates, numbers by value at full precision. A decision
//! with no I/O, so that it is tested on its own.

use std::cmp::Ordering;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::domain::{Json, JsonObject, StateDocument, compare_values};

/// The value a bookmark must reach, as JSON text: a number, or a string
/// holding an RFC 3339 timestamp or a date.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Until(String);

impl Until {
    /// `10`, `9.5`, `1e3` are numbers; `2024-01-01T00:30:00Z` and
    /// `2024-01-01` are an instant and a date, with or without JSON's quotes
    /// (`"10"` is a string, which no number reaches). Anything the guard could
    /// not order is refused: nothing would ever reach it.
    pub fn parse(raw: &str) -> Result<Self, String> {
        let text = raw.trim();
        let json = match serde_json::from_str::<serde_json::Value>(text) {
            Ok(serde_json::Value::Number(_) | serde_json::Value::String(_)) => text.to_owned(),
            _ => serde_json::Value::String(text.to_owned()).to_string(),
        };
        if compare_values(&json, &json).is_none() {
            return Err(format!(
                "{raw:?} is neither a number nor an RFC 3339 timestamp or date, so no bookmark can reach it"
            ));
        }
        Ok(Self(json))
    }

    pub fn as_json(&self) -> &str {
        &self.0
    }
}

/// Where a stream's bookmark stands against the value.
#[derive(Debug, PartialEq, Eq)]
pub enum Standing {
    /// At or past the value (every partition, for a partitioned bookmark).
    Reached,
    /// Not yet: before it, or no value (no such stream yet).
    Short,
    /// A value the guard cannot order against it (a string against a
    /// number, plain text), as written: no change but a new value helps.
    Incomparable(String),
}

/// Where `stream`'s bookmark in `state` stands against `until`. A
/// partitioned bookmark has reached it when every partition with a value
/// has, and one has.
pub fn standing(state: &StateDocument, stream: &str, until: &Until) -> Standing {
    let Some(Json::Object(bookmark)) = state.bookmarks().and_then(|b| b.get(stream).cloned())
    else {
        return Standing::Short;
    };
    let partitions = bookmark.get("partitions").and_then(Json::items);
    let values: Vec<String> = match partitions {
        Some(partitions) => partitions
            .iter()
            .filter_map(|p| match p {
                Json::Object(p) => value(p),
                Json::Raw(_) => None,
            })
            .collect(),
        None => value(&bookmark).into_iter().collect(),
    };
    if values.is_empty() {
        return Standing::Short;
    }
    for value in values {
        match compare_values(&value, until.as_json()) {
            Some(Ordering::Less) => return Standing::Short,
            Some(_) => {}
            None => return Standing::Incomparable(value),
        }
    }
    Standing::Reached
}

/// A bookmark's (or partition's) `replication_key_value`, as written.
fn value(bookmark: &JsonObject) -> Option<String> {
    match bookmark.get("replication_key_value")? {
        Json::Raw(text) => Some(text.get().to_owned()),
        Json::Object(_) => None,
    }
}

/// The halves of a `GET /v1/states/{id}` answer, kept as written so that
/// numbers keep every digit.
#[derive(Deserialize)]
struct Answer<'a> {
    /// The completed half, null or absent for none.
    #[serde(borrow)]
    completed: Option<&'a RawValue>,
    /// The partial half, null or absent for none.
    #[serde(borrow)]
    partial: Option<&'a RawValue>,
}

/// The state a `GET /v1/states/{id}` answer carries.
pub fn state_of(body: &[u8]) -> Result<StateDocument, String> {
    let answer: Answer<'_> =
        serde_json::from_slice(body).map_err(|e| format!("an unreadable state: {e}"))?;
    let half = |raw: Option<&RawValue>| raw.map_or("null", RawValue::get).to_owned();
    let document = format!(
        r#"{{"completed":{},"partial":{}}}"#,
        half(answer.completed),
        half(answer.partial)
    );
    StateDocument::from_request(document.as_bytes())
        .map_err(|e| format!("an unreadable state: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(completed: &str, partial: &str) -> StateDocument {
        state_of(
            format!(
                r#"{{"state_id": "x", "completed": {completed}, "partial": {partial}, "updated_at": "2024-01-01T00:00:00.000Z"}}"#
            )
            .as_bytes(),
        )
        .unwrap()
    }

    fn at(value: &str) -> StateDocument {
        state(
            &format!(
                r#"{{"singer_state": {{"bookmarks": {{"s": {{"replication_key": "k", "replication_key_value": {value}}}}}}}}}"#
            ),
            "null",
        )
    }

    fn until(raw: &str) -> Until {
        Until::parse(raw).unwrap()
    }

    #[test]
    fn instants_compare_across_offsets() {
        let two_am_plus_two = at(r#""2024-01-01T02:00:00+02:00""#);
        // 02:00+02:00 is 00:00Z: short of 00:30Z, past 23:30Z the day before.
        assert_eq!(
            standing(&two_am_plus_two, "s", &until("2024-01-01T00:30:00Z")),
            Standing::Short
        );
        assert_eq!(
            standing(&two_am_plus_two, "s", &until("2023-12-31T23:30:00Z")),
            Standing::Reached
        );
        assert_eq!(
            standing(&two_am_plus_two, "s", &until("2024-01-01T00:00:00Z")),
            Standing::Reached,
            "the same instant is reached"
        );
        assert_eq!(
            standing(
                &at(r#""2024-01-01T02:30:00+02:00""#),
                "s",
                &until("2024-01-01T00:30:00Z")
            ),
            Standing::Reached
        );
        assert_eq!(
            standing(
                &at(r#""2024-01-02""#),
                "s",
                &until(r#""2024-01-01T23:59:59Z""#)
            ),
            Standing::Reached,
            "a date against an instant, the value quoted or not"
        );
    }

    #[test]
    fn numbers_compare_by_value() {
        assert_eq!(standing(&at("10"), "s", &until("9.5")), Standing::Reached);
        assert_eq!(standing(&at("9.5"), "s", &until("10")), Standing::Short);
        assert_eq!(
            standing(&at("1E1"), "s", &until("10.000")),
            Standing::Reached
        );
        assert_eq!(
            standing(
                &at("123456789012345678900"),
                "s",
                &until("123456789012345678901")
            ),
            Standing::Short,
            "beyond f64"
        );
        // A bookmark written as a string is not a number: the guard does not
        // order the two, and neither does wait.
        assert_eq!(
            standing(&at(r#""10""#), "s", &until("9")),
            Standing::Incomparable(r#""10""#.into())
        );
    }

    #[test]
    fn the_effective_state_counts_partial_over_completed() {
        let completed = r#"{"singer_state": {"bookmarks": {"s": {"replication_key": "k", "replication_key_value": 5}}}}"#;
        let partial = r#"{"singer_state": {"bookmarks": {"s": {"replication_key": "k", "replication_key_value": 12}}}}"#;
        assert_eq!(
            standing(&state(completed, partial), "s", &until("10")),
            Standing::Reached
        );
        assert_eq!(
            standing(&state(completed, "null"), "s", &until("10")),
            Standing::Short
        );
    }

    #[test]
    fn a_missing_stream_or_value_is_short() {
        assert_eq!(standing(&at("10"), "other", &until("1")), Standing::Short);
        assert_eq!(
            standing(&state("{}", "{}"), "s", &until("1")),
            Standing::Short
        );
        let no_value = state(
            r#"{"singer_state": {"bookmarks": {"s": {"replication_key": "k"}}}}"#,
            "null",
        );
        assert_eq!(standing(&no_value, "s", &until("1")), Standing::Short);
    }

    #[test]
    fn partitions_all_reach_it() {
        let partitions = |a: u32, b: u32| {
            state(
                &format!(
                    r#"{{"singer_state": {{"bookmarks": {{"s": {{"partitions": [
                        {{"context": {{"shop": "a"}}, "replication_key": "id", "replication_key_value": {a}}},
                        {{"context": {{"shop": "b"}}, "replication_key": "id", "replication_key_value": {b}}}
                    ]}}}}}}}}"#
                ),
                "null",
            )
        };
        assert_eq!(
            standing(&partitions(7, 9), "s", &until("8")),
            Standing::Short
        );
        assert_eq!(
            standing(&partitions(8, 9), "s", &until("8")),
            Standing::Reached
        );
    }

    #[test]
    fn values_nothing_could_reach_are_refused() {
        assert_eq!(until("10").as_json(), "10");
        assert_eq!(until("2024-01-01").as_json(), r#""2024-01-01""#);
        assert_eq!(until(r#""2024-01-01""#).as_json(), r#""2024-01-01""#);
        for bad in ["soon", r#""10""#, "true", "null", "[1]", "", "2024-13-01"] {
            assert!(Until::parse(bad).is_err(), "{bad}");
        }
    }
}
