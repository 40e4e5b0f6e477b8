//! How two bookmark values written as JSON order: timestamps and dates by
//! instant, numbers by value at full precision (documents keep their
//! digits). Anything else has no order, so it never regresses.

use std::cmp::Ordering;

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
