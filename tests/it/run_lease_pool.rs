//! `statehouse lock --pool NAME=LIMIT [STATE_ID] -- COMMAND`: the binary
//! against a real gateway's pools, with small shell scripts as the command.

use std::time::{Duration, Instant};

use reqwest::StatusCode;

use crate::helpers::{Api, metric, spawn_app};
use crate::run_lease::{
    BIN, STARTS, Scratch, WAIT_FOR_GO, ended, lock_status, lock_with, running, until,
};

/// A command that records when it ran, as `START END` in seconds, in `interval-N`.
fn recorded_second(n: usize) -> String {
    format!("s=$(date +%s.%N); sleep 1; e=$(date +%s.%N); echo \"$s $e\" > interval-{n}")
}

/// The most intervals that overlap at any one moment.
fn most_at_once(intervals: &[(f64, f64)]) -> usize {
    // The most is reached at some interval's start.
    intervals
        .iter()
        .map(|&(at, _)| {
            intervals
                .iter()
                .filter(|&&(start, end)| start <= at && at < end)
                .count()
        })
        .max()
        .unwrap_or(0)
}

#[tokio::test]
async fn four_runs_of_a_pool_of_two_go_two_at_a_time_and_all_finish() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    // Each holds 1 s; the wait is a bound only a hang reaches.
    let flags = ["--pool", "P=2", "--wait", "60s"];
    let runs: Vec<_> = [None, None, Some("dev:job-a"), Some("dev:job-b")]
        .into_iter()
        .enumerate()
        .map(|(n, id)| {
            let args: Vec<&str> = flags.iter().copied().chain(id).collect();
            lock_with(&app.base, &args, &scratch.0, &recorded_second(n))
        })
        .collect();
    for (n, run) in runs.into_iter().enumerate() {
        let (status, stderr) = ended(run, Duration::from_secs(90)).await;
        assert_eq!(status, Some(0), "run {n}: {stderr}");
        assert_eq!(stderr, "", "run {n}: nothing to say");
    }
    let intervals: Vec<(f64, f64)> = (0..4)
        .map(|n| {
            let line = scratch
                .read(&format!("interval-{n}"))
                .unwrap_or_else(|| panic!("run {n} ran its command"));
            let (start, end) = line.trim().split_once(' ').unwrap();
            (start.parse().unwrap(), end.parse().unwrap())
        })
        .collect();
    assert_eq!(
        most_at_once(&intervals),
        2,
        "never more than the limit, and the limit used: {intervals:?}"
    );
    // How soon all four are done is the machine's speed: two at a time,
    // and all done, is the rule.
    // Everything was released.
    app.pool_view("P").await.expect(StatusCode::NOT_FOUND);
    for id in ["dev:job-a", "dev:job-b"] {
        assert_eq!(lock_status(&app, id).await, StatusCode::NOT_FOUND, "{id}");
    }
}

#[tokio::test]
async fn a_full_pool_exits_75_naming_its_holder_and_what_was_taken_is_released() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let holder = lock_with(
        &app.base,
        &["--pool", "P=1", "--owner", "holder-run"],
        &scratch.0,
        WAIT_FOR_GO,
    );
    until(
        "the holder's command starts",
        Duration::from_secs(20),
        || scratch.path("ready").exists(),
    )
    .await;

    let busy = lock_with(
        &app.base,
        &["--pool", "P=1", "--wait", "0s"],
        &scratch.0,
        "touch ran",
    );
    let (status, stderr) = ended(busy, Duration::from_secs(20)).await;
    assert_eq!(status, Some(75), "{stderr}");
    assert!(!scratch.path("ran").exists(), "nothing was run");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    for part in ["pool P", "holder-run", "sh -c touch ready"] {
        assert!(stderr.contains(part), "{part} in {stderr}");
    }

    // Pool A comes before P: taken, then released when P is full.
    let busy = lock_with(
        &app.base,
        &["--pool", "P=1", "--pool", "A=1"],
        &scratch.0,
        "touch ran",
    );
    let (status, stderr) = ended(busy, Duration::from_secs(20)).await;
    assert_eq!(status, Some(75), "{stderr}");
    assert!(!scratch.path("ran").exists());
    app.pool_view("A").await.expect(StatusCode::NOT_FOUND);

    // So is a pool taken before a state_id another holds.
    let (lease_id, _) = app.lease("job", "other-worker", 60, 0.0).await;
    let busy = lock_with(
        &app.base,
        &["--pool", "A=1", "job"],
        &scratch.0,
        "touch ran",
    );
    let (status, stderr) = ended(busy, Duration::from_secs(20)).await;
    assert_eq!(status, Some(75), "{stderr}");
    assert!(stderr.contains("other-worker"), "{stderr}");
    assert!(!scratch.path("ran").exists());
    app.pool_view("A").await.expect(StatusCode::NOT_FOUND);
    app.release("job", &lease_id).await;

    std::fs::write(scratch.path("go"), "").unwrap();
    let (status, stderr) = ended(holder, Duration::from_secs(20)).await;
    assert_eq!(status, Some(0), "{stderr}");
    app.pool_view("P").await.expect(StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn a_pool_lease_ended_by_an_admin_stops_the_command_and_exits_76() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let script = "trap 'touch terminated' TERM; touch ready; while :; do sleep 0.02; done";
    let run = lock_with(
        &app.base,
        &[
            "--pool",
            "P=1",
            "--ttl",
            "9s",
            "--grace",
            "1s",
            "--lock-delay",
            "60s",
            "job",
        ],
        &scratch.0,
        script,
    );
    until("the command starts", STARTS, || {
        scratch.path("ready").exists()
    })
    .await;
    let ended_by_admin = app.pool_end("P", "x").await;
    ended_by_admin.expect(StatusCode::NO_CONTENT);
    // A renewal goes out every third of the TTL (3 s) and finds the lease
    // ended; the command is stopped within the TTL it was given.
    until("SIGTERM", Duration::from_secs(9), || {
        scratch.path("terminated").exists()
    })
    .await;
    let (status, stderr) = ended(run, Duration::from_secs(10)).await;
    assert_eq!(status, Some(76), "{stderr}");
    let lost: Vec<_> = stderr
        .lines()
        .filter(|l| l.contains("lost the lease"))
        .collect();
    assert_eq!(lost.len(), 1, "{stderr}");
    assert!(lost[0].contains("pool P"), "{stderr}");
    assert_eq!(
        lock_status(&app, "job").await,
        StatusCode::NOT_FOUND,
        "the state lease, still current, was released"
    );
    // The ended lease's lock-delay keeps its slot: the next run is busy,
    // told when the slot is free. (The delay is a minute, not the default
    // --grace + 5 s, so that a loaded machine's slower steps above still
    // end inside it.)
    let next = lock_with(&app.base, &["--pool", "P=1"], &scratch.0, "touch ran");
    let (status, stderr) = ended(next, Duration::from_secs(20)).await;
    assert_eq!(status, Some(75), "{stderr}");
    assert!(
        stderr.contains("lock-delays") && stderr.contains("free at"),
        "{stderr}"
    );
    assert!(!scratch.path("ran").exists());
}

#[tokio::test]
async fn a_pool_shows_who_holds_it_and_what_it_runs() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let run = lock_with(
        &app.base,
        &[
            "--pool",
            "P=2",
            "--owner",
            "shown-run",
            "--info",
            "dag=nightly",
        ],
        &scratch.0,
        WAIT_FOR_GO,
    );
    until("the command starts", STARTS, || {
        scratch.path("ready").exists()
    })
    .await;
    let pid = run.id().unwrap();
    let view = app.pool_view("P").await;
    view.expect(StatusCode::OK);
    let view = view.json();
    assert_eq!(view["limit"], 2);
    let holders = view["holders"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "{view}");
    let holder = &holders[0];
    assert_eq!(holder["owner"], "shown-run");
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert_eq!(holder["info"]["host"], host.trim());
    assert_eq!(holder["info"]["pid"], pid);
    assert_eq!(holder["info"]["command"], format!("sh -c {WAIT_FOR_GO}"));
    assert_eq!(holder["info"]["dag"], "nightly");
    assert!(running(i32::try_from(pid).unwrap()));

    std::fs::write(scratch.path("go"), "").unwrap();
    let (status, stderr) = ended(run, Duration::from_secs(20)).await;
    assert_eq!(status, Some(0), "{stderr}");
    app.pool_view("P").await.expect(StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn bad_pool_command_lines_and_a_limit_of_its_own_exit_1_and_run_nothing() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let cases: [(&str, &[&str]); 7] = [
        ("a limit of 0", &["--pool", "P=0"]),
        ("a limit over 1000", &["--pool", "P=1001"]),
        ("no limit", &["--pool", "P"]),
        ("a limit that is no number", &["--pool", "P=two"]),
        ("no name", &["--pool", "=2"]),
        ("a pool twice", &["--pool", "P=2", "--pool", "P=2"]),
        ("neither a pool nor a state_id", &[]),
    ];
    for (case, flags) in cases {
        let output = tokio::process::Command::new(BIN)
            .args(["lock", "--url", &app.base])
            .args(flags)
            .args(["--", "touch", "ran"])
            .current_dir(&scratch.0)
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{case}: {stderr}");
        assert!(!stderr.is_empty(), "{case} says why");
        assert!(!scratch.path("ran").exists(), "{case}: nothing was run");
    }

    // A limit other than the pool's, while it has a holder, is refused.
    let holder = lock_with(&app.base, &["--pool", "P=2"], &scratch.0, WAIT_FOR_GO);
    until(
        "the holder's command starts",
        Duration::from_secs(20),
        || scratch.path("ready").exists(),
    )
    .await;
    let other = lock_with(&app.base, &["--pool", "P=3"], &scratch.0, "touch ran");
    let (status, stderr) = ended(other, Duration::from_secs(20)).await;
    assert_eq!(status, Some(1), "{stderr}");
    assert!(stderr.contains("/v1/pools/P"), "{stderr}");
    assert!(!scratch.path("ran").exists());
    std::fs::write(scratch.path("go"), "").unwrap();
    assert_eq!(ended(holder, Duration::from_secs(20)).await.0, Some(0));
}

/// The PUTs that renewed a pool lease so far.
async fn pool_renewals(app: &Api) -> f64 {
    metric(
        &app.get("/metrics").await.text,
        r#"statehouse_http_requests_total{method="PUT",route="/v1/pools/{name}/{lease_id}",status="200"}"#,
    )
    .unwrap_or(0.0)
}

/// A run takes pool A, then waits for pool P, which another holds: A is
/// renewed meanwhile (twice, past its TTL), and the run goes once P is free.
#[tokio::test]
async fn a_pool_taken_first_is_renewed_while_the_run_waits_for_the_next() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let holder = lock_with(&app.base, &["--pool", "P=1"], &scratch.0, WAIT_FOR_GO);
    until("the holder runs", STARTS, || scratch.path("ready").exists()).await;
    let run = lock_with(
        &app.base,
        &[
            "--pool", "P=1", "--pool", "A=1", "--ttl", "3s", "--wait", "5m",
        ],
        &scratch.0,
        "touch ran",
    );
    let give_up = Instant::now() + STARTS;
    while pool_renewals(&app).await < 2.0 {
        assert!(Instant::now() < give_up, "A was never renewed twice");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!scratch.path("ran").exists(), "the run waits for P");
    std::fs::write(scratch.path("go"), "").unwrap();
    let (status, stderr) = ended(holder, Duration::from_secs(20)).await;
    assert_eq!(status, Some(0), "{stderr}");
    let (status, stderr) = ended(run, Duration::from_secs(20)).await;
    assert_eq!(status, Some(0), "{stderr}");
    assert_eq!(stderr, "", "A outlived its TTL");
    assert!(scratch.path("ran").exists());
}

#[tokio::test]
async fn a_signal_while_waiting_for_a_pool_releases_those_taken() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let holder = lock_with(&app.base, &["--pool", "P=1"], &scratch.0, WAIT_FOR_GO);
    until(
        "the holder's command starts",
        Duration::from_secs(20),
        || scratch.path("ready").exists(),
    )
    .await;
    let run = lock_with(
        &app.base,
        &["--pool", "P=1", "--pool", "A=1", "--wait", "30s"],
        &scratch.0,
        "touch ran",
    );
    let mut taken = false;
    for _ in 0..100 {
        if app.pool_view("A").await.status == StatusCode::OK {
            taken = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(taken, "the run took A before waiting for P");
    let pid = i32::try_from(run.id().unwrap()).unwrap();
    // SAFETY: kill(2) on the runner this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let (status, stderr) = ended(run, Duration::from_secs(5)).await;
    assert_eq!(status, Some(128 + libc::SIGTERM), "{stderr}");
    assert!(!scratch.path("ran").exists(), "nothing was run");
    app.pool_view("A").await.expect(StatusCode::NOT_FOUND);
    std::fs::write(scratch.path("go"), "").unwrap();
    assert_eq!(ended(holder, Duration::from_secs(20)).await.0, Some(0));
}

/// Issue 57, acceptance 6: `--pool P=4:2` holds 2 of the pool's slots
/// while its command runs.
#[tokio::test]
async fn a_run_holds_the_slots_it_names_while_its_command_runs() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let run = lock_with(&app.base, &["--pool", "P=4:2"], &scratch.0, WAIT_FOR_GO);
    until("the command starts", STARTS, || {
        scratch.path("ready").exists()
    })
    .await;
    let view = app.pool_view("P").await;
    view.expect(StatusCode::OK);
    let view = view.json();
    assert_eq!(
        (view["limit"].as_u64(), view["used"].as_u64()),
        (Some(4), Some(2)),
        "{view}"
    );
    assert_eq!(view["holders"][0]["slots"], 2, "{view}");
    std::fs::write(scratch.path("go"), "").unwrap();
    let (status, stderr) = ended(run, Duration::from_secs(20)).await;
    assert_eq!(status, Some(0), "{stderr}");
    app.pool_view("P").await.expect(StatusCode::NOT_FOUND);
}

/// Issue 57, acceptance 6: of two runs waiting on a held pool, the one of
/// the higher `--priority` goes first, though it came second.
#[tokio::test]
async fn the_higher_priority_of_two_waiting_runs_goes_first() {
    let app = spawn_app().await;
    let scratch = Scratch::new();
    let holder = lock_with(&app.base, &["--pool", "P=1"], &scratch.0, WAIT_FOR_GO);
    until("the holder's command starts", STARTS, || {
        scratch.path("ready").exists()
    })
    .await;
    let mut waiting = Vec::new();
    for (n, priority) in [(1_u64, "0"), (2, "5")] {
        let args = ["--pool", "P=1", "--priority", priority, "--wait", "60s"];
        let script = format!("echo {priority} >> order");
        waiting.push(lock_with(&app.base, &args, &scratch.0, &script));
        // Arrival is what the gateway saw: this one is in line.
        let in_line = Instant::now() + Duration::from_secs(20);
        while app.pool_view("P").await.json()["waiting"] != n {
            assert!(
                Instant::now() < in_line,
                "run of priority {priority} never waited"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let view = app.pool_view("P").await.json();
    assert_eq!(
        view["waiters"],
        serde_json::json!([{"priority": 5, "slots": 1}, {"priority": 0, "slots": 1}]),
        "{view}"
    );
    std::fs::write(scratch.path("go"), "").unwrap();
    for run in std::iter::once(holder).chain(waiting) {
        let (status, stderr) = ended(run, Duration::from_secs(30)).await;
        assert_eq!(status, Some(0), "{stderr}");
    }
    assert_eq!(scratch.read("order").as_deref(), Some("5\n0\n"));
}
