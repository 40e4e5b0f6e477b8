//! `statehouse lock STATE_ID -- COMMAND [ARGS...]`: runs a command while
//! holding a lease on a state_id, so that no two runs of one pipeline
//! overlap, whatever starts them.
//!
//! One process: it takes the lease (waiting up to `--wait` for it), runs the
//! command with the lease in its environment, renews the lease every third of
//! its TTL, passes SIGINT, SIGTERM and SIGHUP on to the command's process
//! group, and releases the lease when the command ends. When the lease is
//! lost (a renewal answers 409, or the gateway stays unreachable until the
//! lease would have expired) the group gets SIGTERM, and SIGKILL after
//! `--grace`. Nothing of the group outlives the runner: what the command
//! leaves running is stopped before the lease goes, and a watchdog process
//! stops the group if the runner dies (`kill -9`).
//!
//! The run itself is here; the command line is in `args`, the gateway client
//! in `client`, the renewal schedule in `clock`, how a run ended and its exit
//! status in `ending`, the command in `child` and `group`, the watchdog in
//! `watchdog`.

mod args;
mod child;
mod client;
mod clock;
mod ending;
mod group;
mod info;
mod watchdog;

use std::process::ExitCode;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

pub use self::args::LockArgs;
pub use self::child::SpawnError;
use self::child::{Child, Signals};
pub use self::watchdog::{WatchdogArgs, run as run_watchdog};
use crate::client::TlsFiles;

use self::client::{Acquired, Gateway, Holder, Lease, Verdict};
use self::clock::{LeaseClock, REQUEST_TIMEOUT};
pub use self::ending::{
    EXIT_BUSY, EXIT_CANNOT_EXECUTE, EXIT_LOST, EXIT_NOT_FOUND, EXIT_UNUSABLE, Ending, exit_code,
};
use self::watchdog::Watchdog;

/// After a signal while acquiring, how long an acquire already sent may
/// take to answer with a grant that is then released.
const SETTLE: Duration = Duration::from_secs(1);
/// Longest the gateway waits in one acquire (its `wait_seconds` limit); a
/// longer `--wait` asks again.
const MAX_WAIT_PER_ACQUIRE: Duration = Duration::from_secs(300);

/// Why the lease was lost.
#[derive(Debug)]
enum Lost {
    /// The gateway said it is not the current lease (force-unlocked, or expired).
    Refused(String),
    /// No renewal got through before the lease would have expired.
    Unreachable(String),
}

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(why) => write!(f, "the gateway refused its renewal: {why}"),
            Self::Unreachable(why) => write!(
                f,
                "no renewal got through before it would have expired: {why}"
            ),
        }
    }
}

fn say(line: std::fmt::Arguments<'_>) {
    eprintln!("statehouse lock: {line}");
}

/// Runs `statehouse lock` and answers its exit status.
pub fn run(args: LockArgs) -> ExitCode {
    // One thread: the command is started from the thread that lives as long
    // as the process, since Linux's parent-death signal follows the thread
    // that forked it (see `child`).
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            say(format_args!("cannot start: {err}"));
            return ExitCode::from(EXIT_UNUSABLE);
        }
    };
    ExitCode::from(exit_code(runtime.block_on(supervise(args))))
}

async fn supervise(args: LockArgs) -> Ending {
    let id = args.state_id.as_str();
    let owner = args.owner.clone().unwrap_or_else(child::default_owner);
    let gateway = match gateway(&args) {
        Ok(gateway) => gateway,
        Err(err) => {
            say(format_args!("{err}; nothing was run"));
            return Ending::Unusable;
        }
    };
    let mut signals = match Signals::install() {
        Ok(signals) => signals,
        Err(err) => {
            say(format_args!("cannot handle signals: {err}"));
            return Ending::Unusable;
        }
    };
    // Started before anything is asked, so that a runner that cannot have
    // one takes no lease and runs nothing.
    let mut watchdog = match Watchdog::start(args.grace) {
        Ok(watchdog) => watchdog,
        Err(err) => {
            say(format_args!(
                "cannot start the watchdog: {err}; nothing was run"
            ));
            return Ending::Unusable;
        }
    };
    let acquiring = acquire(&gateway, id, &owner, &args);
    tokio::pin!(acquiring);
    let acquired = tokio::select! {
        acquired = &mut acquiring => acquired,
        signal = signals.recv() => {
            // The gateway may be granting the lease at this very moment: a
            // grant that answers within SETTLE is released; an acquire still
            // waiting then is abandoned, and the gateway drops it from the
            // line when the connection closes.
            if let Ok(Ok(Acquired::Granted(lease))) =
                tokio::time::timeout(SETTLE, &mut acquiring).await
            {
                release(&gateway, id, &lease).await;
            }
            return Ending::Interrupted(signal);
        }
    };
    let lease = match acquired {
        Ok(Acquired::Granted(lease)) => lease,
        Ok(Acquired::Held(holder)) => {
            say(format_args!(
                "{id} is locked by {}; nothing was run",
                describe(holder.as_ref())
            ));
            return Ending::Busy;
        }
        Ok(Acquired::Delayed { free_at }) => {
            say(format_args!(
                "{id} is in its lock-delay after a lost lease, free at {free_at}; nothing was run"
            ));
            return Ending::Busy;
        }
        Err(err) => {
            say(format_args!("{err}; nothing was run"));
            return Ending::Unusable;
        }
    };
    let clock = match start_clock(&gateway, id, &lease, args.ttl).await {
        Ok(clock) => clock,
        Err(why) => {
            say(format_args!(
                "the lease on {id} could not be confirmed ({why}); nothing was run"
            ));
            release(&gateway, id, &lease).await;
            return Ending::Unusable;
        }
    };
    let child = match Child::spawn(&args.command, id, &lease) {
        Ok(child) => child,
        Err(err) => {
            say(format_args!(
                "cannot run {}: {err}",
                args.command[0].to_string_lossy()
            ));
            release(&gateway, id, &lease).await;
            return Ending::NotStarted(err.kind);
        }
    };
    if let Err(err) = watchdog.watch(child.pgid()) {
        say(format_args!(
            "the watchdog is gone ({err}): should the runner die, what the command started may outlive it"
        ));
    }
    let (lost_tx, lost_rx) = oneshot::channel();
    let keeper = tokio::spawn(keep(
        gateway.clone(),
        id.to_owned(),
        lease.lease_id.clone(),
        clock,
        lost_tx,
    ));
    let (status, lost) = watch(child, &mut signals, lost_rx, id, args.grace).await;
    keeper.abort();
    match lost {
        Some(Lost::Refused(_)) => Ending::Lost,
        Some(Lost::Unreachable(_)) => {
            // Best effort: the gateway may be back.
            release(&gateway, id, &lease).await;
            Ending::Lost
        }
        None if !release(&gateway, id, &lease).await => {
            say(format_args!(
                "lost the lease on {id}: it was no longer current when the command ended"
            ));
            Ending::Lost
        }
        None => status,
    }
}

/// The gateway client the flags and the environment describe: its URL, its
/// token (read from --token-file, or as [`LockArgs::gateway_settings`] finds
/// it) and its TLS files.
fn gateway(args: &LockArgs) -> Result<Gateway, String> {
    // An empty variable is no setting: a template that left it blank.
    let (url, token) =
        args.gateway_settings(|name| std::env::var(name).ok().filter(|value| !value.is_empty()))?;
    let token = match &args.token_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read the token file {}: {e}", path.display()))?
                .trim()
                .to_owned(),
        ),
        None => token,
    };
    let tls = TlsFiles {
        ca_file: args.ca_file.clone(),
        client_cert_file: args.client_cert_file.clone(),
        client_key_file: args.client_key_file.clone(),
    };
    Gateway::new(url, token, &tls)
}

/// Takes the lease, asking again while `wait` lasts (one acquire waits at
/// most the gateway's limit). A 503 that says when to come back
/// (`overloaded`, `authority-unreachable`) is retried then, within the wait
/// or 30 s, whichever is longer.
async fn acquire(
    gateway: &Gateway,
    id: &str,
    owner: &str,
    args: &LockArgs,
) -> Result<Acquired, client::GatewayError> {
    let info = info::lease_info(&args.command, &args.info);
    let started = Instant::now();
    let give_up = started + args.wait;
    let retry_until = give_up.max(started + Duration::from_secs(30));
    loop {
        let now = Instant::now();
        let this_wait = give_up
            .saturating_duration_since(now)
            .min(MAX_WAIT_PER_ACQUIRE);
        match gateway
            .acquire(id, owner, args.ttl, this_wait, args.lock_delay(), &info)
            .await
        {
            Ok(Acquired::Held(_)) if Instant::now() < give_up => continue,
            Err(client::GatewayError::Busy { retry_after, .. })
                if Instant::now() + retry_after < retry_until =>
            {
                tokio::time::sleep(retry_after).await;
            }
            other => return other,
        }
    }
}

/// The lease's clock, counted from when the acquire that got it was sent.
/// A grant at the end of a wait in line may date from any moment of the
/// wait, so one renewal at once tells from when it counts.
async fn start_clock(
    gateway: &Gateway,
    id: &str,
    lease: &Lease,
    ttl: Duration,
) -> Result<LeaseClock, String> {
    let mut clock = LeaseClock::new(ttl, lease.sent);
    if !lease.waited {
        return Ok(clock);
    }
    let sent = Instant::now();
    match tokio::time::timeout(REQUEST_TIMEOUT, gateway.renew(id, &lease.lease_id, ttl)).await {
        Ok(Ok(Verdict::Done)) => {
            clock.renewed(sent);
            Ok(clock)
        }
        Ok(Ok(Verdict::NotCurrent(why))) => Err(why),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err(format!("no answer within {REQUEST_TIMEOUT:?}")),
    }
}

/// Renews the lease on schedule until it is lost; then says why on `lost`.
async fn keep(
    gateway: Gateway,
    id: String,
    lease_id: String,
    mut clock: LeaseClock,
    lost: oneshot::Sender<Lost>,
) {
    let ttl = clock.ttl();
    let mut failing: Option<String> = None;
    let why = loop {
        tokio::time::sleep_until(clock.next_attempt()).await;
        let sent = Instant::now();
        let Some(time_left) = clock.time_left(sent) else {
            break Lost::Unreachable(failing.unwrap_or_else(|| "no answer".into()));
        };
        let error = match tokio::time::timeout(time_left, gateway.renew(&id, &lease_id, ttl)).await
        {
            Ok(Ok(Verdict::Done)) => {
                if failing.take().is_some() {
                    say(format_args!("renewed the lease on {id} again"));
                }
                clock.renewed(sent);
                continue;
            }
            Ok(Ok(Verdict::NotCurrent(why))) => break Lost::Refused(why),
            Ok(Err(err)) => err.to_string(),
            Err(_) => format!("no answer within {time_left:?}"),
        };
        if failing.is_none() {
            say(format_args!(
                "could not renew the lease on {id} ({error}); retrying until it would expire"
            ));
        }
        failing = Some(error);
        if !clock.failed(Instant::now()) {
            break Lost::Unreachable(failing.unwrap_or_default());
        }
    };
    let _ = lost.send(why);
}

/// Waits for the command, passing signals on to its group; when the lease
/// is lost, stops the group (SIGTERM, then SIGKILL after `grace`). Answers
/// how it ended and whether the lease was lost.
async fn watch(
    mut child: Child,
    signals: &mut Signals,
    mut lost_rx: oneshot::Receiver<Lost>,
    id: &str,
    grace: Duration,
) -> (Ending, Option<Lost>) {
    let mut lost: Option<Lost> = None;
    let mut keeper_gone = false;
    let mut kill_at: Option<Instant> = None;
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            signal = signals.recv() => child.signal_group(signal),
            why = &mut lost_rx, if !keeper_gone => {
                keeper_gone = true;
                // A keeper that ended without a word was aborted: not a loss.
                let Ok(why) = why else { continue };
                say(format_args!(
                    "lost the lease on {id}: {why}; sending SIGTERM to the command's process group, SIGKILL after {}",
                    humantime::format_duration(grace)
                ));
                child.signal_group(libc::SIGTERM);
                kill_at = Some(Instant::now() + grace);
                lost = Some(why);
            }
            () = sleep_until_some(kill_at) => {
                kill_at = None;
                child.signal_group(libc::SIGKILL);
            }
        }
    };
    // Whatever the command left running in its group would outlive the
    // lease; it has what is left of the grace (all of it if none began).
    let pgid = child.pgid();
    if group::alive(pgid) {
        let left = kill_at.map_or(grace, |at| at.saturating_duration_since(Instant::now()));
        say(format_args!(
            "stopping what the command left running in its process group: SIGTERM, SIGKILL after {}",
            humantime::format_duration(left)
        ));
        let _ = tokio::task::spawn_blocking(move || group::stop(pgid, left)).await;
    }
    let ending = match status {
        Ok(status) => Ending::from(status),
        Err(err) => {
            say(format_args!("lost track of the command: {err}"));
            Ending::Exited(i32::from(EXIT_UNUSABLE))
        }
    };
    (ending, lost)
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Releases the lease; false when the gateway said it was no longer current.
/// One that cannot be released now ends at its TTL, which is said.
async fn release(gateway: &Gateway, id: &str, lease: &Lease) -> bool {
    match tokio::time::timeout(REQUEST_TIMEOUT, gateway.release(id, &lease.lease_id)).await {
        Ok(Ok(Verdict::Done)) => true,
        Ok(Ok(Verdict::NotCurrent(_))) => false,
        Ok(Err(err)) => {
            say(format_args!(
                "could not release the lease on {id} ({err}); it ends at its TTL"
            ));
            true
        }
        Err(_) => {
            say(format_args!(
                "could not release the lease on {id} (no answer within {REQUEST_TIMEOUT:?}); it ends at its TTL"
            ));
            true
        }
    }
}

fn describe(holder: Option<&Holder>) -> String {
    match holder {
        Some(h) => {
            let mut text = format!("{} since {} until {}", h.owner, h.acquired_at, h.expires_at);
            if let Some(command) = h.command() {
                text.push_str(&format!(", running `{command}`"));
            }
            text
        }
        None => "another holder (the gateway did not name it)".into(),
    }
}
