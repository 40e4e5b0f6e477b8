//! The command line of `statehouse wait`.

use std::time::Duration;

use clap::{ArgGroup, Args};

use super::until::Until;
use crate::client::ConnectionArgs;
use crate::domain::parse_duration;

// What to wait for: a bookmark (--stream with --until) or the next change.
// One group, so that a command line with neither names both in its error.
#[derive(Debug, Clone, Args)]
#[command(group(ArgGroup::new("goal").required(true).args(["stream", "changed"])))]
pub struct WaitArgs {
    /// Where the gateway is and how to reach it: the same flags and
    /// variables as `statehouse lock`.
    #[command(flatten)]
    pub connection: ConnectionArgs,

    /// Wait for this stream's bookmark, in the effective state (partial over
    /// completed), to reach --until.
    #[arg(long, requires = "until")]
    pub stream: Option<String>,

    /// The value --stream's replication_key_value must reach: a number (by
    /// value), or an RFC 3339 timestamp or date (by instant, whatever the
    /// offsets), compared as the regression guard compares.
    #[arg(long, value_name = "VALUE", requires = "stream", value_parser = Until::parse)]
    pub until: Option<Until>,

    /// Wait for the state's next change instead (a write, a create or a delete).
    #[arg(long, conflicts_with_all = ["stream", "until"])]
    pub changed: bool,

    /// Give up after this long and exit 124 (1 if the gateway was not
    /// answering then): 500ms, 30s, 2m, 1h or plain seconds. Without it,
    /// wait for ever.
    #[arg(long, value_name = "D", value_parser = parse_timeout)]
    pub timeout: Option<Duration>,

    /// The state_id to watch.
    pub state_id: String,
}

/// What a run waits for.
pub enum Goal {
    /// The stream's bookmark at or past the value.
    Reach {
        /// The stream under `singer_state.bookmarks`.
        stream: String,
        /// The value its bookmark must reach.
        until: Until,
    },
    /// The state's next change.
    Change,
}

impl WaitArgs {
    pub fn goal(&self) -> Goal {
        match (&self.stream, &self.until) {
            (Some(stream), Some(until)) => Goal::Reach {
                stream: stream.clone(),
                until: until.clone(),
            },
            // clap lets through only --changed or --stream with --until.
            _ => Goal::Change,
        }
    }
}

fn parse_timeout(raw: &str) -> Result<Duration, String> {
    parse_duration(raw).ok_or_else(|| {
        format!("{raw:?} is not a duration; give seconds (30) or a unit (500ms, 30s, 2m, 1h)")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Only {
        #[command(flatten)]
        args: WaitArgs,
    }

    fn parse(argv: &[&str]) -> Result<WaitArgs, clap::Error> {
        Only::try_parse_from(["statehouse wait"].iter().chain(argv)).map(|only| only.args)
    }

    #[test]
    fn a_stream_and_its_value_or_the_next_change() {
        let args = parse(&[
            "dev:t-to-u",
            "--stream=orders",
            "--until=10",
            "--timeout=90",
        ])
        .unwrap();
        assert_eq!(args.state_id, "dev:t-to-u");
        assert!(matches!(args.goal(), Goal::Reach { stream, until }
            if stream == "orders" && until.as_json() == "10"));
        assert_eq!(args.timeout, Some(Duration::from_secs(90)));
        let args = parse(&["--changed", "--timeout", "1h", "id"]).unwrap();
        assert!(matches!(args.goal(), Goal::Change));
        assert_eq!(args.timeout, Some(Duration::from_secs(3600)));
        assert_eq!(parse(&["--changed", "id"]).unwrap().timeout, None);
        assert_eq!(
            parse(&["--changed", "--timeout=500ms", "id"])
                .unwrap()
                .timeout,
            Some(Duration::from_millis(500))
        );
    }

    #[test]
    fn bad_command_lines_are_refused() {
        for argv in [
            &["id"][..],
            &["--changed"],
            &["--stream=s", "id"],
            &["--until=10", "id"],
            &["--changed", "--stream=s", "--until=10", "id"],
            &["--stream=s", "--until=soon", "id"],
            &["--changed", "--timeout=soon", "id"],
            &["--changed", "--timeout=-1", "id"],
            &["--changed", "--url=ftp://gw", "id"],
        ] {
            assert!(parse(argv).is_err(), "{argv:?}");
        }
    }
}
