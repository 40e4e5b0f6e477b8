//! The watchdog: a small process outside the command's process group that
//! stops the group when the runner is gone, however it went (`kill -9`
//! too). The runner starts it as `statehouse lock-watchdog` and keeps the
//! write end of a pipe whose read end is the watchdog's standard input: the
//! kernel closes it when the runner dies, and the watchdog reads EOF.
//!
//! A subreaper would not do: it inherits orphans only while it lives, and
//! the kernel's parent-death signal reaches the direct child only, not what
//! it started (a tap and a target under `meltano run`).

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::time::Duration;

use clap::Args;

use super::group;

/// Once the runner is dead, the group gets at most this long between
/// SIGTERM and SIGKILL, whatever `--grace` says: nobody waits for it.
pub const MAX_GRACE_AFTER_DEATH: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Args)]
pub struct WatchdogArgs {
    /// Between SIGTERM and SIGKILL (at most 5s).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub grace: Duration,
}

/// The runner's end of the watchdog: dropping it, or the runner's death,
/// tells the watchdog that the runner is gone.
pub struct Watchdog {
    pipe: File,
}

impl Watchdog {
    /// Starts `statehouse lock-watchdog` in a process group of its own, so
    /// that a signal to the runner's group (Ctrl-C) does not end it.
    pub fn start(grace: Duration) -> io::Result<Self> {
        let (read, write) = pipe()?;
        let mut grace_arg = OsString::from("--grace=");
        grace_arg.push(format!(
            "{}ms",
            grace.min(MAX_GRACE_AFTER_DEATH).as_millis()
        ));
        std::process::Command::new(this_program()?)
            .arg("lock-watchdog")
            .arg(grace_arg)
            .stdin(Stdio::from(read))
            .stdout(Stdio::null())
            .process_group(0)
            .spawn()?;
        Ok(Self {
            pipe: File::from(write),
        })
    }

    /// Names the group to stop; written once the command runs.
    pub fn watch(&mut self, pgid: libc::pid_t) -> io::Result<()> {
        writeln!(self.pipe, "{pgid}")
    }
}

/// The runner's own binary. On Linux `/proc/self/exe` still runs it after
/// an upgrade replaced the file, where its path would name the new one (or
/// nothing).
#[cfg(target_os = "linux")]
fn this_program() -> io::Result<PathBuf> {
    Ok(PathBuf::from("/proc/self/exe"))
}

#[cfg(not(target_os = "linux"))]
fn this_program() -> io::Result<PathBuf> {
    std::env::current_exe()
}

/// A pipe whose ends close on exec: only the watchdog's standard input
/// (a copy made for it) stays open in another process.
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2(2) writes two new descriptors into `fds`.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just made and are owned here only.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// `statehouse lock-watchdog`: waits for EOF on standard input, then stops
/// the process group named on its first line if anything of it still runs.
pub fn run(args: &WatchdogArgs) -> ExitCode {
    // The runner passes these signals on to the command; here they would
    // only end the one process that outlives the runner.
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: signal(2) setting a disposition, no handler.
        unsafe { libc::signal(signal, libc::SIG_IGN) };
    }
    let mut input = String::new();
    let _ = io::stdin().lock().read_to_string(&mut input);
    let Some(pgid) = input
        .lines()
        .next()
        .and_then(|line| line.trim().parse::<libc::pid_t>().ok())
        .filter(|&pgid| pgid > 1)
    else {
        return ExitCode::SUCCESS;
    };
    if group::alive(pgid) {
        eprintln!(
            "statehouse lock-watchdog: the runner is gone; stopping its command (process group {pgid})"
        );
        group::stop(pgid, args.grace.min(MAX_GRACE_AFTER_DEATH));
    }
    ExitCode::SUCCESS
}
