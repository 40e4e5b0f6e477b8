use super::json::{Json, JsonError, JsonObject};

/// A Meltano state: `{"completed": {...}, "partial": {...}}`, as Meltano's
/// `MeltanoState.to_dict()` writes it. Strings and numbers keep the text they
/// were sent with and objects their key order (see [`Json`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StateDocument {
    pub completed: JsonObject,
    pub partial: JsonObject,
}

#[derive(Debug, thiserror::Error)]
pub enum DocumentError {
    #[error("body is not valid JSON: {0}")]
    InvalidJson(JsonError),
    #[error("body is not a state document: {0}")]
    NotAState(String),
}

/// One state of a batch write.
#[derive(Clone, Debug)]
pub struct BatchEntry {
    pub state_id: String,
    pub doc: StateDocument,
    /// The entry's `lease_id`, when the state is locked.
    pub lease_id: Option<String>,
}

/// Why a batch is refused: the entry (by index, with its state_id when it
/// has one), or the whole body.
#[derive(Debug, thiserror::Error)]
#[error("{}{error}", entry_name(*.index, .state_id.as_deref()))]
pub struct BatchError {
    pub index: Option<usize>,
    pub state_id: Option<String>,
    pub error: DocumentError,
}

fn entry_name(index: Option<usize>, state_id: Option<&str>) -> String {
    match (index, state_id) {
        (Some(index), Some(id)) => format!("entry {index} (state_id {id:?}): "),
        (Some(index), None) => format!("entry {index}: "),
        _ => String::new(),
    }
}

impl BatchEntry {
    fn parse(item: Json) -> Result<Self, (Option<String>, DocumentError)> {
        let Json::Object(fields) = item else {
            return Err((
                None,
                DocumentError::NotAState(format!("expected an object, got {}", item.kind())),
            ));
        };
        let (doc, others) = StateDocument::from_fields(*fields, &["state_id", "lease_id"])
            .map_err(|e| (None, e))?;
        let text = |name: &str| {
            others
                .iter()
                .find(|(key, _)| key == name)
                .map(|(_, value)| {
                    value.as_str().ok_or_else(|| {
                        DocumentError::NotAState(format!("\"{name}\" must be a string"))
                    })
                })
        };
        let state_id = match text("state_id") {
            Some(Ok(id)) => id,
            Some(Err(e)) => return Err((None, e)),
            None => {
                return Err((
                    None,
                    DocumentError::NotAState("\"state_id\" is missing".into()),
                ));
            }
        };
        let lease_id = text("lease_id")
            .transpose()
            .map_err(|e| (Some(state_id.clone()), e))?;
        Ok(Self {
            state_id,
            doc,
            lease_id,
        })
    }
}

fn parse_body(body: &[u8]) -> Result<Json, DocumentError> {
    Json::parse(body).map_err(document_error)
}

/// A body that should be an array: its items, or None for another kind.
fn parse_items(body: &[u8]) -> Result<Option<Vec<Json>>, DocumentError> {
    Json::parse_items(body).map_err(document_error)
}

fn document_error(err: JsonError) -> DocumentError {
    match err {
        // Valid JSON, but not a document whose meaning is clear.
        JsonError::DuplicateKey { .. } => DocumentError::NotAState(err.to_string()),
        JsonError::Syntax(_)
        | JsonError::NotUtf8(_)
        | JsonError::TooDeep
        | JsonError::LoneSurrogate { .. } => DocumentError::InvalidJson(err),
    }
}

/// Removes `stream` from `half`'s `singer_state.bookmarks`; answers whether it was there.
fn remove_bookmark(half: &mut JsonObject, stream: &str) -> bool {
    let Some(Json::Object(singer)) = half.get_mut("singer_state") else {
        return false;
    };
    let Some(Json::Object(bookmarks)) = singer.get_mut("bookmarks") else {
        return false;
    };
    bookmarks.remove(stream)
}

/// What ClickHouse holds for a state_id is not a state another writer could have meant.
#[derive(Debug, thiserror::Error)]
#[error("stored {column} is not a JSON object: {reason}")]
pub struct CorruptState {
    column: &'static str,
    reason: String,
}

impl StateDocument {
    /// Parses a request body. Absent or `null` halves are empty (Meltano sends
    /// `null` for a state it never set); anything but those two keys is refused
    /// so that a typo cannot silently store an empty state, and so is a key
    /// given twice in any object, where one of the two would silently be lost.
    pub fn from_request(body: &[u8]) -> Result<Self, DocumentError> {
        let value = parse_body(body)?;
        let Json::Object(fields) = value else {
            return Err(DocumentError::NotAState(format!(
                "expected a JSON object with \"completed\" and/or \"partial\", got {}",
                value.kind()
            )));
        };
        Self::from_fields(*fields, &[]).map(|(doc, _)| doc)
    }

    /// A document from an object's `completed` and `partial`, besides which
    /// only the keys in `also` may be there; answers those keys' values too.
    fn from_fields(
        fields: JsonObject,
        also: &[&str],
    ) -> Result<(Self, Vec<(String, Json)>), DocumentError> {
        let mut doc = Self::default();
        let mut others = Vec::new();
        for (key, value) in fields {
            let half = match key.as_str() {
                "completed" => &mut doc.completed,
                "partial" => &mut doc.partial,
                other if also.contains(&other) => {
                    others.push((key, value));
                    continue;
                }
                other => {
                    return Err(DocumentError::NotAState(format!(
                        "unknown field {other:?}; a state document has only \"completed\" and \"partial\""
                    )));
                }
            };
            *half = match value.opened() {
                Ok(object) => object,
                Err(null) if null.is_null() => JsonObject::default(),
                Err(other) => {
                    return Err(DocumentError::NotAState(format!(
                        "\"{key}\" must be a JSON object or null, got {}",
                        other.kind()
                    )));
                }
            };
        }
        Ok((doc, others))
    }

    /// Parses a batch: a JSON array of `{"state_id", "completed", "partial",
    /// "lease_id"}` objects. A bad entry is named by its index.
    pub fn batch_from_request(body: &[u8]) -> Result<Vec<BatchEntry>, BatchError> {
        let whole = |error| BatchError {
            index: None,
            state_id: None,
            error,
        };
        let Some(items) = parse_items(body).map_err(whole)? else {
            return Err(whole(DocumentError::NotAState(
                "expected a JSON array of {\"state_id\", \"completed\", \"partial\"} objects"
                    .into(),
            )));
        };
        items
            .into_iter()
            .enumerate()
            .map(|(index, item)| {
                BatchEntry::parse(item).map_err(|(state_id, error)| BatchError {
                    index: Some(index),
                    state_id,
                    error,
                })
            })
            .collect()
    }

    /// This document without `stream`'s bookmark in either half; None when
    /// neither half has one.
    pub fn without_stream(&self, stream: &str) -> Option<Self> {
        let mut doc = self.clone();
        let removed = [&mut doc.completed, &mut doc.partial]
            .into_iter()
            .map(|half| remove_bookmark(half, stream))
            .fold(false, |any, one| any | one);
        removed.then_some(doc)
    }

    /// Reads the two stored columns; NULL (or empty text) reads back as `{}`.
    pub fn from_stored(
        completed: Option<&str>,
        partial: Option<&str>,
    ) -> Result<Self, CorruptState> {
        Ok(Self {
            completed: stored_object("completed_state", completed)?,
            partial: stored_object("partial_state", partial)?,
        })
    }

    /// Meltano calls a state complete when it has any completed part.
    pub fn is_complete(&self) -> bool {
        !self.completed.is_empty()
    }

    /// Meltano's `StateStoreManager.update`: a complete incoming state replaces
    /// what is stored; an incomplete one deep-merges its partial state into the
    /// stored partial state (incoming values win, lists are replaced) and keeps
    /// the stored completed state.
    pub fn updated_by(current: Option<Self>, incoming: Self) -> Self {
        match current {
            Some(mut current) if !incoming.is_complete() => {
                deep_merge(incoming.partial, &mut current.partial);
                current
            }
            _ => incoming,
        }
    }

    /// The object at `path` in the state as Meltano sees it (the partial
    /// state deep-merged over the completed one, as
    /// `MeltanoState.merge_partial` does), built from the two halves'
    /// objects at `path` alone: None when it is not an object there.
    fn effective_at(&self, path: &[&str]) -> Option<JsonObject> {
        let (mut completed, mut partial) = (Some(&self.completed), Some(&self.partial));
        for key in path {
            (completed, partial) = match partial.and_then(|p| p.get(key)) {
                // A partial object merges into a completed one, or replaces
                // anything else there.
                Some(Json::Object(object)) => (object_at(completed, key), Some(object.as_ref())),
                // Anything else in the partial state replaces the completed one's.
                Some(_) => return None,
                None => (Some(object_at(completed, key)?), None),
            };
        }
        let mut merged = completed.cloned().unwrap_or_default();
        if let Some(partial) = partial {
            deep_merge(partial.clone(), &mut merged);
        }
        Some(merged)
    }

    /// The Singer bookmarks of the effective state, by stream: None when it
    /// has no `singer_state.bookmarks` object.
    pub fn bookmarks(&self) -> Option<JsonObject> {
        self.effective_at(&["singer_state", "bookmarks"])
    }

    /// The streams whose bookmark differs between two versions of a state
    /// (None: no state), in byte order.
    pub fn changed_streams(before: Option<&Self>, after: Option<&Self>) -> Vec<String> {
        let bookmarks = |doc: Option<&Self>| doc.and_then(Self::bookmarks).unwrap_or_default();
        let (before, after) = (bookmarks(before), bookmarks(after));
        let mut changed: Vec<String> = before
            .iter()
            .filter(|(stream, bookmark)| after.get(stream) != Some(bookmark))
            .chain(
                after
                    .iter()
                    .filter(|(stream, _)| before.get(stream).is_none()),
            )
            .map(|(stream, _)| (*stream).to_owned())
            .collect();
        changed.sort();
        changed
    }

    pub fn completed_json(&self) -> String {
        self.completed.to_json()
    }

    pub fn partial_json(&self) -> String {
        self.partial.to_json()
    }
}

/// The object under `key` in `half`, if there is one.
fn object_at<'a>(half: Option<&'a JsonObject>, key: &str) -> Option<&'a JsonObject> {
    match half?.get(key)? {
        Json::Object(object) => Some(object),
        _ => None,
    }
}

/// `meltano.core.utils.merge(src, dest)`: nested objects merge key by key,
/// anything else in `src` (lists included) replaces what `dest` had. Where
/// `dest` holds a non-object under a key that `src` has an object for, Meltano
/// would crash; the incoming object replaces it instead.
fn deep_merge(src: JsonObject, dest: &mut JsonObject) {
    for (key, value) in src {
        // Objects kept as text (see `Json`) are opened where both sides
        // have one, and only there.
        match value.opened() {
            Ok(src_child) => match dest.get_mut(&key).and_then(Json::opened_mut) {
                Some(dest_child) => deep_merge(src_child, dest_child),
                None => dest.insert(key, Json::Object(Box::new(src_child))),
            },
            Err(value) => dest.insert(key, value),
        }
    }
}

fn stored_object(column: &'static str, text: Option<&str>) -> Result<JsonObject, CorruptState> {
    let text = match text {
        None => return Ok(JsonObject::default()),
        Some(t) if t.trim().is_empty() => return Ok(JsonObject::default()),
        Some(t) => t,
    };
    match Json::parse_within(text.as_bytes(), 1) {
        Ok(Json::Object(object)) => Ok(*object),
        Ok(null) if null.is_null() => Ok(JsonObject::default()),
        Ok(other) => Err(CorruptState {
            column,
            reason: format!("found {}", other.kind()),
        }),
        Err(err) => Err(CorruptState {
            column,
            reason: err.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn doc(value: Value) -> StateDocument {
        StateDocument::from_request(value.to_string().as_bytes()).unwrap()
    }

    /// The object as serde_json sees it, to compare with `json!`.
    fn value(object: &JsonObject) -> Value {
        serde_json::from_str(&object.to_json()).unwrap()
    }

    #[test]
    fn bookmarks_come_from_partial_merged_over_completed() {
        let d = doc(json!({
            "completed": {"singer_state": {"bookmarks": {"a": {"v": 1}, "b": {"v": 1}}}},
            "partial": {"singer_state": {"bookmarks": {"b": {"v": 2}, "c": {"v": 3}}}}
        }));
        let bookmarks = d.bookmarks().unwrap();
        assert_eq!(
            value(&bookmarks),
            json!({"a": {"v": 1}, "b": {"v": 2}, "c": {"v": 3}})
        );
        assert_eq!(doc(json!({"completed": {"x": 1}})).bookmarks(), None);
    }

    #[test]
    fn changed_streams_name_every_bookmark_that_came_went_or_moved() {
        let before = doc(json!({"completed": {"singer_state": {"bookmarks": {
            "same": {"v": 1}, "moved": {"v": 1}, "gone": {"v": 1}}}}}));
        let after = doc(json!({
            "completed": {"singer_state": {"bookmarks": {"same": {"v": 1}, "moved": {"v": 1}}}},
            "partial": {"singer_state": {"bookmarks": {"moved": {"v": 2}, "new": {"v": 1}}}}
        }));
        assert_eq!(
            StateDocument::changed_streams(Some(&before), Some(&after)),
            ["gone", "moved", "new"]
        );
        assert_eq!(
            StateDocument::changed_streams(Some(&before), None),
            ["gone", "moved", "same"]
        );
        assert_eq!(
            StateDocument::changed_streams(None, Some(&before)),
            ["gone", "moved", "same"]
        );
        assert!(StateDocument::changed_streams(Some(&after), Some(&after)).is_empty());
    }

    #[test]
    fn parses_both_halves_and_treats_null_or_absent_as_empty() {
        let d = doc(json!({"completed": {"a": 1}, "partial": null}));
        assert_eq!(value(&d.completed), json!({"a": 1}));
        assert!(d.partial.is_empty());
        assert_eq!(doc(json!({})), StateDocument::default());
    }

    #[test]
    fn refuses_what_is_not_a_state_document() {
        for body in [
            "[]",
            "42",
            r#"{"completed": []}"#,
            r#"{"partial": "x"}"#,
            r#"{"singer_state": {}}"#,
        ] {
            assert!(
                matches!(
                    StateDocument::from_request(body.as_bytes()),
                    Err(DocumentError::NotAState(_))
                ),
                "{body}"
            );
        }
        assert!(matches!(
            StateDocument::from_request(b"{"),
            Err(DocumentError::InvalidJson(_))
        ));
    }

    #[test]
    fn numbers_and_strings_keep_their_text_and_keys_their_order() {
        let body = r#"{"completed":{"z":123456789012345678901234567890,"a":0.1000000000000000055511151231257827,"m":1e400,"e":1E5,"s":"\u00e9"}}"#;
        let d = StateDocument::from_request(body.as_bytes()).unwrap();
        assert_eq!(
            d.completed_json(),
            r#"{"z":123456789012345678901234567890,"a":0.1000000000000000055511151231257827,"m":1e400,"e":1E5,"s":"\u00e9"}"#
        );
    }

    #[test]
    fn refuses_a_key_given_twice_at_any_depth() {
        for body in [
            r#"{"completed":{"a":1},"completed":{"b":3}}"#,
            r#"{"completed":{"a":1},"partial":{},"partial":null}"#,
            r#"{"completed":{"singer_state":{"bookmarks":{"s":1,"s":2}}}}"#,
            r#"{"partial":{"list":[{"k":1,"k":1}]}}"#,
        ] {
            let err = StateDocument::from_request(body.as_bytes()).unwrap_err();
            assert!(
                matches!(&err, DocumentError::NotAState(why) if why.contains("appears twice")),
                "{body}: {err}"
            );
        }
    }

    #[test]
    fn a_merge_keeps_the_text_of_what_it_does_not_touch_and_of_what_it_brings() {
        let current = StateDocument::from_request(
            br#"{"completed":{"c":1E5},"partial":{"a":{"x":2.50E+3,"y":1}}}"#,
        )
        .unwrap();
        let incoming =
            StateDocument::from_request(br#"{"partial":{"a":{"y":7e-1},"b":1E0}}"#).unwrap();
        let merged = StateDocument::updated_by(Some(current), incoming);
        assert_eq!(merged.completed_json(), r#"{"c":1E5}"#);
        assert_eq!(
            merged.partial_json(),
            r#"{"a":{"x":2.50E+3,"y":7e-1},"b":1E0}"#
        );
    }

    #[test]
    fn incomplete_update_deep_merges_partial_and_keeps_completed() {
        let current = doc(json!({
            "completed": {"singer_state": {"bookmarks": {"a": 1}}},
            "partial": {"singer_state": {"bookmarks": {"s1": {"ts": 1, "keep": true}, "s2": [1, 2, 3]}}}
        }));
        let incoming = doc(json!({
            "partial": {"singer_state": {"bookmarks": {"s1": {"ts": 2}, "s2": [9], "s3": {"new": 1}}}}
        }));
        let merged = StateDocument::updated_by(Some(current), incoming);
        assert_eq!(
            value(&merged.completed),
            json!({"singer_state": {"bookmarks": {"a": 1}}})
        );
        assert_eq!(
            value(&merged.partial),
            json!({"singer_state": {"bookmarks": {"s1": {"ts": 2, "keep": true}, "s2": [9], "s3": {"new": 1}}}})
        );
    }

    #[test]
    fn complete_update_replaces_everything() {
        let current = doc(json!({"completed": {"a": 1}, "partial": {"p": 1}}));
        let incoming = doc(json!({"completed": {"b": 2}}));
        let merged = StateDocument::updated_by(Some(current), incoming.clone());
        assert_eq!(merged, incoming);
    }

    #[test]
    fn update_of_nothing_stores_the_incoming_state() {
        let incoming = doc(json!({"partial": {"p": {"q": 1}}}));
        assert_eq!(StateDocument::updated_by(None, incoming.clone()), incoming);
    }

    #[test]
    fn object_replaces_a_scalar_it_would_merge_into() {
        let current = doc(json!({"partial": {"k": "scalar"}}));
        let incoming = doc(json!({"partial": {"k": {"x": 1}}}));
        let merged = StateDocument::updated_by(Some(current), incoming);
        assert_eq!(value(&merged.partial), json!({"k": {"x": 1}}));
    }

    #[test]
    fn stored_null_and_empty_read_as_empty_objects() {
        let d = StateDocument::from_stored(None, Some("")).unwrap();
        assert_eq!(d, StateDocument::default());
        let d = StateDocument::from_stored(Some("null"), Some(r#"{"x":1}"#)).unwrap();
        assert!(d.completed.is_empty());
        assert!(StateDocument::from_stored(Some("[1]"), None).is_err());
        assert!(StateDocument::from_stored(Some("{oops"), None).is_err());
        // Another writer's text is read as it is, exponents included.
        let d = StateDocument::from_stored(Some(r#"{"n":1E5}"#), None).unwrap();
        assert_eq!(d.completed_json(), r#"{"n":1E5}"#);
    }
}
