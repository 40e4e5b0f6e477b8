//! JSON that keeps the client's text. serde_json, even with
//! `arbitrary_precision`, rewrites a number's exponent (`1E5` answers `1e+5`)
//! and re-escapes strings, and its maps keep only the last of two equal keys.
//! Here every string, number, `true`, `false` and `null` keeps its exact text,
//! and objects are opened up, since merging and the duplicate-key check need
//! their keys. Arrays are kept whole, as text: Meltano's merge replaces a
//! list and never looks inside, and a tree node per element would cost
//! memory out of all proportion to a body of many small values (`[0,0,...]`
//! is two bytes a value). Every object in them is still checked for a key
//! given twice. So are objects below the depth at which a state document's
//! bookmarks lie (`singer_state.bookmarks.<stream>`, see [`OPENED_DEPTH`]):
//! nothing reads into them, a merge opens them when it must, and a tree
//! node per level would cost memory out of all proportion to a body of
//! deeply nested objects. Only the whitespace between tokens is dropped,
//! and the keys of opened objects are written in serde_json's escaping.

use indexmap::IndexMap;
use serde::{Serialize, Serializer};
use serde_json::value::RawValue;

/// serde_json's own limit when it builds values; the scan recurses, so it needs one too.
pub(super) const MAX_DEPTH: usize = 128;

/// Objects are opened up to this many levels in: a document, its halves,
/// `singer_state`, `bookmarks`, each stream's bookmark. Deeper ones are kept
/// as text.
pub(super) const OPENED_DEPTH: usize = 5;

#[derive(Clone, Debug)]
pub enum Json {
    /// Boxed: a value is then as small as a text, and most values are texts.
    Object(Box<JsonObject>),
    /// A string, number, `true`, `false`, `null`, array or deep object, as
    /// written but for the whitespace between tokens.
    Raw(Box<RawValue>),
}

/// An object's members in their order, each key once.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JsonObject(pub(super) IndexMap<String, Json>);

#[derive(Debug, thiserror::Error)]
pub enum JsonError {
    #[error("{0}")]
    Syntax(serde_json::Error),
    #[error("{0}")]
    NotUtf8(std::str::Utf8Error),
    #[error("arrays and objects are nested more than {MAX_DEPTH} deep")]
    TooDeep,
    #[error("key {key:?} appears twice in {}", place(at))]
    DuplicateKey { key: String, at: String },
    #[error("a string at {} escapes half of a UTF-16 surrogate pair", or_top(at))]
    LoneSurrogate { at: String },
}

/// `at` is the JSON Pointer (RFC 6901) of the object holding the key.
fn place(at: &str) -> String {
    if at.is_empty() {
        "the top-level object".to_owned()
    } else {
        format!("the object at {at}")
    }
}

/// `at` is the JSON Pointer of the string, or of the object for a key.
fn or_top(at: &str) -> &str {
    if at.is_empty() { "the top level" } else { at }
}

impl Json {
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Object(_) => "an object",
            Self::Raw(raw) => match raw.get().as_bytes().first() {
                Some(b'{') => "an object",
                Some(b'[') => "an array",
                Some(b'"') => "a string",
                Some(b't' | b'f') => "a boolean",
                Some(b'n') => "null",
                _ => "a number",
            },
        }
    }

    /// The string's value, if this is a string.
    pub fn as_str(&self) -> Option<String> {
        match self {
            Self::Raw(raw) if raw.get().starts_with('"') => serde_json::from_str(raw.get()).ok(),
            _ => None,
        }
    }

    pub fn is_null(&self) -> bool {
        matches!(self, Self::Raw(raw) if raw.get() == "null")
    }

    /// The member `key` of an opened object; None for a value of another kind.
    pub fn member(&self, key: &str) -> Option<&Json> {
        match self {
            Self::Object(fields) => fields.get(key),
            _ => None,
        }
    }
}

impl PartialEq for Json {
    /// By meaning: an object kept as text equals the same object opened (a
    /// merge opens objects that a parse keeps as text).
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Object(a), Self::Object(b)) => a == b,
            (Self::Raw(a), Self::Raw(b)) => a.get() == b.get(),
            (Self::Object(object), raw @ Self::Raw(_))
            | (raw @ Self::Raw(_), Self::Object(object)) => raw
                .clone()
                .opened()
                .is_ok_and(|opened| &opened == object.as_ref()),
        }
    }
}

impl Serialize for Json {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Object(object) => object.serialize(serializer),
            Self::Raw(raw) => raw.serialize(serializer),
        }
    }
}

impl JsonObject {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn get(&self, key: &str) -> Option<&Json> {
        self.0.get(key)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Json)> {
        self.0.iter()
    }

    pub fn get_mut(&mut self, key: &str) -> Option<&mut Json> {
        self.0.get_mut(key)
    }

    /// Removes `key`, keeping the order of the rest; answers whether it was there.
    pub fn remove(&mut self, key: &str) -> bool {
        self.0.shift_remove(key).is_some()
    }

    /// A new key goes last; an existing one keeps its place and takes the value.
    pub fn insert(&mut self, key: String, value: Json) {
        self.0.insert(key, value);
    }

    /// The compact JSON text, scalars as they were written.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("string keys and raw scalars always serialize")
    }
}

impl IntoIterator for JsonObject {
    type Item = (String, Json);
    type IntoIter = indexmap::map::IntoIter<String, Json>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl Serialize for JsonObject {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(&self.0)
    }
}
