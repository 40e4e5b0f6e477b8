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
    Raw(Text),
}

/// The text of a value kept as written: in place when short, as most values
/// of a state are (numbers, booleans, timestamps), so that they cost no
/// allocation of their own; on the heap otherwise.
#[derive(Clone, Debug)]
pub struct Text(Repr);

#[derive(Clone, Debug)]
enum Repr {
    Inline { len: u8, bytes: [u8; INLINE] },
    Heap(Box<RawValue>),
}

/// The longest text kept in place: a `Text` is then as large as a pointer
/// to a heap one and its length, plus its tag.
const INLINE: usize = 22;

/// `text` in place, if it is short enough.
fn inline(text: &str) -> Option<(u8, [u8; INLINE])> {
    let len = u8::try_from(text.len())
        .ok()
        .filter(|len| usize::from(*len) <= INLINE)?;
    let mut bytes = [0; INLINE];
    bytes[..text.len()].copy_from_slice(text.as_bytes());
    Some((len, bytes))
}

fn inline_str(len: u8, bytes: &[u8; INLINE]) -> &str {
    std::str::from_utf8(&bytes[..usize::from(len)]).expect("copied from a str")
}

impl Text {
    /// `text` is one JSON value, as the scanner checked.
    pub(super) fn new(text: String) -> Result<Self, serde_json::Error> {
        if let Some((len, bytes)) = inline(&text) {
            return Ok(Self(Repr::Inline { len, bytes }));
        }
        RawValue::from_string(text).map(|raw| Self(Repr::Heap(raw)))
    }

    pub fn get(&self) -> &str {
        match &self.0 {
            Repr::Inline { len, bytes } => inline_str(*len, bytes),
            Repr::Heap(raw) => raw.get(),
        }
    }

    /// The text as serde_json's raw value, to be sent on as written.
    pub fn to_raw(&self) -> Box<RawValue> {
        match &self.0 {
            Repr::Inline { .. } => RawValue::from_string(self.get().to_owned())
                .expect("checked as JSON when it was kept"),
            Repr::Heap(raw) => raw.clone(),
        }
    }
}

/// An object's key, decoded: in place when short, as keys nearly always are.
#[derive(Clone, Debug)]
pub struct Key(KeyRepr);

#[derive(Clone, Debug)]
enum KeyRepr {
    Inline { len: u8, bytes: [u8; INLINE] },
    Heap(Box<str>),
}

impl Key {
    pub fn as_str(&self) -> &str {
        match &self.0 {
            KeyRepr::Inline { len, bytes } => inline_str(*len, bytes),
            KeyRepr::Heap(key) => key,
        }
    }
}

impl From<String> for Key {
    fn from(key: String) -> Self {
        Self(match inline(&key) {
            Some((len, bytes)) => KeyRepr::Inline { len, bytes },
            None => KeyRepr::Heap(key.into_boxed_str()),
        })
    }
}

/// Hashed and compared as its text, so that a map of keys is looked up by `&str`.
impl std::hash::Hash for Key {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_str().hash(state);
    }
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for Key {}

impl std::borrow::Borrow<str> for Key {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl Serialize for Key {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl Serialize for Text {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match &self.0 {
            // Borrowed, not copied: short texts are checked again instead.
            Repr::Inline { .. } => serde_json::from_str::<&RawValue>(self.get())
                .map_err(serde::ser::Error::custom)?
                .serialize(serializer),
            Repr::Heap(raw) => raw.serialize(serializer),
        }
    }
}

/// An object's members in their order, each key once.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JsonObject(pub(super) IndexMap<Key, Json>);

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

    /// The object this is, opened; the value itself when it is no object.
    pub fn opened(self) -> Result<JsonObject, Self> {
        match self {
            Self::Object(object) => Ok(*object),
            Self::Raw(raw) if raw.get().starts_with('{') => match Self::parse(raw.get().as_bytes())
            {
                Ok(Self::Object(object)) => Ok(*object),
                // Text that was checked as it was kept always parses.
                _ => Err(Self::Raw(raw)),
            },
            other => Err(other),
        }
    }

    /// The object this is, opened in place; None when it is no object.
    pub fn opened_mut(&mut self) -> Option<&mut JsonObject> {
        if matches!(self, Self::Raw(raw) if raw.get().starts_with('{')) {
            let raw = std::mem::replace(self, Self::Object(Box::default()));
            *self = match raw.opened() {
                Ok(object) => Self::Object(Box::new(object)),
                Err(raw) => raw,
            };
        }
        match self {
            Self::Object(object) => Some(object),
            Self::Raw(_) => None,
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

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Json)> {
        self.0.iter().map(|(key, value)| (key.as_str(), value))
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
        self.0.insert(Key::from(key), value);
    }

    /// The compact JSON text, scalars as they were written.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("string keys and raw scalars always serialize")
    }
}

impl IntoIterator for JsonObject {
    type Item = (String, Json);
    type IntoIter =
        std::iter::Map<indexmap::map::IntoIter<Key, Json>, fn((Key, Json)) -> (String, Json)>;

    fn into_iter(self) -> Self::IntoIter {
        self.0
            .into_iter()
            .map(|(key, value)| (key.as_str().to_owned(), value))
    }
}

impl Serialize for JsonObject {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(&self.0)
    }
}
