//! `statehouse wait STATE_ID --stream S --until VALUE [--timeout D]` and
//! `statehouse wait STATE_ID --changed [--timeout D]`: blocks until a
//! stream's bookmark reaches a value, or until the state's next change, so
//! that an orchestrator's sensor or a runbook waits on the gateway's
//! long-poll instead of polling on a timer.
//!
//! It asks `GET /v1/states/{id}?wait=` in a loop, each answer's ETag sent
//! back as `If-None-Match`, so that the gateway answers when the state
//! changes; it never sleeps between calls but to back off from an
//! unreachable or overloaded gateway. The command line is in `args`, the
//! request in `poll`, whether a value is reached in `until`.

mod args;
mod poll;
mod until;

use std::process::ExitCode;
use std::time::Duration;

use tokio::time::Instant;

use self::args::Goal;
pub use self::args::WaitArgs;
use self::poll::{Failure, Poller, Seen};
use self::until::Standing;
use crate::domain::MAX_WAIT;

/// The goal was reached, or the state changed.
pub const EXIT_DONE: u8 = 0;
/// Refused by the gateway, or a client that could not be set up (as
/// `statehouse lock`, and as a bad command line).
pub const EXIT_FAILED: u8 = 1;
/// `--timeout` ran out first, as coreutils' `timeout` answers.
pub const EXIT_TIMED_OUT: u8 = 124;

/// The first pause after a failed call, doubled up to [`MAX_BACKOFF`] while
/// the gateway stays unreachable (it names its own with `Retry-After`).
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Runs `statehouse wait` and answers its exit status.
pub fn run(args: WaitArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            say(format_args!("cannot start: {err}"));
            return ExitCode::from(EXIT_FAILED);
        }
    };
    ExitCode::from(runtime.block_on(wait(args)))
}

async fn wait(args: WaitArgs) -> u8 {
    let poller = match args
        .connection
        .resolve()
        .and_then(|connection| Poller::new(&connection, &args.state_id))
    {
        Ok(poller) => poller,
        Err(err) => {
            say(format_args!("{err}"));
            return EXIT_FAILED;
        }
    };
    let deadline = args.timeout.map(|timeout| Instant::now() + timeout);
    let waiting = async {
        match args.goal() {
            Goal::Reach { stream, until } => {
                reach(&poller, deadline, |state| {
                    until::standing(state, &stream, &until)
                })
                .await
            }
            Goal::Change => change(&poller, deadline).await,
        }
    };
    let outcome = match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, waiting)
            .await
            .unwrap_or(Err(Stop::TimedOut)),
        None => waiting.await,
    };
    match outcome {
        Ok(()) => EXIT_DONE,
        Err(Stop::TimedOut) => {
            say(format_args!(
                "{} did not come within --timeout",
                match args.goal() {
                    Goal::Reach { .. } => "the bookmark",
                    Goal::Change => "a change",
                }
            ));
            EXIT_TIMED_OUT
        }
        Err(Stop::Failed(why)) => {
            say(format_args!("{why}"));
            EXIT_FAILED
        }
    }
}

/// Why a wait ended without its goal.
enum Stop {
    /// `--timeout` ended first.
    TimedOut,
    /// The gateway refused, or answered what cannot be read: why.
    Failed(String),
}

/// Long-polls until `standing` says the state reached the value.
async fn reach(
    poller: &Poller,
    deadline: Option<Instant>,
    standing: impl Fn(&crate::domain::StateDocument) -> Standing,
) -> Result<(), Stop> {
    let mut etag: Option<String> = None;
    let mut told: Option<String> = None;
    loop {
        match ask(poller, etag.as_deref(), deadline).await? {
            Seen::State { etag: now, body } => {
                let state = until::state_of(&body).map_err(Stop::Failed)?;
                match standing(&state) {
                    Standing::Reached => return Ok(()),
                    Standing::Short => {}
                    Standing::Incomparable(value) => {
                        // Once per value: each change would say it again.
                        if told.as_ref() != Some(&value) {
                            say(format_args!(
                                "the bookmark is {value}, which cannot be compared with --until; waiting for a value that can"
                            ));
                            told = Some(value);
                        }
                    }
                }
                etag = Some(now);
            }
            Seen::Unchanged => {}
            // Deleted, or not created yet: waited for.
            Seen::Absent => etag = None,
        }
    }
}

/// Long-polls until the state is no longer as the first answer found it.
async fn change(poller: &Poller, deadline: Option<Instant>) -> Result<(), Stop> {
    // The first read waits for nothing: it is what a change is a change from.
    let first = match ask_once(poller, None, Duration::ZERO).await? {
        Seen::State { etag, .. } => Some(etag),
        Seen::Absent | Seen::Unchanged => None,
    };
    loop {
        match (ask(poller, first.as_deref(), deadline).await?, &first) {
            // A 200 to If-None-Match is another version; to none, a create.
            (Seen::State { .. }, _) | (Seen::Absent, Some(_)) => return Ok(()),
            (Seen::Unchanged | Seen::Absent, _) => {}
        }
    }
}

/// One long-poll of as long as the timeout leaves (at most [`MAX_WAIT`]),
/// asked again after a pause while the gateway cannot answer.
async fn ask(poller: &Poller, etag: Option<&str>, deadline: Option<Instant>) -> Result<Seen, Stop> {
    let wait = deadline.map_or(MAX_WAIT, |deadline| {
        deadline
            .saturating_duration_since(Instant::now())
            .min(MAX_WAIT)
    });
    ask_once(poller, etag, wait).await
}

/// `poller.poll`, asked again after [`Failure::Retry`]: after the gateway's
/// `Retry-After`, else after a backoff. The caller's deadline bounds it.
async fn ask_once(poller: &Poller, etag: Option<&str>, wait: Duration) -> Result<Seen, Stop> {
    let mut backoff = FIRST_BACKOFF;
    loop {
        match poller.poll(etag, wait).await {
            Ok(seen) => return Ok(seen),
            Err(Failure::Refused(why)) => return Err(Stop::Failed(why)),
            Err(Failure::Retry { after, why }) => {
                let pause = after.unwrap_or(backoff);
                say(format_args!(
                    "{why}; asking again in {}",
                    humantime::format_duration(pause)
                ));
                tokio::time::sleep(pause).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// Each thing `statehouse wait` has to tell is one line on stderr.
fn say(line: std::fmt::Arguments<'_>) {
    eprintln!("statehouse wait: {line}");
}
