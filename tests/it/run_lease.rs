//! `statehouse lock STATE_ID -- COMMAND`: the binary against a real gateway,
//! with small shell scripts as the command (the shim's tests run `meltano
//! run` under it).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::json;

use crate::helpers::{Api, encode_id, metric, spawn_app, spawn_app_with};
use crate::proxy::Proxy;

pub const BIN: &str = env!("CARGO_BIN_EXE_statehouse");

/// A scratch directory for one test's scripts to leave marks in.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("statehouse-lock-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    pub fn read(&self, name: &str) -> Option<String> {
        std::fs::read_to_string(self.path(name)).ok()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `statehouse lock --url BASE FLAGS... ID -- sh -c SCRIPT`, run in `dir`,
/// with the default action for the signals it passes on.
pub fn lock(
    base: &str,
    flags: &[&str],
    id: &str,
    dir: &Path,
    script: &str,
) -> tokio::process::Child {
    lock_with(base, &[flags, &[id]].concat(), dir, script)
}

/// `statehouse lock --url BASE ARGS... -- sh -c SCRIPT`, as [`lock`] runs
/// it: ARGS are the flags and, if any, the state_id.
pub fn lock_with(base: &str, args: &[&str], dir: &Path, script: &str) -> tokio::process::Child {
    let mut runner = tokio::process::Command::new(BIN);
    // Tests started in the background (`nohup scripts/test &`) inherit SIGINT
    // and SIGHUP ignored from the shell, and the runner rightly keeps an
    // ignored signal ignored: the signals these tests send would not arrive.
    // SAFETY: signal(2) is async-signal-safe, so fit to run between fork and exec.
    unsafe {
        runner.pre_exec(|| {
            for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
                if libc::signal(signal, libc::SIG_DFL) == libc::SIG_ERR {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    runner
        .args(["lock", "--url", base])
        .args(args)
        .args(["--", "sh", "-c", script])
        .current_dir(dir)
        .env_remove("STATEHOUSE_TOKEN")
        .env_remove("STATEHOUSE_LOCK_OWNER")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("statehouse lock starts")
}

/// How long a runner and its command may take to start: a bound only a
/// hang reaches (a loaded 2-core machine has taken over 20 s).
pub const STARTS: Duration = Duration::from_secs(60);

/// The runner's exit code and stderr, once it has ended (within `within`).
pub async fn ended(child: tokio::process::Child, within: Duration) -> (Option<i32>, String) {
    let output = tokio::time::timeout(within, child.wait_with_output())
        .await
        .expect("the runner ended in time")
        .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Polls `done` every 20 ms; panics naming `what` after `within`.
pub async fn until(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether `pid` is a process that still runs (a zombie has ended).
pub fn running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => false,
    }
}

pub fn pid_in(scratch: &Scratch, name: &str) -> i32 {
    scratch.read(name).unwrap().trim().parse().unwrap()
}

pub async fn lock_status(app: &Api, id: &str) -> StatusCode {
    app.get(&format!("/v1/locks/{}", encode_id(id)))
        .await
        .status
}

/// Waits for a script to touch `ready`, then tells it to go on by creating `go`.
pub const WAIT_FOR_GO: &str = "touch ready; while [ ! -e go ]; do sleep 0.02; done";

#[tokio::test]
async fn the_commands_exit_status_comes_back_and_the_lease_is_released() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    for (script, code) in [
        ("exit 0", 0),
        ("exit 3", 3),
        ("kill -TERM $$", 128 + 15),
        ("kill -KILL $$", 128 + 9),
    ] {
        let run = lock(&app.base, &[], "job", &scratch.0, script);
        let (status, stderr) = ended(run, Duration::from_secs(20)).await;
        assert_eq!(status, Some(code), "{script}: {stderr}");
        assert_eq!(stderr, "", "{script}: nothing to say");
        assert_eq!(lock_status(&app, "job").await, StatusCode::NOT_FOUND);
    }
}

#[tokio::test]
async fn the_command_holds_the_lease_from_its_environment() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let script = format!(
        r#"printf '%s\n%s\n%s\n' "$STATEHOUSE_LEASE_STATE_ID" "$STATEHOUSE_LEASE_ID" "$STATEHOUSE_FENCING_TOKEN" > env; {WAIT_FOR_GO}"#
    );
    let run = lock(
        &app.base,
        &["--owner", "nightly-orders"],
        "dev:tap-orders-to-target-dw",
        &scratch.0,
        &script,
    );
    until("the command starts", STARTS, || {
        scratch.path("ready").exists()
    })
    .await;
    let env = scratch.read("env").unwrap();
    let [state_id, lease_id, token] = env.lines().collect::<Vec<_>>()[..] else {
        panic!("three lines: {env}");
    };
    assert_eq!(state_id, "dev:tap-orders-to-target-dw");
    let view = app
        .get(&format!("/v1/locks/{}", encode_id(state_id)))
        .await
        .json();
    assert_eq!(view["owner"], "nightly-orders");
    assert_eq!(view["fencing_token"].to_string(), token);
    // Writes with the command's lease land; others are refused while it runs.
    let doc = json!({"completed": {"singer_state": {"n": 1}}});
    let written = app.put_state_with_lease(state_id, &doc, lease_id).await;
    written.expect(StatusCode::CREATED);
    let other = app.put_state(state_id, &doc).await;
    other.expect(StatusCode::CONFLICT);
    assert_eq!(other.problem_type(), "state-locked");

    std::fs::write(scratch.path("go"), "").unwrap();
    let (status, stderr) = ended(run, Duration::from_secs(20)).await;
    assert_eq!(status, Some(0), "{stderr}");
    let after = app.put_state_with_lease(state_id, &doc, lease_id).await;
    after.expect_because(
        StatusCode::CONFLICT,
        "the lease was released when the command ended",
    );
}

#[tokio::test]
async fn a_lock_held_by_another_exits_75_at_once_naming_the_holder() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let (lease_id, _) = app.lease("job", "other-worker@host-b:42", 60, 0.0).await;
    // No wait by default: one that waited for the 60 s hold would not have
    // ended within `ended`'s 20 s.
    let run = lock(&app.base, &[], "job", &scratch.0, "touch ran");
    let (status, stderr) = ended(run, Duration::from_secs(20)).await;
    assert_eq!(status, Some(75), "{stderr}");
    assert!(!scratch.path("ran").exists(), "nothing was run");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    let holder = app.get("/v1/locks/job").await.json();
    for part in [
        "other-worker@host-b:42",
        holder["acquired_at"].as_str().unwrap(),
        holder["expires_at"].as_str().unwrap(),
    ] {
        assert!(stderr.contains(part), "{part} in {stderr}");
    }

    // With --wait shorter than the hold, the same, after the wait.
    let started = Instant::now();
    let run = lock(&app.base, &["--wait", "1s"], "job", &scratch.0, "touch ran");
    let (status, stderr) = ended(run, Duration::from_secs(20)).await;
    assert_eq!(status, Some(75), "{stderr}");
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert!(!scratch.path("ran").exists());
    app.release("job", &lease_id).await;
}

#[tokio::test]
async fn with_a_wait_it_runs_once_the_holder_lets_go() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let (lease_id, _) = app.lease("job", "first", 60, 0.0).await;
    let run = lock(
        &app.base,
        &["--wait", "30s"],
        "job",
        &scratch.0,
        "touch ran",
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(!scratch.path("ran").exists(), "it waits for the holder");
    app.release("job", &lease_id)
        .await
        .expect(StatusCode::NO_CONTENT);
    let (status, stderr) = ended(run, Duration::from_secs(20)).await;
    assert_eq!(status, Some(0), "{stderr}");
    assert!(scratch.path("ran").exists());
}

#[tokio::test]
async fn a_signal_while_waiting_in_line_leaves_the_id_free() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    // The holder lets go just before the signal (the runner may be granted
    // the lease as it is interrupted) and just after (it must not be). On a
    // loaded machine the grant may even start the command before the
    // signal comes: the signal then ends the command too, before it could
    // write anything, so the outcome is the same (143, nothing done, the id
    // free), however the two raced.
    let waits = async || {
        let text = app.get("/metrics").await.text;
        metric(&text, r#"statehouse_lock_events_total{event="wait"}"#).unwrap_or(0.0)
    };
    for release_first in [true, false] {
        let (lease_id, _) = app.lease("job", "first", 60, 0.0).await;
        let before = waits().await;
        let run = lock(
            &app.base,
            &["--wait", "30s"],
            "job",
            &scratch.0,
            "sleep 10; touch ran",
        );
        // The signal comes once the runner waits in line, however long it
        // took to start.
        let give_up = Instant::now() + STARTS;
        while waits().await == before {
            assert!(Instant::now() < give_up, "the runner never waited in line");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let pid = i32::try_from(run.id().unwrap()).unwrap();
        // SAFETY: kill(2) on the runner this test started.
        let interrupt = || assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        if !release_first {
            interrupt();
        }
        app.release("job", &lease_id).await;
        if release_first {
            interrupt();
        }
        // Bounds only a hang reaches: a grant the runner kept would hold the
        // id for its 30 s TTL, and the runner would wait 30 s in line.
        let at = Instant::now();
        let (status, stderr) = ended(run, Duration::from_secs(15)).await;
        assert_eq!(status, Some(128 + libc::SIGTERM), "{stderr}");
        assert!(!scratch.path("ran").exists(), "nothing was run");
        while lock_status(&app, "job").await != StatusCode::NOT_FOUND {
            assert!(
                at.elapsed() < Duration::from_secs(15),
                "the id is still held"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // And no grant shows up later.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(lock_status(&app, "job").await, StatusCode::NOT_FOUND);
    }
}

#[tokio::test]
async fn it_renews_every_third_of_the_ttl_while_the_command_runs() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let run = lock(
        &app.base,
        &["--ttl", "2s", "--no-run"],
        "job",
        &scratch.0,
        "sleep 4",
    );
    let (status, stderr) = ended(run, Duration::from_secs(20)).await;
    assert_eq!(status, Some(0), "{stderr}");
    assert_eq!(stderr, "", "the lease lived through two TTLs");
    let metrics = app.get("/metrics").await.text;
    let renewals = metric(
        &metrics,
        r#"statehouse_http_requests_total{method="PUT",route="/v1/locks/{state_id}/{lease_id}",status="200"}"#,
    )
    .unwrap_or(0.0);
    // Every 667 ms for 4 s: 6. Outliving two TTLs takes two at least, and a
    // loaded machine only delays them, so never more than 7 (one for the
    // phase).
    assert!((2.0..=7.0).contains(&renewals), "{renewals} renewals");
}

#[tokio::test]
async fn sigint_sigterm_and_sighup_reach_the_command() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    for (signal, name) in [
        (libc::SIGINT, "INT"),
        (libc::SIGTERM, "TERM"),
        (libc::SIGHUP, "HUP"),
    ] {
        let _ = std::fs::remove_file(scratch.path("ready"));
        let script = format!(
            "trap 'echo {name} > got; exit 0' {name}; touch ready; while :; do sleep 0.02; done"
        );
        let run = lock(&app.base, &[], "job", &scratch.0, &script);
        until("the command starts", STARTS, || {
            scratch.path("ready").exists()
        })
        .await;
        let pid = i32::try_from(run.id().unwrap()).unwrap();
        // SAFETY: kill(2) on the runner this test started.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
        let (status, stderr) = ended(run, Duration::from_secs(20)).await;
        assert_eq!(status, Some(0), "SIG{name}: {stderr}");
        assert_eq!(
            scratch.read("got").as_deref(),
            Some(format!("{name}\n").as_str())
        );
        assert_eq!(lock_status(&app, "job").await, StatusCode::NOT_FOUND);
    }
}

#[tokio::test]
async fn a_force_unlock_stops_the_command_and_exits_76() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    // The command shrugs SIGTERM off, so SIGKILL after the grace ends it,
    // and what it started in the background too.
    let script = "sleep 60 & echo $! > background; trap 'touch terminated' TERM; touch ready; while :; do sleep 0.02; done";
    let run = lock(
        &app.base,
        &["--ttl", "3s", "--grace", "1s"],
        "job",
        &scratch.0,
        script,
    );
    until("the command starts", STARTS, || {
        scratch.path("ready").exists()
    })
    .await;
    let background = pid_in(&scratch, "background");
    let unlocked = app
        .request(Method::DELETE, "/v1/locks/job", None, &[])
        .await;
    unlocked.expect(StatusCode::NO_CONTENT);
    let at = Instant::now();
    until("SIGTERM", Duration::from_secs(5), || {
        scratch.path("terminated").exists()
    })
    .await;
    let took = at.elapsed();
    // The next renewal (every third of the TTL, 1 s) finds the lease gone;
    // the rule is that the command is stopped within the TTL it was given.
    assert!(took < Duration::from_secs(3), "SIGTERM after {took:?}");
    let (status, stderr) = ended(run, Duration::from_secs(10)).await;
    assert_eq!(status, Some(76), "{stderr}");
    let lost: Vec<_> = stderr
        .lines()
        .filter(|l| l.contains("lost the lease"))
        .collect();
    assert_eq!(lost.len(), 1, "one line says the lease was lost: {stderr}");
    assert!(
        at.elapsed() >= took + Duration::from_millis(900),
        "SIGKILL after the grace"
    );
    until(
        "the background process is killed",
        Duration::from_secs(5),
        || !running(background),
    )
    .await;
}

#[tokio::test]
async fn a_gateway_unreachable_until_the_lease_would_expire_loses_it() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let upstream = app.base.trim_start_matches("http://").parse().unwrap();
    let proxy = Proxy::start(upstream).await;
    let through = format!("http://{}", proxy.addr);
    let run = lock(
        &through,
        &["--ttl", "3s", "--grace", "0s", "--lock-delay", "0s"],
        "job",
        &scratch.0,
        &format!("trap 'touch terminated' TERM; {WAIT_FOR_GO}"),
    );
    until("the command starts", STARTS, || {
        scratch.path("ready").exists()
    })
    .await;
    proxy.set_down(true);
    let down = Instant::now();
    let (status, stderr) = ended(run, Duration::from_secs(15)).await;
    let took = down.elapsed();
    assert_eq!(status, Some(76), "{stderr}");
    // The last renewal got through at most a third of the TTL before the
    // proxy went down (later on a loaded machine, which delays renewals),
    // so the lease would have lived 2 to 3 s more: the runner does not
    // give up at its first failed renewal (1 s), and the upper bound only
    // catches one that never gives up.
    assert!(
        (Duration::from_secs(1)..Duration::from_secs(10)).contains(&took),
        "lost after {took:?}: {stderr}"
    );
    assert!(stderr.contains("could not renew the lease"), "{stderr}");
    let lost: Vec<_> = stderr
        .lines()
        .filter(|l| l.contains("lost the lease"))
        .collect();
    assert_eq!(lost.len(), 1, "{stderr}");
    assert!(lost[0].contains("would have expired"), "{stderr}");
    // The runner gave up no later than the gateway's lease ends (its clock
    // counts from each send): the next runner gets it once it has.
    let next = lock(&app.base, &["--wait", "5s"], "job", &scratch.0, "exit 0");
    assert_eq!(ended(next, Duration::from_secs(20)).await.0, Some(0));
}

#[tokio::test]
async fn kill_9_of_the_runner_takes_the_command_with_it_and_the_lease_ends_by_its_ttl() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let mut run = lock(
        &app.base,
        &["--ttl", "2s", "--lock-delay", "3s"],
        "job",
        &scratch.0,
        "echo $$ > command; exec sleep 60",
    );
    until("the command starts", STARTS, || {
        scratch
            .read("command")
            .is_some_and(|pid| pid.ends_with('\n'))
    })
    .await;
    let command = pid_in(&scratch, "command");
    run.start_kill().unwrap();
    let _ = run.wait().await;
    let killed = Instant::now();
    until(
        "the command dies with its runner",
        Duration::from_secs(2),
        || !running(command),
    )
    .await;
    // Nobody renews or releases it now: it lapses within its TTL.
    let mut lapsed = false;
    while killed.elapsed() < Duration::from_secs(6) {
        if lock_status(&app, "job").await == StatusCode::NOT_FOUND {
            lapsed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(lapsed, "the lease outlived its TTL");
    // Its lock-delay keeps the next run out a while: busy, naming when it ends.
    let refused = lock(&app.base, &[], "job", &scratch.0, "exit 0");
    let (status, stderr) = ended(refused, Duration::from_secs(20)).await;
    assert_eq!(status, Some(75), "{stderr}");
    assert!(stderr.contains("free"), "{stderr}");
    let next = lock(&app.base, &["--wait", "10s"], "job", &scratch.0, "exit 0");
    assert_eq!(ended(next, Duration::from_secs(20)).await.0, Some(0));
}

#[tokio::test]
async fn what_the_command_leaves_running_is_killed_before_the_lease_goes() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let run = lock(
        &app.base,
        &[],
        "job",
        &scratch.0,
        "sleep 60 & echo $! > left; exit 0",
    );
    let (status, stderr) = ended(run, Duration::from_secs(20)).await;
    assert_eq!(status, Some(0), "{stderr}");
    assert!(
        stderr.contains("stopping what the command left running"),
        "{stderr}"
    );
    let left = pid_in(&scratch, "left");
    until("the leftover is gone", Duration::from_secs(2), || {
        !running(left)
    })
    .await;
}

#[tokio::test]
async fn bad_command_lines_and_unusable_gateways_exit_1_and_run_nothing() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let closed = crate::helpers::ClosedPort::bind();
    let dead = closed.url();
    let cases: [(&str, Vec<&str>); 6] = [
        (
            "no --",
            vec!["lock", "--url", &app.base, "job", "touch", "ran"],
        ),
        ("no command", vec!["lock", "--url", &app.base, "job", "--"]),
        (
            "a TTL the gateway cannot take",
            vec![
                "lock", "--url", &app.base, "--ttl", "500ms", "job", "--", "touch", "ran",
            ],
        ),
        (
            "https, nothing listening",
            vec![
                "lock",
                "--url",
                "https://127.0.0.1:1",
                "job",
                "--",
                "touch",
                "ran",
            ],
        ),
        (
            "nothing listening",
            vec!["lock", "--url", &dead, "job", "--", "touch", "ran"],
        ),
        (
            "a state_id the gateway refuses",
            vec!["lock", "--url", &app.base, "", "--", "touch", "ran"],
        ),
    ];
    for (case, argv) in cases {
        let output = tokio::process::Command::new(BIN)
            .args(&argv)
            .current_dir(&scratch.0)
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{case}: {stderr}");
        assert!(!stderr.is_empty(), "{case} says why");
        assert!(!scratch.path("ran").exists(), "{case}: nothing was run");
    }

    // A command that cannot be found is the shell's 127, and the lease goes.
    let output = tokio::process::Command::new(BIN)
        .args([
            "lock",
            "--url",
            &app.base,
            "job",
            "--",
            "no-such-command-here",
        ])
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(127));
    assert_eq!(lock_status(&app, "job").await, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn meltanos_own_settings_are_enough_to_find_the_gateway_and_its_token() {
    const WRITE: &str = "write-token-0123456789";
    let app = spawn_app_with(|config| {
        let mut tokens = statehouse::auth::Tokens::default();
        tokens.add("test", &format!("write {WRITE}"), ',').unwrap();
        config.tokens = tokens;
    })
    .await;
    let scratch = Scratch::new();
    let uri = app.base.replacen("http://", "statehouse://", 1);
    // Only what a Meltano project sets; nothing of the runner's own.
    let run = |token: Option<&str>| {
        let mut runner = tokio::process::Command::new(BIN);
        runner
            .args([
                "lock",
                "job",
                "--",
                "sh",
                "-c",
                "echo $STATEHOUSE_LEASE_ID > ran",
            ])
            .current_dir(&scratch.0)
            .env_remove("STATEHOUSE_URL")
            .env_remove("STATEHOUSE_TOKEN")
            .env_remove("STATEHOUSE_TOKEN_FILE")
            .env("MELTANO_STATE_BACKEND_URI", &uri)
            .env_remove("MELTANO_STATE_BACKEND_STATEHOUSE_TOKEN")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(token) = token {
            runner.env("MELTANO_STATE_BACKEND_STATEHOUSE_TOKEN", token);
        }
        runner.spawn().unwrap()
    };

    let (status, stderr) = ended(run(None), Duration::from_secs(20)).await;
    assert_eq!(status, Some(1), "the gateway wants a token: {stderr}");
    assert!(!scratch.path("ran").exists(), "nothing was run");

    let (status, stderr) = ended(run(Some(WRITE)), Duration::from_secs(20)).await;
    assert_eq!(status, Some(0), "{stderr}");
    let lease = scratch.read("ran").unwrap();
    assert!(!lease.trim().is_empty(), "it ran under a lease");
    let bearer = format!("Bearer {WRITE}");
    let after = app
        .request(
            Method::GET,
            "/v1/locks/job",
            None,
            &[("authorization", &bearer)],
        )
        .await;
    after.expect_because(StatusCode::NOT_FOUND, "and released it");
}

#[test]
fn help_documents_every_flag_with_its_env_var_and_the_exit_codes() {
    let output = std::process::Command::new(BIN)
        .args(["lock", "--help"])
        .output()
        .unwrap();
    assert!(output.status.success());
    let help = String::from_utf8(output.stdout).unwrap();
    for (flag, env) in [
        ("--url", "STATEHOUSE_URL"),
        ("--token", "STATEHOUSE_TOKEN"),
        ("--owner", "STATEHOUSE_LOCK_OWNER"),
        ("--ttl", "STATEHOUSE_LOCK_TTL"),
        ("--wait", "STATEHOUSE_LOCK_WAIT"),
        ("--grace", "STATEHOUSE_LOCK_GRACE"),
        ("--lock-delay", "STATEHOUSE_LOCK_DELAY"),
        ("--token-file", "STATEHOUSE_TOKEN_FILE"),
        ("--ca-file", "STATEHOUSE_CA_FILE"),
        ("--client-cert-file", "STATEHOUSE_CLIENT_CERT_FILE"),
        ("--client-key-file", "STATEHOUSE_CLIENT_KEY_FILE"),
    ] {
        assert!(help.contains(flag), "{flag} missing from --help");
        assert!(help.contains(&format!("env: {env}")), "{env} missing");
    }
    for code in ["75", "76"] {
        assert!(help.contains(code), "exit code {code} missing from --help");
    }
    assert!(
        help.contains("--pool <NAME=LIMIT>"),
        "--pool missing from --help"
    );
    for meltano in [
        "MELTANO_STATE_BACKEND_URI",
        "MELTANO_STATE_BACKEND_STATEHOUSE_TOKEN",
        "MELTANO_STATE_BACKEND_STATEHOUSES_TOKEN",
    ] {
        assert!(help.contains(meltano), "the fallback to {meltano} missing");
    }
}
