//! `statehouse wait` (issue 42, acceptance 11): the binary against real
//! gateways. It waits through gateway B on writes made through gateway A,
//! compares as the regression guard compares, exits 0 at once when the value
//! is already reached, 124 at `--timeout`, `--changed` at the next change,
//! and 1 for a gateway that cannot be reached (issue 53).
//!
//! Timing: how soon it exits after the write (the acceptance's 2 s across
//! gateways) is the long-poll's delay, which `bench/watch` measures. Here
//! an exit within [`HANG`], well inside each command's own `--timeout`,
//! shows it exited on the change and not at its timeout (which is 124).

use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;

use crate::helpers::{Api, ClosedPort, peer_config, spawn_app, spawn_configured, unique_schema};
use crate::run_lease::BIN;

/// Long enough for a process just started to have read the state and be
/// waiting in a long-poll.
const SETTLE: Duration = Duration::from_millis(1500);
/// A bound that only a hang reaches: the command's own --timeout is longer
/// than any test waits for an exit it expects.
const HANG: Duration = Duration::from_secs(20);
/// The acceptance's bound for giving up on a closed port (the command's own
/// is 20 s without an answer; a refused connection takes no time).
const CLOSED_PORT: Duration = Duration::from_secs(30);

/// A state with stream `s`'s bookmark at `value` (JSON).
fn at(value: Value) -> Value {
    json!({"completed": {"singer_state": {"bookmarks": {"s": {
        "replication_key": "updated_at", "replication_key_value": value}}}}, "partial": {}})
}

fn fresh_id(name: &str) -> String {
    format!("wait-cli-{name}-{}", uuid::Uuid::new_v4().simple())
}

/// `statehouse wait --url BASE ARGS...` against `api`, with no token or
/// Meltano setting from the environment of the tests.
fn wait(api: &Api, args: &[&str]) -> tokio::process::Child {
    wait_at(&api.base, args)
}

/// `statehouse wait --url BASE ARGS...`, as [`wait`] runs it.
fn wait_at(base: &str, args: &[&str]) -> tokio::process::Child {
    tokio::process::Command::new(BIN)
        .args(["wait", "--url", base])
        .args(args)
        .env_remove("STATEHOUSE_TOKEN")
        .env_remove("STATEHOUSE_URL")
        .env_remove("MELTANO_STATE_BACKEND_URI")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("statehouse runs")
}

/// The exit status and stderr of `child`, which must end within [`HANG`].
async fn ended(child: tokio::process::Child) -> (ExitStatus, String) {
    ended_within(child, HANG).await
}

/// The exit status and stderr of `child`, which must end within `bound`.
async fn ended_within(mut child: tokio::process::Child, bound: Duration) -> (ExitStatus, String) {
    let mut stderr = child.stderr.take().unwrap();
    let status = tokio::time::timeout(bound, child.wait())
        .await
        .expect("statehouse wait ends")
        .unwrap();
    let mut text = String::new();
    stderr.read_to_string(&mut text).await.unwrap();
    (status, text)
}

/// Asserts `child` is still waiting.
fn waiting(child: &mut tokio::process::Child, why: &str) {
    assert!(child.try_wait().unwrap().is_none(), "still waits: {why}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn through_gateway_b_it_exits_once_a_write_through_a_reaches_the_instant() {
    let schema = unique_schema();
    let a = spawn_configured(peer_config(&schema)).await;
    let b = spawn_configured(peer_config(&schema)).await;
    let id = fresh_id("across");
    a.put_state(&id, &at(json!("2023-12-31T23:00:00Z")))
        .await
        .expect(StatusCode::CREATED);

    let mut child = wait(
        &b,
        &[
            "--stream=s",
            "--until=2024-01-01T00:30:00Z",
            "--timeout=60s",
            &id,
        ],
    );
    tokio::time::sleep(SETTLE).await;
    waiting(&mut child, "23:00Z is short of 00:30Z");
    // 02:00+02:00 is 00:00Z: still short, whatever its hour reads.
    a.put_state(&id, &at(json!("2024-01-01T02:00:00+02:00")))
        .await
        .expect(StatusCode::OK);
    tokio::time::sleep(SETTLE).await;
    waiting(&mut child, "02:00+02:00 is 00:00Z");
    // 02:30+02:00 is 00:30Z: reached.
    a.put_state(&id, &at(json!("2024-01-01T02:30:00+02:00")))
        .await
        .expect(StatusCode::OK);
    let (status, stderr) = ended(child).await;
    assert_eq!(status.code(), Some(0), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn numbers_compare_by_value_and_a_value_already_reached_exits_at_once() {
    let app = spawn_app().await;
    let id = fresh_id("numbers");
    app.put_state(&id, &at(json!(9)))
        .await
        .expect(StatusCode::CREATED);

    let mut child = wait(&app, &["--stream=s", "--until=9.5", "--timeout=60s", &id]);
    tokio::time::sleep(SETTLE).await;
    waiting(&mut child, "9 is short of 9.5");
    app.put_state(&id, &at(json!(10)))
        .await
        .expect(StatusCode::OK);
    let (status, stderr) = ended(child).await;
    assert_eq!(status.code(), Some(0), "10 reaches 9.5: {stderr}");

    // Already reached, by value (10.0 is 10), in partial over completed: no
    // change is needed, so it does not wait for one.
    let mut doc = at(json!(1));
    doc["partial"] = at(json!(10.0))["completed"].clone();
    app.put_state(&id, &doc).await.expect(StatusCode::OK);
    // No long-poll of its own: nothing changes now, so one would last to
    // the 60 s timeout, past what `ended` waits.
    let (status, stderr) = ended(wait(
        &app,
        &["--stream=s", "--until=10", "--timeout=60s", &id],
    ))
    .await;
    assert_eq!(status.code(), Some(0), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn it_exits_124_when_the_timeout_ends_first() {
    let app = spawn_app().await;
    let id = fresh_id("timeout");
    // A bookmark written as a string is not a number: the guard does not
    // order "10" against 9, and neither does wait; it says so and waits.
    app.put_state(&id, &at(json!("10")))
        .await
        .expect(StatusCode::CREATED);
    let started = Instant::now();
    let (status, stderr) = ended(wait(
        &app,
        &["--stream=s", "--until=9", "--timeout", "2s", &id],
    ))
    .await;
    let took = started.elapsed();
    assert_eq!(status.code(), Some(124), "{stderr}");
    assert!(
        took >= Duration::from_secs(2),
        "not before the timeout: {took:?}"
    );
    assert!(stderr.contains("cannot be compared"), "{stderr}");
    assert!(stderr.contains("--timeout"), "{stderr}");

    // An absent state is waited for, to the timeout too.
    let (status, stderr) = ended(wait(
        &app,
        &["--changed", "--timeout=1s", &fresh_id("absent")],
    ))
    .await;
    assert_eq!(status.code(), Some(124), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn changed_exits_at_the_next_write_create_or_delete() {
    let app = spawn_app().await;
    let id = fresh_id("changed");
    app.put_state(&id, &at(json!(1)))
        .await
        .expect(StatusCode::CREATED);

    let mut child = wait(&app, &["--changed", &id]);
    tokio::time::sleep(SETTLE).await;
    waiting(&mut child, "nothing changed");
    app.put_state(&id, &at(json!(2)))
        .await
        .expect(StatusCode::OK);
    let (status, stderr) = ended(child).await;
    assert_eq!(status.code(), Some(0), "a write: {stderr}");

    let mut child = wait(&app, &["--changed", &id]);
    tokio::time::sleep(SETTLE).await;
    waiting(&mut child, "nothing changed");
    app.delete_state(&id).await.expect(StatusCode::NO_CONTENT);
    let (status, stderr) = ended(child).await;
    assert_eq!(status.code(), Some(0), "a delete: {stderr}");

    let mut child = wait(&app, &["--changed", &id]);
    tokio::time::sleep(SETTLE).await;
    waiting(&mut child, "still absent");
    app.put_state(&id, &at(json!(3)))
        .await
        .expect(StatusCode::CREATED);
    let (status, stderr) = ended(child).await;
    assert_eq!(status.code(), Some(0), "a create: {stderr}");
}

/// A gateway that is not up yet is asked again, after a backoff, until it
/// answers within the command's 20 s: the command outlives a gateway's
/// restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreachable_gateway_is_asked_again_until_it_answers() {
    let config = peer_config(&unique_schema());
    let base = format!("http://127.0.0.1:{}", config.listen.port());
    let id = fresh_id("unreachable");
    let mut child = wait_at(&base, &["--stream=s", "--until=5", "--timeout=60s", &id]);
    tokio::time::sleep(SETTLE).await;
    waiting(&mut child, "nothing listens yet");

    let app = spawn_configured(config).await;
    app.put_state(&id, &at(json!(5)))
        .await
        .expect(StatusCode::CREATED);
    let (status, stderr) = ended(child).await;
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("cannot reach the gateway"), "{stderr}");
    assert!(stderr.contains("asking again"), "{stderr}");
}

/// A gateway that never answers (a closed port: a typo in the URL) is a
/// failure naming it, not a "not yet": exit 1 after the bounded retry, and
/// at a --timeout that ends first too, never 124.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gateway_that_cannot_be_reached_exits_1_naming_it() {
    let closed = ClosedPort::bind();
    let base = closed.url();
    let (status, stderr) = ended_within(
        wait_at(&base, &["--changed", &fresh_id("closed")]),
        CLOSED_PORT,
    )
    .await;
    assert_eq!(status.code(), Some(1), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.contains(&format!("cannot reach the gateway at {base}")) && last.contains("gave up"),
        "{stderr}"
    );

    let (status, stderr) = ended(wait_at(
        &base,
        &[
            "--stream=s",
            "--until=5",
            "--timeout=1s",
            &fresh_id("closed"),
        ],
    ))
    .await;
    assert_eq!(status.code(), Some(1), "not 124: {stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.contains("--timeout") && last.contains(&base),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bad_command_line_or_a_refusal_exits_1_with_a_reason() {
    let app = spawn_app().await;
    for (args, says) in [
        (&["--stream=s", "--until=soon", "id"][..], "soon"),
        (&["--stream=s", "id"], "--until"),
        (&["--changed", "--stream=s", "--until=1", "id"], "--changed"),
        (&["--changed", "--timeout=later", "id"], "later"),
    ] {
        let (status, stderr) = ended(wait(&app, args)).await;
        assert_eq!(status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    // A state_id the gateway refuses (over 900 bytes) is not asked again.
    let long = "x".repeat(901);
    let (status, stderr) = ended(wait(&app, &["--changed", &long])).await;
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("400"), "{stderr}");
}
