//! Bookmarks that go backwards. A regression is a stream under
//! `singer_state.bookmarks` of the effective state (partial merged over
//! completed) whose `replication_key` is unchanged and whose
//! `replication_key_value` moves backwards: RFC 3339 timestamps and dates by
//! instant, numbers by value at full precision (documents keep their
//! digits), partitioned bookmarks partition by partition. Other values, a
//! changed replication key, a new or removed stream are not regressions.

use std::cmp::Ordering;

use serde::Serialize;

use super::{Json, JsonObject, StateDocument};

/// What a gateway does with a write whose bookmark goes backwards
/// (`--bookmark-regression`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum RegressionMode {
    /// Write it, and say so: an answer header, a log line, a metric.
    #[default]
    Warn,
    /// Refuse it with 409, unless the request allows the streams.
    Reject,
    /// Compare nothing.
    Off,
}

/// The streams a request lets go backwards (`Statehouse-Allow-Regression`):
/// a comma-separated list of names, or `*` for all.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum AllowedRegressions {
    #[default]
    None,
    All,
    Streams(Vec<String>),
}

impl AllowedRegressions {
    pub fn parse(header: &str) -> Self {
        let streams: Vec<String> = header
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        if streams.iter().any(|s| s == "*") {
            Self::All
        } else if streams.is_empty() {
            Self::None
        } else {
            Self::Streams(streams)
        }
    }

    pub fn allows(&self, stream: &str) -> bool {
        match self {
            Self::None => false,
            Self::All => true,
            Self::Streams(streams) => streams.iter().any(|s| s == stream),
        }
    }
}

/// One stream's (or one partition's) bookmark that went backwards, with its
/// values as the documents wrote them.
#[derive(Clone, Debug, Serialize)]
pub struct Regression {
    pub stream: String,
    pub from: Box<serde_json::value::RawValue>,
    pub to: Box<serde_json::value::RawValue>,
    /// The partition's context, for a partitioned bookmark.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<Json>,
}

/// The regressions of `after` against `before`, streams in byte order.
pub fn regressions(before: &StateDocument, after: &StateDocument) -> Vec<Regression> {
    let (Some(before), Some(after)) = (before.bookmarks(), after.bookmarks()) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for (stream, now) in after.iter() {
        let (Some(Json::Object(was)), Json::Object(now)) = (before.get(stream), now) else {
            continue;
        };
        // Arrays are kept as text (see `json`): partitions are opened here.
        let partitions = |bookmark: &JsonObject| bookmark.get("partitions").and_then(Json::items);
        match (partitions(was), partitions(now)) {
            (Some(was), Some(now)) => {
                for partition in &now {
                    let Json::Object(partition) = partition else {
                        continue;
                    };
                    let context = partition.get("context");
                    let earlier = was.iter().find_map(|p| match p {
                        Json::Object(p) if p.get("context") == context => Some(p),
                        _ => None,
                    });
                    if let Some(earlier) = earlier
                        && let Some((from, to)) = backwards(earlier, partition)
                    {
                        found.push(Regression {
                            stream: stream.to_owned(),
                            from,
                            to,
                            context: context.cloned(),
                        });
                    }
                }
            }
            _ => {
                if let Some((from, to)) = backwards(was, now) {
                    found.push(Regression {
                        stream: stream.to_owned(),
                        from,
                        to,
                        context: None,
                    });
                }
            }
        }
    }
    found.sort_by(|a, b| a.stream.cmp(&b.stream));
    found
}

type Raw = Box<serde_json::value::RawValue>;

/// The values of a bookmark that went backwards under an unchanged key.
fn backwards(was: &JsonObject, now: &JsonObject) -> Option<(Raw, Raw)> {
    let key = was.get("replication_key")?;
    if now.get("replication_key") != Some(key) {
        return None;
    }
    let (Json::Raw(from), Json::Raw(to)) = (
        was.get("replication_key_value")?,
        now.get("replication_key_value")?,
    ) else {
        return None;
    };
    (compare_values(from.get(), to.get())? == Ordering::Greater)
        .then(|| (from.to_raw(), to.to_raw()))
}

/// Orders two bookmark values written as JSON: two timestamps or dates by
/// instant, two numbers by value; None for anything else. The guard's one
/// comparison, which `statehouse wait --until` asks too.
pub fn compare_values(a: &str, b: &str) -> Option<Ordering> {
    if a.starts_with('"') && b.starts_with('"') {
        let (a, b): (String, String) =
            (serde_json::from_str(a).ok()?, serde_json::from_str(b).ok()?);
        return Some(instant(&a)?.cmp(&instant(&b)?));
    }
    Some(Decimal::parse(a)?.cmp(&Decimal::parse(b)?))
}

/// Nanoseconds since the epoch of an RFC 3339 timestamp (`T` or a space
/// between date and time; `Z`, an offset, or none for UTC) or a date.
fn instant(text: &str) -> Option<i128> {
    let digits = |s: &str| -> Option<i64> {
        (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())).then(|| s.parse().ok())?
    };
    let (date, time) = match text.split_once(['T', 't', ' ']) {
        Some((date, time)) => (date, Some(time)),
        None => (text, None),
    };
    let mut parts = date.splitn(3, '-');
    let (y, m, d) = (
        digits(parts.next()?)?,
        digits(parts.next()?)?,
        digits(parts.next()?)?,
    );
    if date.len() != 10 || !(1..=12).contains(&m) || !(1..=31).contains(&d) {
        return None;
    }
    let days = days_from_civil(y, m, d);
    let (mut seconds, mut nanos) = (days * 86_400, 0i128);
    if let Some(time) = time {
        let (clock, offset) = match time.find(['Z', 'z', '+', '-']) {
            Some(at) => (&time[..at], &time[at..]),
            None => (time, ""),
        };
        let (hms, fraction) = match clock.split_once('.') {
            Some((hms, fraction)) => (hms, Some(fraction)),
            None => (clock, None),
        };
        let mut hms = hms.splitn(3, ':');
        let (h, mi, s) = (
            digits(hms.next()?)?,
            digits(hms.next()?)?,
            digits(hms.next()?)?,
        );
        if h > 23 || mi > 59 || s > 60 {
            return None;
        }
        seconds += h * 3600 + mi * 60 + s;
        if let Some(fraction) = fraction {
            digits(fraction)?;
            let padded = format!("{fraction:0<9}");
            nanos = padded[..9].parse::<i128>().ok()?;
        }
        seconds -= match offset {
            "" | "Z" | "z" => 0,
            _ => {
                let sign = if offset.starts_with('-') { -1 } else { 1 };
                let (oh, om) = offset[1..].split_once(':')?;
                sign * (digits(oh)? * 3600 + digits(om)? * 60)
            }
        };
    }
    Some(i128::from(seconds) * 1_000_000_000 + nanos)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// A JSON number at full precision: its sign, its significant digits and
/// the power of ten of the first, so that any two compare exactly.
#[derive(Debug, PartialEq, Eq)]
struct Decimal {
    negative: bool,
    /// Significant digits, no leading or trailing zeros; empty for zero.
    digits: String,
    /// The value is 0.d1d2... × 10^exponent.
    exponent: i64,
}

impl Decimal {
    fn parse(text: &str) -> Option<Self> {
        let (negative, rest) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let (mantissa, exponent) = match rest.split_once(['e', 'E']) {
            Some((mantissa, exponent)) => (mantissa, exponent.parse::<i64>().ok()?),
            None => (rest, 0),
        };
        let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        if whole.is_empty()
            || !whole
                .bytes()
                .chain(fraction.bytes())
                .all(|b| b.is_ascii_digit())
        {
            return None;
        }
        let all = format!("{whole}{fraction}");
        let leading = all.bytes().take_while(|b| *b == b'0').count();
        let digits = all[leading..].trim_end_matches('0').to_owned();
        let whole_len = i64::try_from(whole.len()).ok()?;
        let leading = i64::try_from(leading).ok()?;
        Some(Self {
            negative: negative && !digits.is_empty(),
            exponent: if digits.is_empty() {
                0
            } else {
                exponent.checked_add(whole_len - leading)?
            },
            digits,
        })
    }

    fn magnitude(&self, other: &Self) -> Ordering {
        match (self.digits.is_empty(), other.digits.is_empty()) {
            (true, true) => Ordering::Equal,
            (true, false) => Ordering::Less,
            (false, true) => Ordering::Greater,
            (false, false) => self
                .exponent
                .cmp(&other.exponent)
                .then_with(|| self.digits.cmp(&other.digits)),
        }
    }
}

impl PartialOrd for Decimal {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Decimal {
    fn cmp(&self, other: &Self) -> Ordering {
        match (self.negative, other.negative) {
            (false, false) => self.magnitude(other),
            (true, true) => other.magnitude(self),
            (false, true) => Ordering::Greater,
            (true, false) => Ordering::Less,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(AllowedRegressions::parse("*").allows("any"));
        let some = AllowedRegressions::parse(" orders, users ");
        assert!(some.allows("users") && !some.allows("items"));
        assert_eq!(AllowedRegressions::parse(" , "), AllowedRegressions::None);
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
}
