//! `statehouse lock [--pool NAME=LIMIT]... [STATE_ID] -- COMMAND [ARGS...]`:
//! runs a command while holding a lease on a state_id, so that no two runs
//! of one pipeline overlap, and a slot of each pool named, so that at most
//! a pool's limit of runs use what it stands for at once, whatever starts them.
//!
//! One process: it takes the leases (waiting up to `--wait` for them), runs
//! the command with the state_id's lease in its environment, renews every
//! lease every third of its TTL, passes SIGINT, SIGTERM and SIGHUP on to the
//! command's process group, and releases the leases when the command ends.
//! When a lease is lost (a renewal answers 409, or the gateway stays
//! unreachable until the lease would have expired) the group gets SIGTERM,
//! and SIGKILL after `--grace`; a look at each lease every second between
//! renewals finds a lease ended early (force-unlocked) within 2 s. Nothing of the group outlives the runner:
//! what the command leaves running is stopped before the leases go, and a
//! watchdog process stops the group if the runner dies (`kill -9`).
//!
//! The run itself is here; the command line is in `args`, what a lease is on
//! in `target`, taking, renewing and releasing the leases in `leases`, the
//! gateway client in `client` and `problem`, the renewal schedule in `clock`,
//! how a run ended and its exit status in `ending`, the command in `child`
//! and `group`, the watchdog in `watchdog`, the run's record in `record`.

mod args;
mod child;
mod client;
mod clock;
mod ending;
mod group;
mod info;
mod leases;
pub(crate) mod problem;
mod record;
mod say;
mod target;
mod watchdog;

use std::process::ExitCode;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

pub use self::args::LockArgs;
pub use self::child::SpawnError;
use self::child::{Child, Signals};
pub use self::watchdog::{WatchdogArgs, run as run_watchdog};
use crate::traces;

use self::client::Gateway;
pub use self::ending::{
    EXIT_BUSY, EXIT_CANNOT_EXECUTE, EXIT_LOST, EXIT_NOT_FOUND, EXIT_UNUSABLE, Ending, exit_code,
};
use self::leases::{Leases, LostLease};
use self::say::say;
use self::watchdog::Watchdog;

/// After a signal while acquiring, how long an acquire already sent may
/// take to answer with a grant that is then released.
const SETTLE: Duration = Duration::from_secs(1);

/// How long the run's last spans may take to reach the collector at its end.
const TRACES_FLUSH: Duration = Duration::from_secs(5);

/// Runs `statehouse lock` and answers its exit status.
pub fn run(args: LockArgs) -> ExitCode {
    // With the `OTEL_*` variables set, the run is traced: it joins the
    // orchestrator's `TRACEPARENT` and hands the command one of its own.
    let traced = match traces::start_without_logs() {
        Ok(traced) => traced,
        Err(err) => {
            say(format_args!("{err}; nothing was run"));
            return ExitCode::from(EXIT_UNUSABLE);
        }
    };
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
    let run = tracing::info_span!("statehouse lock");
    traces::join_environment(&run);
    let ending = runtime.block_on(supervise(args).instrument(run));
    if traced {
        traces::flush(TRACES_FLUSH);
    }
    ExitCode::from(exit_code(ending))
}

async fn supervise(args: LockArgs) -> Ending {
    let targets = match args.targets() {
        Ok(targets) => targets,
        Err(err) => {
            say(format_args!("a bad command line: {err}; nothing was run"));
            return Ending::Unusable;
        }
    };
    let owner = args.owner.clone().unwrap_or_else(child::default_owner);
    let gateway = match args.connection.resolve().and_then(|c| Gateway::new(&c)) {
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
    let mut leases = Leases::new(gateway.clone());
    let taken = {
        let taking = leases
            .take(&targets, &owner, &args)
            .instrument(tracing::info_span!("acquire"));
        tokio::pin!(taking);
        tokio::select! {
            taken = &mut taking => taken,
            signal = signals.recv() => {
                // The gateway may be granting a lease at this very moment: a
                // grant that answers within SETTLE is held, and released
                // below with the rest; an acquire still waiting then is
                // abandoned, and the gateway drops it from the line when the
                // connection closes.
                let _ = tokio::time::timeout(SETTLE, &mut taking).await;
                Err(Ending::Interrupted(signal))
            }
        }
    };
    if let Err(ending) = taken {
        leases
            .release_all()
            .instrument(tracing::info_span!("release"))
            .await;
        return ending;
    }
    let state = leases
        .state()
        .map(|(id, lease)| (id.to_owned(), lease.lease_id.clone()));
    let recorded = record::start(
        &gateway,
        &args,
        state
            .as_ref()
            .map(|(id, lease)| (id.as_str(), lease.as_str())),
    )
    .await;
    // The command's `TRACEPARENT` is the hold's: its spans are the hold's children.
    let hold = tracing::info_span!("hold");
    let child = match Child::spawn(
        &args.command,
        leases.state(),
        hold.in_scope(traces::traceparent),
    ) {
        Ok(child) => child,
        Err(err) => {
            say(format_args!(
                "cannot run {}: {err}",
                args.command[0].to_string_lossy()
            ));
            // As a shell answers a command it cannot run: 126 or 127.
            let code = exit_code(Ending::NotStarted(err.kind));
            record::end(&gateway, recorded, Ending::Exited(i32::from(code)), false).await;
            leases.release_all().await;
            return Ending::NotStarted(err.kind);
        }
    };
    if let Err(err) = watchdog.watch(child.pgid()) {
        say(format_args!(
            "the watchdog is gone ({err}): should the runner die, what the command started may outlive it"
        ));
    }
    let (status, lost) = watch(child, &mut signals, &mut leases, args.grace)
        .instrument(hold)
        .await;
    record::end(&gateway, recorded, status, lost.is_some()).await;
    leases
        .finish(status, lost)
        .instrument(tracing::info_span!("release"))
        .await
}

/// Waits for the command, passing signals on to its group; when a lease is
/// lost, stops the group (SIGTERM, then SIGKILL after `grace`). Answers how
/// it ended and the first lease lost, if one was.
async fn watch(
    mut child: Child,
    signals: &mut Signals,
    leases: &mut Leases,
    grace: Duration,
) -> (Ending, Option<LostLease>) {
    let mut lost: Option<LostLease> = None;
    let mut kill_at: Option<Instant> = None;
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            signal = signals.recv() => child.signal_group(signal),
            // After the first loss the group is on its way out; later ones
            // change nothing.
            Some(loss) = leases.next_loss(), if lost.is_none() => {
                say(format_args!(
                    "lost the lease on {}: {}; sending SIGTERM to the command's process group, SIGKILL after {}",
                    loss.what,
                    loss.why,
                    humantime::format_duration(grace)
                ));
                child.signal_group(libc::SIGTERM);
                kill_at = Some(Instant::now() + grace);
                lost = Some(loss);
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
