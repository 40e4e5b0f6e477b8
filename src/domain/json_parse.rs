//! Reading JSON text into [`Json`]: serde_json checks the syntax, then a
//! scanner finds the tokens, refuses a key given twice and unpaired
//! surrogate escapes, opens objects down to the bookmarks and keeps
//! arrays and deeper objects as text (see `json` for why).

use std::collections::HashSet;

use indexmap::IndexMap;
use indexmap::map::Entry;
use serde::de::IgnoredAny;

use super::json::{Json, JsonError, JsonObject, Key, MAX_DEPTH, OPENED_DEPTH, Text};

impl Json {
    /// Parses a whole JSON text, refusing an object that has a key twice.
    pub fn parse(text: &[u8]) -> Result<Self, JsonError> {
        Self::parse_within(text, 0)
    }

    /// Parses a value that lies `level` levels into a document (a stored
    /// half is one), opening its objects as far as the document's would be.
    pub fn parse_within(text: &[u8], level: usize) -> Result<Self, JsonError> {
        Scanner::checked(text, OPENED_DEPTH.saturating_sub(level))?.value()
    }

    /// Parses a whole JSON text that should be an array, each item as
    /// [`Json::parse`] would parse it; None for a text of another kind.
    pub fn parse_items(text: &[u8]) -> Result<Option<Vec<Self>>, JsonError> {
        // Each item is a document, one level in.
        let mut scanner = Scanner::checked(text, OPENED_DEPTH + 1)?;
        scanner.skip_blanks();
        if scanner.peek() != Some(b'[') {
            return Ok(None);
        }
        scanner
            .nested(Scanner::items)
            .map(Some)
            .map_err(JsonError::from)
    }

    /// An array's items, opened as [`Json::parse`] opens a value; None for
    /// a value of another kind.
    pub fn items(&self) -> Option<Vec<Self>> {
        match self {
            Self::Raw(raw) if raw.get().starts_with('[') => Scanner {
                text: raw.get(),
                pos: 0,
                depth: 0,
                opened_depth: OPENED_DEPTH + 1,
            }
            .nested(Scanner::items)
            .ok(),
            _ => None,
        }
    }
}

/// Walks a text that serde_json has already found to be valid JSON.
struct Scanner<'a> {
    text: &'a str,
    pos: usize,
    depth: usize,
    /// Objects deeper than this are kept as text.
    opened_depth: usize,
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
    /// A scanner of `text` once serde_json has found it to be valid JSON
    /// (it says where it fails; the scan then only has to find the tokens)
    /// and it is valid UTF-8, which skipping a string does not check.
    fn checked(text: &'a [u8], opened_depth: usize) -> Result<Self, JsonError> {
        serde_json::from_slice::<IgnoredAny>(text).map_err(JsonError::Syntax)?;
        let text = std::str::from_utf8(text).map_err(JsonError::NotUtf8)?;
        Ok(Self {
            text,
            pos: 0,
            depth: 0,
            opened_depth,
        })
    }

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
            Some(b'{') if self.depth < self.opened_depth => self
                .nested(Self::object)
                .map(|object| Json::Object(Box::new(object))),
            // Deeper objects and every array: checked, kept as text.
            Some(b'{' | b'[') => {
                let mut text = String::new();
                self.skim(&mut text)?;
                raw(text)
            }
            Some(b'"') => raw(self.checked_string()?.to_owned()),
            Some(_) => raw(self.bare().to_owned()),
            None => Err(truncated()),
        }
    }

    /// Checks a value as [`Scanner::scan_value`] does, and appends its
    /// text without blanks to `out`, building nothing.
    fn skim(&mut self, out: &mut String) -> Result<(), ScanError> {
        self.skip_blanks();
        match self.peek() {
            Some(b'{' | b'[') if self.depth == MAX_DEPTH => {
                Err(ScanError::Json(JsonError::TooDeep))
            }
            Some(b'{') => self.nested(|scanner| scanner.skim_object(out)),
            Some(b'[') => self.nested(|scanner| scanner.skim_array(out)),
            Some(b'"') => {
                out.push_str(self.checked_string()?);
                Ok(())
            }
            Some(_) => {
                out.push_str(self.bare());
                Ok(())
            }
            None => Err(truncated()),
        }
    }

    fn skim_array(&mut self, out: &mut String) -> Result<(), ScanError> {
        self.eat(b'[')?;
        out.push('[');
        self.skip_blanks();
        if self.peek() == Some(b']') {
            self.pos += 1;
            out.push(']');
            return Ok(());
        }
        let mut index = 0usize;
        loop {
            self.skim(out).map_err(|e| e.under(|| index.to_string()))?;
            index += 1;
            if !self.more(b']')? {
                out.push(']');
                return Ok(());
            }
            out.push(',');
        }
    }

    /// An object in an array: its keys are held only while it is checked.
    fn skim_object(&mut self, out: &mut String) -> Result<(), ScanError> {
        self.eat(b'{')?;
        out.push('{');
        self.skip_blanks();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            out.push('}');
            return Ok(());
        }
        let mut seen = HashSet::new();
        loop {
            self.skip_blanks();
            let start = self.pos;
            let key = self.key()?;
            out.push_str(&self.text[start..self.pos]);
            self.eat(b':')?;
            out.push(':');
            self.skim(out).map_err(|e| e.under(|| key.clone()))?;
            if !seen.insert(key.clone()) {
                return Err(ScanError::DuplicateKey {
                    key,
                    at: Vec::new(),
                });
            }
            if !self.more(b'}')? {
                out.push('}');
                return Ok(());
            }
            out.push(',');
        }
    }

    /// A string token, checked: only `\u` escapes can fail to decode once
    /// the syntax is valid.
    fn checked_string(&mut self) -> Result<&'a str, ScanError> {
        let token = self.string()?;
        if token.contains("\\u") && serde_json::from_str::<String>(token).is_err() {
            return Err(ScanError::LoneSurrogate { at: Vec::new() });
        }
        Ok(token)
    }

    /// A number, `true`, `false` or `null`.
    fn bare(&mut self) -> &'a str {
        let start = self.pos;
        while !matches!(
            self.peek(),
            None | Some(b',' | b']' | b'}' | b' ' | b'\t' | b'\n' | b'\r')
        ) {
            self.pos += 1;
        }
        &self.text[start..self.pos]
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
            match object.entry(Key::from(key)) {
                Entry::Occupied(taken) => {
                    return Err(ScanError::DuplicateKey {
                        key: taken.key().as_str().to_owned(),
                        at: Vec::new(),
                    });
                }
                Entry::Vacant(free) => {
                    free.insert(value);
                }
            }
            if !self.more(b'}')? {
                // Grown by doubling: the spare room would outlive the parse.
                object.shrink_to_fit();
                return Ok(JsonObject(object));
            }
        }
    }

    /// An array whose items are opened: a batch's entries, a bookmark's
    /// partitions.
    fn items(&mut self) -> Result<Vec<Json>, ScanError> {
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

fn raw(text: String) -> Result<Json, ScanError> {
    Text::new(text)
        .map(Json::Raw)
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
    fn arrays_are_kept_whole_as_text_and_opened_on_demand() {
        let value = Json::parse(br#"{"p": [ {"context": {"a": 1}, "v" : 2}, [0, 0] ]}"#).unwrap();
        let p = value.member("p").unwrap();
        assert!(matches!(p, Json::Raw(raw) if raw.get() == r#"[{"context":{"a":1},"v":2},[0,0]]"#));
        let items = p.items().unwrap();
        assert_eq!(items.len(), 2);
        assert!(matches!(items[0].member("context"), Some(Json::Object(_))));
        assert_eq!(items[0].member("v").map(Json::kind), Some("a number"));
        assert_eq!(items[1].kind(), "an array");
        assert!(value.items().is_none());
        assert!(Json::parse(b"1").unwrap().items().is_none());
        assert!(
            matches!(Json::parse_items(b" [1, {\"a\": []}] "), Ok(Some(items)) if items.len() == 2)
        );
        assert!(matches!(Json::parse_items(b"{}"), Ok(None)));
    }

    #[test]
    fn a_value_is_small_and_a_short_text_is_kept_in_place() {
        // Objects have one member per key of the text: its size is the cost.
        assert!(std::mem::size_of::<Json>() <= 24);
        let value = Json::parse(
            br#"{"short":"2026-12-05T00:00:00Z","long":"2026-12-05T00:00:00.000000Z"}"#,
        )
        .unwrap();
        assert_eq!(
            value.member("short").unwrap().as_str().unwrap(),
            "2026-12-05T00:00:00Z"
        );
        assert_eq!(
            value.member("long").unwrap().as_str().unwrap(),
            "2026-12-05T00:00:00.000000Z"
        );
        let Json::Object(object) = &value else {
            panic!()
        };
        assert_eq!(
            object.to_json(),
            r#"{"short":"2026-12-05T00:00:00Z","long":"2026-12-05T00:00:00.000000Z"}"#
        );
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
