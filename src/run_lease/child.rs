//! The command under the lease: started in a process group of its own with
//! the lease in its environment; the signals the runner gets go to its
//! whole group.

use std::ffi::OsString;
use std::io;
use std::process::{ExitStatus, Stdio};
use std::task::Poll;

use axum::http::HeaderValue;
use tokio::signal::unix::{Signal, SignalKind, signal};

use super::client::Lease;
use super::group;

/// The environment the command gets: which state_id its lease is on, the
/// lease to send as `Lease-Id` on writes, and the lease's fencing token.
pub const LEASE_STATE_ID: &str = "STATEHOUSE_LEASE_STATE_ID";
pub const LEASE_ID: &str = "STATEHOUSE_LEASE_ID";
pub const FENCING_TOKEN: &str = "STATEHOUSE_FENCING_TOKEN";

/// Why the command did not start, as a shell would tell it by exit status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpawnError {
    NotFound,
    CannotExecute,
}

#[derive(Debug, thiserror::Error)]
#[error("{source}")]
pub struct StartFailure {
    pub kind: SpawnError,
    source: io::Error,
}

pub struct Child {
    process: tokio::process::Child,
    pid: libc::pid_t,
}

impl Child {
    /// Starts `command` (program and arguments) with the state_id's lease,
    /// if the run holds one, in its environment (a pool's lease has nothing
    /// for the command to write with), as the leader of a new process group,
    /// its standard input /dev/null when the runner's is a terminal. On Linux
    /// the kernel sends it SIGTERM if the runner dies first.
    /// With `traceparent` (traces are on), the command finds it as
    /// `TRACEPARENT`, and its own spans join the run's trace.
    pub fn spawn(
        command: &[OsString],
        state: Option<(&str, &Lease)>,
        traceparent: Option<HeaderValue>,
    ) -> Result<Self, StartFailure> {
        let (program, args) = command
            .split_first()
            .expect("the command line requires a command");
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(args);
        if let Some((id, lease)) = state {
            cmd.env(LEASE_STATE_ID, id)
                .env(LEASE_ID, &lease.lease_id)
                .env(FENCING_TOKEN, lease.fencing_token.to_string());
        }
        if let Some(traceparent) = traceparent.as_ref().and_then(|v| v.to_str().ok()) {
            cmd.env("TRACEPARENT", traceparent);
        }
        cmd.process_group(0)
            // Should the runner unwind past it, the command goes too.
            .kill_on_drop(true);
        // In a background process group, reading the terminal would stop the
        // command for good (SIGTTIN) while the runner renews its lease.
        // SAFETY: isatty(3) only asks about a file descriptor.
        if unsafe { libc::isatty(libc::STDIN_FILENO) } == 1 {
            cmd.stdin(Stdio::null());
        }
        let runner = libc::pid_t::try_from(std::process::id()).expect("a pid fits pid_t");
        // SAFETY: the hook runs in the child between fork and exec; it only
        // makes system calls (prctl, getppid) and allocates nothing.
        unsafe {
            cmd.pre_exec(move || die_with(runner));
        }
        let process = cmd.spawn().map_err(|source| StartFailure {
            kind: match source.kind() {
                io::ErrorKind::NotFound => SpawnError::NotFound,
                _ => SpawnError::CannotExecute,
            },
            source,
        })?;
        let pid = process
            .id()
            .and_then(|pid| libc::pid_t::try_from(pid).ok())
            .expect("a command just started has a pid");
        Ok(Self { process, pid })
    }

    /// Waits for the command to end (cancel safe).
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        self.process.wait().await
    }

    /// The command's process group: its pid, as it leads the group.
    pub fn pgid(&self) -> libc::pid_t {
        self.pid
    }

    /// Sends `signal` to the command's whole group: `meltano run` and the
    /// tap and target it started get it at once, as from a terminal.
    pub fn signal_group(&self, signal: i32) {
        group::signal(self.pid, signal);
    }
}

/// Run in the command between fork and exec: ask the kernel to send it
/// SIGTERM when the runner dies. The watchdog stops the whole group then;
/// this covers the moment before the watchdog knows the group. The death
/// signal follows the thread that forked, which is why the runner forks from
/// its one thread.
#[cfg(target_os = "linux")]
fn die_with(runner: libc::pid_t) -> io::Result<()> {
    // SAFETY: plain system calls on this process.
    unsafe {
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong) != 0 {
            return Err(io::Error::last_os_error());
        }
        // The runner may have died before the call above, and then nothing
        // would send the signal.
        if libc::getppid() != runner {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn die_with(_runner: libc::pid_t) -> io::Result<()> {
    Ok(())
}

/// SIGINT, SIGTERM and SIGHUP, as the runner receives them. One that was
/// ignored when the runner started (`nohup`, a shell's `&`) stays ignored,
/// and so the command inherits it ignored.
pub struct Signals {
    streams: Vec<(i32, Signal)>,
}

impl Signals {
    pub fn install() -> io::Result<Self> {
        let mut streams = Vec::new();
        for (number, kind) in [
            (libc::SIGINT, SignalKind::interrupt()),
            (libc::SIGTERM, SignalKind::terminate()),
            (libc::SIGHUP, SignalKind::hangup()),
        ] {
            if !ignored(number) {
                streams.push((number, signal(kind)?));
            }
        }
        Ok(Self { streams })
    }

    /// The next signal received (cancel safe).
    pub async fn recv(&mut self) -> i32 {
        std::future::poll_fn(|cx| {
            for (number, stream) in &mut self.streams {
                if let Poll::Ready(Some(())) = stream.poll_recv(cx) {
                    return Poll::Ready(*number);
                }
            }
            Poll::Pending
        })
        .await
    }
}

fn ignored(signal: i32) -> bool {
    // SAFETY: with a null new action, sigaction(2) only reads the current one.
    unsafe {
        let mut current: libc::sigaction = std::mem::zeroed();
        libc::sigaction(signal, std::ptr::null(), &mut current) == 0
            && current.sa_sigaction == libc::SIG_IGN
    }
}

/// `<hostname>:<pid>`, the owner a lease has unless told otherwise.
pub fn default_owner() -> String {
    format!("{}:{}", super::info::hostname(), std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_owner_names_host_and_pid() {
        let owner = default_owner();
        let (host, pid) = owner.rsplit_once(':').unwrap();
        assert!(!host.is_empty());
        assert_eq!(pid, std::process::id().to_string());
    }
}
