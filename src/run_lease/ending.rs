//! How a run ended, and the exit status the runner gives for it.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

use super::child::SpawnError;

/// The lock stayed held by another past `--wait`; nothing was run (EX_TEMPFAIL).
pub const EXIT_BUSY: u8 = 75;
/// The lease was lost while the command ran; the command was stopped.
pub const EXIT_LOST: u8 = 76;
/// A bad command line, or a gateway that could not be used before the command started.
pub const EXIT_UNUSABLE: u8 = 1;
/// The command exists but could not be run (as a shell answers).
pub const EXIT_CANNOT_EXECUTE: u8 = 126;
/// The command was not found (as a shell answers).
pub const EXIT_NOT_FOUND: u8 = 127;

/// How a run ended, from which the exit status follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// The command exited with this code.
    Exited(i32),
    /// The command was killed by this signal.
    Signalled(i32),
    /// The runner got this signal before the command started; nothing ran.
    Interrupted(i32),
    /// Another kept the lock past `--wait`; nothing ran.
    Busy,
    /// The lease was lost while the command ran.
    Lost,
    /// The gateway could not be used before the command started; nothing ran.
    Unusable,
    /// The command could not be started.
    NotStarted(SpawnError),
}

/// The runner's exit status for an ending.
pub fn exit_code(ending: Ending) -> u8 {
    match ending {
        // A wait status carries 8 bits of exit code.
        Ending::Exited(code) => (code & 0xff) as u8,
        Ending::Signalled(signal) | Ending::Interrupted(signal) => {
            128u8.saturating_add(u8::try_from(signal).unwrap_or(u8::MAX))
        }
        Ending::Busy => EXIT_BUSY,
        Ending::Lost => EXIT_LOST,
        Ending::Unusable => EXIT_UNUSABLE,
        Ending::NotStarted(SpawnError::NotFound) => EXIT_NOT_FOUND,
        Ending::NotStarted(SpawnError::CannotExecute) => EXIT_CANNOT_EXECUTE,
    }
}

/// How a command that ran ended.
impl From<ExitStatus> for Ending {
    fn from(status: ExitStatus) -> Self {
        match (status.code(), status.signal()) {
            (Some(code), _) => Self::Exited(code),
            (None, Some(signal)) => Self::Signalled(signal),
            (None, None) => Self::Exited(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_contract() {
        assert_eq!(exit_code(Ending::Exited(0)), 0);
        assert_eq!(exit_code(Ending::Exited(3)), 3);
        assert_eq!(exit_code(Ending::Exited(255)), 255);
        assert_eq!(exit_code(Ending::Signalled(libc::SIGKILL)), 137);
        assert_eq!(exit_code(Ending::Signalled(libc::SIGTERM)), 143);
        assert_eq!(exit_code(Ending::Interrupted(libc::SIGINT)), 130);
        assert_eq!(exit_code(Ending::Busy), 75);
        assert_eq!(exit_code(Ending::Lost), 76);
        assert_eq!(exit_code(Ending::Unusable), 1);
        assert_eq!(exit_code(Ending::NotStarted(SpawnError::NotFound)), 127);
        assert_eq!(
            exit_code(Ending::NotStarted(SpawnError::CannotExecute)),
            126
        );
    }

    #[test]
    fn endings_of_a_command() {
        let exited = |code: i32| ExitStatus::from_raw(code << 8);
        assert_eq!(Ending::from(exited(0)), Ending::Exited(0));
        assert_eq!(Ending::from(exited(3)), Ending::Exited(3));
        assert_eq!(
            Ending::from(ExitStatus::from_raw(libc::SIGKILL)),
            Ending::Signalled(libc::SIGKILL)
        );
    }
}
