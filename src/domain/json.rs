//! JSON that keeps the client's text. serde_json, even with
//! `arbitrary_precision`, rewrites a number's exponent (`1E5` answers `1e+5`)
//! and re-escapes strings, and its maps keep only the last of two equal keys.
//! Here every string, number, `true`, `false` and `null` keeps its exact text,
//! and objects are opened up, since merging and the duplicate-key check need
//! their keys. Only the whitespace between tokens is dropped, and keys are
//! written in serde_json's escaping.

use indexmap::IndexMap;
use indexmap::map::Entry;
use serde::de::IgnoredAny;
use serde::{Serialize, Serializer};
use serde_json::value::RawValue;

/// serde_json's own limit when it builds values; the scan recurses, so it needs one too.
const MAX_DEPTH: usize = 128;

#[derive(Clone, Debug)]
pub enum Json {
    Object(JsonObject),
    Array(Vec<Json>),
    /// A string, number, `true`, `false` or `null`, as written.
    Scalar(Box<RawValue>),
}

/// An object's members in their order, each key once.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JsonObject(IndexMap<String, Json>);

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
    /// Parses a whole JSON text, refusing an object that has a key twice.
    pub fn parse(text: &[u8]) -> Result<Self, JsonError> {
        // serde_json checks the syntax and says where it fails; the scan
        // below then only has to find the tokens.
        serde_json::from_slice::<IgnoredAny>(text).map_err(JsonError::Syntax)?;
        // Skipping a string does not check its UTF-8; this does.
        let text = std::str::from_utf8(text).map_err(JsonError::NotUtf8)?;
        Scanner {
            text,
            pos: 0,
            depth: 0,
        }
        .value()
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Self::Object(_) => "an object",
            Self::Array(_) => "an array",
            Self::Scalar(raw) => match raw.get().as_bytes().first() {
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
            Self::Scalar(raw) if raw.get().starts_with('"') => serde_json::from_str(raw.get()).ok(),
            _ => None,
        }
    }

    pub fn is_null(&self) -> bool {
        matches!(self, Self::Scalar(raw) if raw.get() == "null")
    }
}

impl PartialEq for Json {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Object(a), Self::Object(b)) => a == b,
            (Self::Array(a), Self::Array(b)) => a == b,
            (Self::Scalar(a), Self::Scalar(b)) => a.get() == b.get(),
            _ => false,
        }
    }
}

impl Serialize for Json {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Object(object) => object.serialize(serializer),
            Self::Array(items) => serializer.collect_seq(items),
            Self::Scalar(raw) => raw.serialize(serializer),
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

/// Walks a text that serde_json has already found to be valid JSON.
struct Scanner<'a> {
    text: &'a str,
    pos: usize,
    depth: usize,
}

/// Where the scan went wrong, as a JSON Pointer built on the way out.
enum ScanError {
    Json(JsonError),
    DuplicateKey { key: String, at: Vec<String> },
    LoneSurrogate { at: Vec<String> },
}

impl ScanError {
    /// Records that the error happened under `step` (a key or an index).
    fn under(self, step: impl FnOnce() -> String) -> Self {
        match self {
            Self::DuplicateKey { key, mut at } => {
                at.push(step());
                Self::DuplicateKey { key, at }
            }
            Self::LoneSurrogate { mut at } => {
                at.push(step());
                Self::LoneSurrogate { at }
            }
            other => other,
        }
    }
}

/// The steps were pushed innermost first.
fn pointer(mut steps: Vec<String>) -> String {
    steps.reverse();
    steps
        .iter()
        .map(|step| format!("/{}", step.replace('~', "~0").replace('/', "~1")))
        .collect()
}

impl From<ScanError> for JsonError {
    fn from(err: ScanError) -> Self {
        match err {
            ScanError::Json(err) => err,
            ScanError::DuplicateKey { key, at } => Self::DuplicateKey {
                key,
                at: pointer(at),
            },
            ScanError::LoneSurrogate { at } => Self::LoneSurrogate { at: pointer(at) },
        }
    }
}

/// serde_json's syntax check passed, so the text cannot end early or hold
/// anything but JSON; this is what the scan answers if it somehow did.
fn truncated() -> ScanError {
    ScanError::Json(JsonError::Syntax(
        <serde_json::Error as serde::de::Error>::custom("JSON text ends unexpectedly"),
    ))
}

impl<'a> Scanner<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    fn skip_blanks(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn value(&mut self) -> Result<Json, JsonError> {
        self.scan_value().map_err(JsonError::from)
    }

    fn scan_value(&mut self) -> Result<Json, ScanError> {
        self.skip_blanks();
        match self.peek() {
            Some(b'{' | b'[') if self.depth == MAX_DEPTH => {
                Err(ScanError::Json(JsonError::TooDeep))
            }
            Some(b'{') => self.nested(Self::object).map(Json::Object),
            Some(b'[') => self.nested(Self::array).map(Json::Array),
            Some(b'"') => {
                let token = self.string()?;
                // Only `\u` escapes can fail to decode once the syntax is valid.
                if token.contains("\\u") && serde_json::from_str::<String>(token).is_err() {
                    return Err(ScanError::LoneSurrogate { at: Vec::new() });
                }
                scalar(token)
            }
            Some(_) => {
                let start = self.pos;
                while !matches!(
                    self.peek(),
                    None | Some(b',' | b']' | b'}' | b' ' | b'\t' | b'\n' | b'\r')
                ) {
                    self.pos += 1;
                }
                scalar(&self.text[start..self.pos])
            }
            None => Err(truncated()),
        }
    }

    fn nested<T>(
        &mut self,
        scan: impl FnOnce(&mut Self) -> Result<T, ScanError>,
    ) -> Result<T, ScanError> {
        self.depth += 1;
        let scanned = scan(self);
        self.depth -= 1;
        scanned
    }

    /// A string token, quotes included. Quotes and backslashes are ASCII, so
    /// stepping bytewise never stops inside a multi-byte character.
    fn string(&mut self) -> Result<&'a str, ScanError> {
        let start = self.pos;
        self.pos += 1;
        loop {
            match self.peek() {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(&self.text[start..self.pos]);
                }
                Some(b'\\') => self.pos += 2,
                Some(_) => self.pos += 1,
                None => return Err(truncated()),
            }
        }
    }

    fn key(&mut self) -> Result<String, ScanError> {
        self.skip_blanks();
        let token = self.string()?;
        if !token.contains('\\') {
            return Ok(token[1..token.len() - 1].to_owned());
        }
        serde_json::from_str(token).map_err(|_| ScanError::LoneSurrogate { at: Vec::new() })
    }

    /// Moves past `byte`, which the syntax check says comes next.
    fn eat(&mut self, byte: u8) -> Result<(), ScanError> {
        self.skip_blanks();
        if self.peek() != Some(byte) {
            return Err(truncated());
        }
        self.pos += 1;
        Ok(())
    }

    /// After a member or element: true if another follows.
    fn more(&mut self, close: u8) -> Result<bool, ScanError> {
        self.skip_blanks();
        match self.peek() {
            Some(b',') => {
                self.pos += 1;
                Ok(true)
            }
            Some(byte) if byte == close => {
                self.pos += 1;
                Ok(false)
            }
            _ => Err(truncated()),
        }
    }

    fn object(&mut self) -> Result<JsonObject, ScanError> {
        self.eat(b'{')?;
        let mut object = IndexMap::new();
        self.skip_blanks();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(JsonObject(object));
        }
        loop {
            let key = self.key()?;
            self.eat(b':')?;
            let value = self.scan_value().map_err(|e| e.under(|| key.clone()))?;
            match object.entry(key) {
                Entry::Occupied(taken) => {
                    return Err(ScanError::DuplicateKey {
                        key: taken.key().clone(),
                        at: Vec::new(),
                    });
                }
                Entry::Vacant(free) => {
                    free.insert(value);
                }
            }
            if !self.more(b'}')? {
                return Ok(JsonObject(object));
            }
        }
    }

    fn array(&mut self) -> Result<Vec<Json>, ScanError> {
        self.eat(b'[')?;
        let mut items = Vec::new();
        self.skip_blanks();
        if self.peek() == Some(b']') {
            self.pos += 1;
            return Ok(items);
        }
        loop {
            let index = items.len();
            items.push(
                self.scan_value()
                    .map_err(|e| e.under(|| index.to_string()))?,
            );
            if !self.more(b']')? {
                return Ok(items);
            }
        }
    }
}

fn scalar(token: &str) -> Result<Json, ScanError> {
    RawValue::from_string(token.to_owned())
        .map(Json::Scalar)
        .map_err(|e| ScanError::Json(JsonError::Syntax(e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(text: &str) -> String {
        match Json::parse(text.as_bytes()).unwrap() {
            Json::Object(object) => object.to_json(),
            other => serde_json::to_string(&other).unwrap(),
        }
    }

    #[test]
    fn scalars_keep_their_exact_text() {
        let text = r#"{"e":1E5,"e2":1e5,"e3":2.5E-3,"e4":1e+5,"big":123456789012345678901234567890,"frac":0.1000000000000000055511151231257827,"neg":-0.0,"s":"\u00e9\/\"\\\n\u0000","u":"ünï 🚀","t":true,"f":false,"n":null}"#;
        assert_eq!(round_trip(text), text);
    }

    #[test]
    fn only_whitespace_between_tokens_is_dropped() {
        assert_eq!(
            round_trip(" {\n \"a\" : [ 1 , { \"b\" :\t\"x y\" } , [ ] ] ,\r\n \"c\" : { } } "),
            r#"{"a":[1,{"b":"x y"},[]],"c":{}}"#
        );
        assert_eq!(round_trip(" [1E5, \"a\"] "), r#"[1E5,"a"]"#);
        assert_eq!(round_trip("7"), "7");
    }

    #[test]
    fn keys_are_decoded_and_keep_their_order() {
        assert_eq!(
            round_trip(r#"{"z":1,"\u0061":2,"m\/n":3}"#),
            r#"{"z":1,"a":2,"m/n":3}"#
        );
    }

    fn duplicate(text: &str) -> (String, String) {
        match Json::parse(text.as_bytes()) {
            Err(JsonError::DuplicateKey { key, at }) => (key, at),
            other => panic!("{text}: {other:?}"),
        }
    }

    #[test]
    fn a_key_twice_in_one_object_is_refused_at_any_depth() {
        assert_eq!(
            duplicate(r#"{"completed":{"a":1},"completed":{"b":3}}"#),
            ("completed".to_owned(), String::new())
        );
        assert_eq!(
            duplicate(r#"{"completed":{"x":{"a":1,"a":1}}}"#),
            ("a".to_owned(), "/completed/x".to_owned())
        );
        assert_eq!(
            duplicate(r#"{"p":[{"ok":1},{"a/b~c":{"k":1,"\u006b":2}}]}"#),
            ("k".to_owned(), "/p/1/a~1b~0c".to_owned())
        );
        let err = Json::parse(br#"{"a":{"b":1,"b":2}}"#).unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"key "b" appears twice in the object at /a"#
        );
        // Equal keys in different objects are fine.
        assert!(Json::parse(br#"{"a":{"k":1},"b":{"k":1},"c":[{"k":1},{"k":2}]}"#).is_ok());
    }

    #[test]
    fn what_serde_json_refuses_is_refused() {
        for text in [
            "",
            "{",
            "{\"a\":1,}",
            "[1 2]",
            "01",
            "1.",
            "\"tab\there\"",
            "{\"a\":1} x",
            "NaN",
        ] {
            assert!(
                matches!(Json::parse(text.as_bytes()), Err(JsonError::Syntax(_))),
                "{text:?}"
            );
        }
        let deep = |n| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert!(Json::parse(deep(MAX_DEPTH).as_bytes()).is_ok());
        assert!(matches!(
            Json::parse(deep(MAX_DEPTH + 1).as_bytes()),
            Err(JsonError::TooDeep)
        ));
        // Far deeper than any stack could recurse: refused, not a crash.
        let bomb = format!("{}1{}", "[{\"a\":".repeat(500_000), "}]".repeat(500_000));
        assert!(matches!(
            Json::parse(bomb.as_bytes()),
            Err(JsonError::TooDeep)
        ));
        assert!(matches!(
            Json::parse(b"\"\xff\""),
            Err(JsonError::NotUtf8(_))
        ));
    }

    #[test]
    fn unpaired_surrogate_escapes_are_refused() {
        assert!(Json::parse(br#"{"ok":"\ud83d\ude80"}"#).is_ok());
        for (text, at) in [
            (r#"{"s":{"x":"\ud800"}}"#, "/s/x"),
            (r#"{"s":{"x":["\udc00 after"]}}"#, "/s/x/0"),
            (r#"{"s":{"\ud800":1}}"#, "/s"),
        ] {
            match Json::parse(text.as_bytes()) {
                Err(JsonError::LoneSurrogate { at: found }) => assert_eq!(found, at, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    #[test]
    fn kinds_and_null() {
        let kinds: Vec<&str> = [r#"{}"#, "[]", r#""s""#, "true", "false", "null", "-1E5"]
            .iter()
            .map(|t| Json::parse(t.as_bytes()).unwrap().kind())
            .collect();
        assert_eq!(
            kinds,
            [
                "an object",
                "an array",
                "a string",
                "a boolean",
                "a boolean",
                "null",
                "a number"
            ]
        );
        assert!(Json::parse(b" null ").unwrap().is_null());
        assert!(!Json::parse(b"\"null\"").unwrap().is_null());
    }
}
