//! The command's process group, as the runner and its watchdog act on it:
//! signal all of it, see whether anything of it still runs, stop it
//! (SIGTERM, then SIGKILL to whatever still runs after a grace).

use std::time::{Duration, Instant};

/// How often a stopping group is looked at.
pub const POLL: Duration = Duration::from_millis(50);

/// Sends `signal` to every process of the group; false when none was left.
pub fn signal(pgid: libc::pid_t, signal: i32) -> bool {
    // SAFETY: kill(2) on a process group that the runner's command leads;
    // its id is not handed out again while a process of it lives.
    unsafe { libc::kill(-pgid, signal) == 0 }
}

/// Whether a process of the group still runs. A zombie does not: it has
/// ended and waits for whoever reaps orphans (which in a container may
/// never do it).
#[cfg(target_os = "linux")]
pub fn alive(pgid: libc::pid_t) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return signal(pgid, 0);
    };
    entries.flatten().any(|entry| {
        let is_pid = entry
            .file_name()
            .to_str()
            .is_some_and(|name| !name.is_empty() && name.bytes().all(|b| b.is_ascii_digit()));
        is_pid
            && std::fs::read_to_string(entry.path().join("stat"))
                .is_ok_and(|stat| running_in(&stat, pgid))
    })
}

#[cfg(not(target_os = "linux"))]
pub fn alive(pgid: libc::pid_t) -> bool {
    signal(pgid, 0)
}

/// Whether a `/proc/PID/stat` line is of a running process in group `pgid`:
/// after the parenthesised name come the state, the parent and the group.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn running_in(stat: &str, pgid: libc::pid_t) -> bool {
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return false;
    };
    let mut fields = rest.split_whitespace();
    let state = fields.next().unwrap_or("X");
    let group = fields.nth(1).and_then(|g| g.parse::<libc::pid_t>().ok());
    group == Some(pgid) && !matches!(state, "Z" | "X" | "x")
}

/// Blocking: SIGTERM to the group, SIGKILL to whatever still runs `grace`
/// later. Answers whether anything was left to stop.
pub fn stop(pgid: libc::pid_t, grace: Duration) -> bool {
    if !alive(pgid) {
        return false;
    }
    signal(pgid, libc::SIGTERM);
    let kill_at = Instant::now() + grace;
    while alive(pgid) {
        if Instant::now() >= kill_at {
            signal(pgid, libc::SIGKILL);
            break;
        }
        std::thread::sleep(POLL);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_are_read_after_the_name() {
        let line = |state: &str, pgrp: &str| format!("42 (sh) x) {state} 1 {pgrp} 7 0 -1 4194560");
        assert!(running_in(&line("S", "42"), 42));
        assert!(running_in(&line("R", "42"), 42));
        assert!(!running_in(&line("S", "43"), 42));
        assert!(!running_in(&line("Z", "42"), 42), "a zombie has ended");
        assert!(!running_in("garbage", 42));
    }
}
