//! Logging: human-readable text by default, one JSON object per line on request.

use std::fmt;
use std::io::{self, IsTerminal};

use opentelemetry_sdk::trace::SdkTracer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// How log lines are written: text for people, JSON for log pipelines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// `RUST_LOG` refines the level (default `info`). With `traces` (export is
/// on, see [`crate::traces`]), statehouse's own spans of level info and up
/// are also handed to OpenTelemetry, whatever `RUST_LOG` lets the log show.
pub fn init(format: LogFormat, traces: Option<SdkTracer>) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only for a person at a terminal: in a file or a log collector
    // their escape codes are noise, and hide whatever else a line holds.
    let colour = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let log = tracing_subscriber::fmt::layer()
        .with_ansi(colour)
        .with_writer(|| OneLinePerEvent(std::io::stderr()));
    let log = match format {
        LogFormat::Text => log.boxed(),
        LogFormat::Json => log
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .boxed(),
    };
    let traces = traces.map(crate::traces::layer);
    let result = tracing_subscriber::registry()
        .with(log.with_filter(filter))
        .with(traces)
        .try_init();
    // Already initialized (tests build several apps in one process): keep the first.
    drop(result);
}

/// Writes each log event as one line whatever its fields hold. Every text
/// a client chose is logged through [`ClientText`]; this is the net under
/// that rule: a line break that reached a field some other way is written
/// as `\n`, so no client's text can start a line of its own. The fmt layer
/// hands over each event, newline included, in one `write_all`.
struct OneLinePerEvent<W>(W);

impl<W: io::Write> io::Write for OneLinePerEvent<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let (event, end) = match buf.strip_suffix(b"\n") {
            Some(event) => (event, &b"\n"[..]),
            None => (buf, &b""[..]),
        };
        if !event.iter().any(|b| matches!(b, b'\n' | b'\r')) {
            self.0.write_all(buf)?;
            return Ok(buf.len());
        }
        let mut line = Vec::with_capacity(buf.len() + 16);
        for &byte in event {
            match byte {
                b'\n' => line.extend_from_slice(b"\\n"),
                b'\r' => line.extend_from_slice(b"\\r"),
                other => line.push(other),
            }
        }
        line.extend_from_slice(end);
        self.0.write_all(&line)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

/// Text a client chose (a state_id, an owner, a header, a glob), fit for a log
/// field: `tracing`'s text format writes `%` fields raw, so a CR, LF, NUL or
/// ANSI escape in them would forge or garble log lines. Plain text is written
/// as it is; anything else is quoted with Rust's escapes (`"a\r\nb"`), which
/// also keeps a space or `=` from passing for another field. Log every value a
/// client controls as `field = %ClientText(value)`.
pub struct ClientText<'a>(pub &'a str);

impl fmt::Display for ClientText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if is_plain(self.0) {
            f.write_str(self.0)
        } else {
            write!(f, "{:?}", self.0)
        }
    }
}

/// Reads the same bare as quoted: not empty, and every character printable
/// (`escape_debug` leaves it alone, so no control, quote or backslash), not
/// whitespace and not `=`.
fn is_plain(text: &str) -> bool {
    !text.is_empty()
        && text
            .chars()
            .all(|c| !c.is_whitespace() && c != '=' && c.escape_debug().len() == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_is_one_line_whatever_its_fields_hold() {
        use std::io::Write;
        let mut out = OneLinePerEvent(Vec::new());
        out.write_all(b"2026-01-01T00:00:00Z WARN x streams=orders\n2026 INFO forged\r\n")
            .unwrap();
        out.write_all(b"2026-01-01T00:00:01Z INFO plain\n").unwrap();
        let written = String::from_utf8(out.0).unwrap();
        assert_eq!(
            written,
            "2026-01-01T00:00:00Z WARN x streams=orders\\n2026 INFO forged\\r\n2026-01-01T00:00:01Z INFO plain\n"
        );
    }

    fn logged(text: &str) -> String {
        ClientText(text).to_string()
    }

    #[test]
    fn plain_text_stays_bare() {
        for text in [
            "dev:tap-github-to-target-jsonl",
            "a/b.c",
            "ünï🚀",
            "100%_done*",
        ] {
            assert_eq!(logged(text), text);
        }
    }

    #[test]
    fn control_characters_never_reach_the_log() {
        assert_eq!(logged("a\r\nb"), r#""a\r\nb""#);
        assert_eq!(logged("nul\0"), r#""nul\0""#);
        assert_eq!(logged("\x1b[31mred"), r#""\u{1b}[31mred""#);
        assert_eq!(logged("del\x7f c1\u{85}"), r#""del\u{7f} c1\u{85}""#);
        assert_eq!(logged("bidi\u{202e}x"), r#""bidi\u{202e}x""#);
        assert_eq!(logged("line\u{2028}sep"), r#""line\u{2028}sep""#);
        for text in ["a\r\nb", "\0", "\x1b[2J", "\u{85}", "\u{2029}"] {
            assert!(!logged(text).chars().any(char::is_control), "{text:?}");
        }
    }

    #[test]
    fn what_could_pass_for_another_field_is_quoted() {
        assert_eq!(logged("x released=true"), r#""x released=true""#);
        assert_eq!(logged("k=v"), r#""k=v""#);
        assert_eq!(logged(r#"say "hi""#), r#""say \"hi\"""#);
        assert_eq!(logged(r"back\slash"), r#""back\\slash""#);
        assert_eq!(logged(""), r#""""#);
    }
}
