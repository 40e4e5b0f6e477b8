//! `statehouse wait STATE_ID --stream S --until VALUE [--timeout D]` and
//! `statehouse wait STATE_ID --changed [--timeout D]`: blocks until a
//! stream's bookmark reaches a value, or until the state's next change, so
//! that an orchestrator's sensor or a runbook waits on the gateway's
//! long-poll instead of polling on a timer.
//!
//! It asks `GET /v1/states/{id}?wait=` in a loop, each answer's ETag sent
//! back as `If-None-Match`, so that the gateway answers when the state
//! changes; it never sleeps between calls but to back off from an
//! unreachable or overloaded gateway. A gateway that stays unreachable for
//! [`GIVE_UP`] is a failure (exit 1), not a "not yet": a typo in the URL must
//! not look like a bookmark that never comes. The command line is in
//! `args`, the request in `poll`, whether a value is reached in `until`.

mod args;
mod poll;
mod until;

use std::cell::Cell;
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
/// Refused by the gateway, a gateway that cannot be reached, or a client
/// that could not be set up (as `statehouse lock`, and as a bad command line).
pub const EXIT_FAILED: u8 = 1;
/// `--timeout` ran out first, as coreutils' `timeout` answers.
pub const EXIT_TIMED_OUT: u8 = 124;

/// The first pause after a failed call, doubled up to [`MAX_BACKOFF`] while
/// the gateway stays unreachable (it names its own with `Retry-After`).
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// How long a gateway may go without answering before the wait gives up on
/// it: longer than a gateway's restart, short enough that a sensor on a
/// wrong URL fails its task rather than waiting for ever.
pub const GIVE_UP: Duration = Duration::from_secs(20);

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
    let asker = match args
        .connection
        .resolve()
        .and_then(|connection| Poller::new(&connection, &args.state_id))
    {
        Ok(poller) => Asker::new(poller),
        Err(err) => {
            say(format_args!("{err}"));
            return EXIT_FAILED;
        }
    };
    let deadline = args.timeout.map(|timeout| Instant::now() + timeout);
    let waiting = async {
        match args.goal() {
            Goal::Reach { stream, until } => {
                reach(&asker, deadline, |state| {
                    until::standing(state, &stream, &until)
                })
                .await
            }
            Goal::Change => change(&asker, deadline).await,
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
        // Not reached is not what it saw: it saw no gateway.
        Err(Stop::TimedOut) if asker.unreachable.get().is_some() => {
            say(format_args!(
                "--timeout ended while the gateway did not answer; {}",
                asker.last_failure.take()
            ));
            EXIT_FAILED
        }
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
    asker: &Asker,
    deadline: Option<Instant>,
    standing: impl Fn(&crate::domain::StateDocument) -> Standing,
) -> Result<(), Stop> {
    let mut etag: Option<String> = None;
    let mut told: Option<String> = None;
    loop {
        match asker.ask(etag.as_deref(), deadline).await? {
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
async fn change(asker: &Asker, deadline: Option<Instant>) -> Result<(), Stop> {
    // The first read waits for nothing: it is what a change is a change from.
    let first = match asker.ask_once(None, Duration::ZERO).await? {
        Seen::State { etag, .. } => Some(etag),
        Seen::Absent | Seen::Unchanged => None,
    };
    loop {
        match (asker.ask(first.as_deref(), deadline).await?, &first) {
            // A 200 to If-None-Match is another version; to none, a create.
            (Seen::State { .. }, _) | (Seen::Absent, Some(_)) => return Ok(()),
            (Seen::Unchanged | Seen::Absent, _) => {}
        }
    }
}

/// The [`Poller`], asked again while the gateway cannot answer, with what
/// the asking saw of an unreachable gateway, read once the timeout ends.
struct Asker {
    poller: Poller,
    /// Since when the gateway has not answered, while it does not.
    unreachable: Cell<Option<Instant>>,
    /// The last failure, for the line that gives up.
    last_failure: Cell<String>,
}

impl Asker {
    fn new(poller: Poller) -> Self {
        Self {
            poller,
            unreachable: Cell::new(None),
            last_failure: Cell::new(String::new()),
        }
    }

    /// One long-poll of as long as the timeout leaves (at most [`MAX_WAIT`]).
    async fn ask(&self, etag: Option<&str>, deadline: Option<Instant>) -> Result<Seen, Stop> {
        let wait = deadline.map_or(MAX_WAIT, |deadline| {
            deadline
                .saturating_duration_since(Instant::now())
                .min(MAX_WAIT)
        });
        self.ask_once(etag, wait).await
    }

    /// `poller.poll`, asked again after a failure: a busy gateway after its
    /// `Retry-After` (else a backoff) for as long as it answers so; an
    /// unreachable one after a backoff, until [`GIVE_UP`] without an answer.
    /// The caller's deadline bounds it.
    async fn ask_once(&self, etag: Option<&str>, wait: Duration) -> Result<Seen, Stop> {
        let mut backoff = FIRST_BACKOFF;
        loop {
            let (pause, why) = match self.poller.poll(etag, wait).await {
                Ok(seen) => {
                    self.unreachable.set(None);
                    return Ok(seen);
                }
                Err(Failure::Refused(why)) => return Err(Stop::Failed(why)),
                Err(Failure::Busy { after, why }) => {
                    self.unreachable.set(None);
                    (after.unwrap_or(backoff), why)
                }
                Err(Failure::Unreachable(why)) => {
                    let since = self.unreachable.get().unwrap_or_else(Instant::now);
                    self.unreachable.set(Some(since));
                    let left = (since + GIVE_UP).saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Stop::Failed(format!(
                            "{why}; gave up after {} without an answer",
                            humantime::format_duration(GIVE_UP)
                        )));
                    }
                    self.last_failure.set(why.clone());
                    (backoff.min(left), why)
                }
            };
            say(format_args!(
                "{why}; asking again in {}",
                // Whole milliseconds: the rest of a backoff cut short by
                // GIVE_UP would print down to its nanoseconds.
                humantime::format_duration(Duration::from_millis(pause.as_millis() as u64))
            ));
            tokio::time::sleep(pause).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }
}

/// Each thing `statehouse wait` has to tell is one line on stderr.
fn say(line: std::fmt::Arguments<'_>) {
    eprintln!("statehouse wait: {line}");
}
