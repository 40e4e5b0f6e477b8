//! The long-poll loops of the README and `docs/` (docs/api.md's and
//! docs/watching.md's), run as written in bash with curl and jq against a
//! gateway, through a delete and a creation of their state (issue 53: a loop
//! that kept a deleted state's ETag was answered 404 at once, 35 times in
//! 3 s). Only the gateway's address is changed. A `curl` ahead of the real
//! one on PATH counts the requests.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::spawn_app;
use crate::run_lease::Scratch;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// The state every documented loop follows.
const ID: &str = "dev:tap-github-to-target-jsonl";
/// The address the documented loops are written for.
const DOC_ADDRESS: &str = "localhost:8080";
/// How long each loop is watched while its state is absent: long enough
/// for a loop that spins to make dozens of requests, far shorter than the
/// loops' 60 s wait.
const WATCHED: Duration = Duration::from_secs(3);
/// A bound that only a hang reaches: a loop hears of a creation through
/// its own gateway at once.
const HANG: Duration = Duration::from_secs(20);

/// The ```sh blocks of `text` that loop on a state's long-poll.
fn long_poll_loops(text: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut open: Option<String> = None;
    for line in text.lines() {
        match open.take() {
            None if line.trim() == "```sh" => open = Some(String::new()),
            None => {}
            Some(block) if line.trim_start().starts_with("```") => blocks.push(block),
            Some(mut code) => {
                code.push_str(line);
                code.push('\n');
                open = Some(code);
            }
        }
    }
    blocks
        .into_iter()
        .filter(|code| {
            code.contains("while ") && code.contains("wait=") && code.contains("If-None-Match")
        })
        .collect()
}

/// Every documented long-poll loop, named by its page.
fn documented_loops() -> Vec<(String, String)> {
    let mut pages = vec![Path::new(ROOT).join("README.md")];
    for entry in std::fs::read_dir(Path::new(ROOT).join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|ext| ext == "md") {
            pages.push(path);
        }
    }
    pages.sort();
    let mut loops = Vec::new();
    for page in pages {
        let text = std::fs::read_to_string(&page).unwrap();
        let name = page.strip_prefix(ROOT).unwrap().display().to_string();
        for code in long_poll_loops(&text) {
            loops.push((name.clone(), code));
        }
    }
    loops
}

/// The first `name` on PATH.
fn on_path(name: &str) -> PathBuf {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
        .unwrap_or_else(|| panic!("{name} is on PATH"))
}

/// A loop running in bash, in its own process group, in `scratch`.
struct Running {
    child: Child,
    scratch: Scratch,
}

impl Running {
    fn start(code: &str, scratch: Scratch) -> Self {
        let counting = scratch.path("bin");
        std::fs::create_dir_all(&counting).unwrap();
        let curl = counting.join("curl");
        std::fs::write(
            &curl,
            format!(
                "#!/bin/sh\necho request >> '{}'\nexec '{}' \"$@\"\n",
                scratch.path("requests").display(),
                on_path("curl").display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&curl, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let path = std::env::join_paths(std::iter::once(counting).chain(std::env::split_paths(
            &std::env::var_os("PATH").unwrap_or_default(),
        )))
        .unwrap();
        let child = Command::new("bash")
            .args(["-c", code])
            .current_dir(&scratch.0)
            .env("PATH", path)
            .env_remove("STATEHOUSE_TOKEN")
            .stdin(Stdio::null())
            .stdout(File::create(scratch.path("stdout")).unwrap())
            .stderr(File::create(scratch.path("stderr")).unwrap())
            .process_group(0)
            .spawn()
            .expect("bash runs");
        Self { child, scratch }
    }

    fn requests(&self) -> usize {
        self.scratch
            .read("requests")
            .map_or(0, |log| log.lines().count())
    }

    fn printed(&self) -> String {
        self.scratch.read("stdout").unwrap_or_default()
    }

    /// Waits until the loop has printed `marker`.
    async fn prints(&self, marker: &str, name: &str) {
        let give_up = Instant::now() + HANG;
        while !self.printed().contains(marker) {
            assert!(
                Instant::now() < give_up,
                "{name} never printed {marker}: {}\nstderr: {}",
                self.printed(),
                self.scratch.read("stderr").unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // bash and the curl it waits on.
        let group = i32::try_from(self.child.id()).unwrap();
        unsafe { libc::killpg(group, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

/// A state whose issues bookmark is `since`, a mark the loops print.
fn state(since: &str) -> serde_json::Value {
    json!({"completed": {"singer_state": {"bookmarks": {"issues": {"since": since}}}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_documented_long_poll_loops_ask_once_per_wait_while_the_state_is_deleted() {
    let loops = documented_loops();
    assert!(
        loops.len() >= 2,
        "docs/api.md's and docs/watching.md's loops are found: {loops:?}"
    );
    for (name, code) in loops {
        let app = spawn_app().await;
        assert!(
            code.contains(DOC_ADDRESS),
            "{name}: the loop asks {DOC_ADDRESS}"
        );
        assert!(code.contains(ID), "{name}: the loop follows {ID}");
        let address = app.base.trim_start_matches("http://");
        let code = code.replace(DOC_ADDRESS, address);

        // A state deleted before the loop starts: it waits for its creation.
        app.put_state(ID, &state("2026-12-01T00:00:00Z"))
            .await
            .expect(StatusCode::CREATED);
        app.delete_state(ID).await.expect(StatusCode::NO_CONTENT);
        let running = Running::start(&code, Scratch::new());
        tokio::time::sleep(WATCHED).await;
        let asked = running.requests();
        assert!(
            asked <= 1,
            "{name}: {asked} requests in {WATCHED:?} on a deleted state"
        );

        // Its creation is heard, and printed.
        app.put_state(ID, &state("2026-12-02T00:00:00Z"))
            .await
            .expect(StatusCode::CREATED);
        running.prints("2026-12-02T00:00:00Z", &name).await;

        // Deleted while the loop holds its ETag: one request is answered 404
        // (at once, or at the delete), and the next waits for a creation.
        let before = running.requests();
        app.delete_state(ID).await.expect(StatusCode::NO_CONTENT);
        tokio::time::sleep(WATCHED).await;
        let asked = running.requests() - before;
        assert!(
            asked <= 2,
            "{name}: {asked} requests in {WATCHED:?} after the delete"
        );

        app.put_state(ID, &state("2026-12-03T00:00:00Z"))
            .await
            .expect(StatusCode::CREATED);
        running.prints("2026-12-03T00:00:00Z", &name).await;
    }
}

#[test]
fn loops_are_found_by_what_they_ask() {
    let text = "```sh\ncurl -s x\n```\n```sh\nwhile :; do\n  curl -H \"If-None-Match: $e\" 'x?wait=60s'\ndone\n```\n";
    assert_eq!(
        long_poll_loops(text),
        ["while :; do\n  curl -H \"If-None-Match: $e\" 'x?wait=60s'\ndone\n"]
    );
}
