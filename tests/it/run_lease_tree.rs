//! `statehouse lock` and the command's process tree: a command that starts a
//! child that starts a grandchild, as `meltano run` starts a tap and a
//! target. However the runner ends, nothing of the tree is left.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};

use crate::helpers::spawn_app;
use crate::run_lease::{BIN, STARTS, Scratch, ended, lock, lock_status, pid_in, running, until};

/// The command writes its pid, its child's and its grandchild's; the child
/// and grandchild shrug SIGTERM off when `stubborn`, so only SIGKILL ends them.
fn tree(stubborn: bool) -> String {
    let trap = if stubborn { "trap \"\" TERM; " } else { "" };
    format!(
        "echo $$ > command; sh -c '{trap}echo $$ > child; sleep 300 & echo $! > grandchild; wait'"
    )
}

async fn started(scratch: &Scratch) -> [i32; 3] {
    until("the tree starts", STARTS, || {
        scratch
            .read("grandchild")
            .is_some_and(|pid| pid.ends_with('\n'))
    })
    .await;
    ["command", "child", "grandchild"].map(|name| pid_in(scratch, name))
}

#[tokio::test]
async fn kill_9_of_the_runner_ends_the_whole_tree() {
    let app = spawn_app().await;
    for stubborn in [false, true] {
        let scratch = Scratch::new();
        // The second round takes the id once the first's lease lapsed: no
        // lock-delay in its way. The TTL leaves a loaded machine's renewals
        // room; the waits below are bounds only a hang reaches.
        let mut run = lock(
            &app.base,
            &["--ttl", "6s", "--lock-delay", "0s", "--wait", "30s"],
            "job",
            &scratch.0,
            &tree(stubborn),
        );
        let pids = started(&scratch).await;
        run.start_kill().unwrap();
        let _ = run.wait().await;
        let killed = Instant::now();
        // The watchdog sends SIGTERM at once: the command does not ignore
        // it. Its SIGKILL comes 5 s after (the most grace it gives), so an
        // end within 4 s was the SIGTERM's, however loaded the machine.
        until("the command ends", Duration::from_secs(4), || {
            !running(pids[0])
        })
        .await;
        if stubborn {
            // The same SIGTERM reached the whole group, before the SIGKILL.
            assert!(running(pids[2]), "the grandchild ignores SIGTERM");
        }
        until(
            "nothing of the tree runs",
            Duration::from_secs(30).saturating_sub(killed.elapsed()),
            || pids.iter().all(|&pid| !running(pid)),
        )
        .await;
        // Nobody renews it now: it lapses, and the next run may go.
        let mut lapsed = false;
        while killed.elapsed() < Duration::from_secs(30) && !lapsed {
            lapsed = lock_status(&app, "job").await == StatusCode::NOT_FOUND;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(lapsed, "the lease outlived its TTL");
    }
}

#[tokio::test]
async fn a_lost_lease_ends_the_grandchild_too() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let run = lock(
        &app.base,
        &["--ttl", "9s", "--grace", "1s"],
        "job",
        &scratch.0,
        &tree(true),
    );
    let pids = started(&scratch).await;
    let unlocked = app
        .request(Method::DELETE, "/v1/locks/job", None, &[])
        .await;
    unlocked.expect(StatusCode::NO_CONTENT);
    // The next renewal (every 3 s) finds the lease gone: a bound only a
    // hang reaches.
    let (status, stderr) = ended(run, Duration::from_secs(30)).await;
    assert_eq!(status, Some(76), "{stderr}");
    assert!(stderr.contains("process group"), "{stderr}");
    // The runner ended after its 1 s grace: a bound only a hang reaches.
    until("nothing of the tree runs", Duration::from_secs(10), || {
        pids.iter().all(|&pid| !running(pid))
    })
    .await;
    assert_eq!(lock_status(&app, "job").await, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn what_the_command_leaves_behind_gets_sigterm_then_sigkill_after_the_grace() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let script = "sh -c 'trap \"\" TERM; sleep 300 & echo $! > stubborn; wait' & sleep 300 & echo $! > meek; until [ -s stubborn ]; do sleep 0.02; done; exit 0";
    let started = Instant::now();
    let run = lock(&app.base, &["--grace", "1s"], "job", &scratch.0, script);
    let (status, stderr) = ended(run, Duration::from_secs(20)).await;
    assert_eq!(status, Some(0), "{stderr}");
    assert!(
        stderr.contains("stopping what the command left running"),
        "{stderr}"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "the grace was given"
    );
    for name in ["meek", "stubborn"] {
        assert!(!running(pid_in(&scratch, name)), "{name} is gone");
    }
}

#[test]
fn the_watchdog_is_not_in_the_help() {
    let output = std::process::Command::new(BIN)
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8(output.stdout).unwrap();
    assert!(help.contains("lock"), "{help}");
    assert!(!help.contains("watchdog"), "{help}");
}
