//! `statehouse restore --pattern GLOB --at T [--dry-run] [--reason TEXT]
//! [--json]`: the runbook's one line for "a bad release moved many
//! bookmarks". It sends one `POST /v1/restore` and prints one line per
//! change and a summary (or the answer as JSON); exit 0, or 1 on any error
//! (a bad `--at`, a gateway that refuses or cannot be reached). The command
//! line is in `args`, the lines in `report`.

mod args;
mod report;

use std::process::ExitCode;
use std::time::{Duration, SystemTime};

pub use self::args::RestoreArgs;
use crate::client::{error_chain, read_body, retry_after};
use crate::run_lease::problem::Answer;

/// A restore of 10,000 ids is a few batches; this bounds a gateway that
/// never answers.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(300);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest answer: 1,000 listed changes with their streams.
const MAX_ANSWER_BYTES: usize = 64 << 20;

/// Runs `statehouse restore` and answers its exit status.
pub fn run(args: RestoreArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => return failed(&format!("cannot start: {err}")),
    };
    match runtime.block_on(restore(&args)) {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(why) => failed(&why),
    }
}

fn failed(why: &str) -> ExitCode {
    eprintln!("statehouse restore: {why}");
    ExitCode::FAILURE
}

/// The restore asked, and what to print of its answer.
async fn restore(args: &RestoreArgs) -> Result<String, String> {
    let at = args.instant(SystemTime::now())?;
    let connection = args.connection.resolve()?;
    let client = crate::client::builder(&connection.tls)?
        .connect_timeout(CONNECT_TIMEOUT)
        .user_agent(concat!("statehouse-restore/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| format!("cannot set up the HTTP client: {}", error_chain(&e)))?;
    let body = serde_json::json!({
        "pattern": args.pattern,
        "at": at,
        "dry_run": args.dry_run,
        "reason": args.reason.clone().unwrap_or_default(),
    });
    let request = client
        .post(format!("{}/v1/restore", connection.base.as_str()))
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body.to_string())
        .timeout(ANSWER_TIMEOUT);
    let request = connection.token.authorize(request);
    let gateway = connection.base.as_str();
    let response = request
        .send()
        .await
        .map_err(|e| format!("cannot reach the gateway at {gateway}: {}", error_chain(&e)))?;
    let answer = Answer {
        status: response.status(),
        retry_after: retry_after(response.headers()),
        body: read_body(response, MAX_ANSWER_BYTES)
            .await
            .map_err(|why| format!("{why} (the gateway at {gateway})"))?,
    };
    if !answer.status.is_success() {
        return Err(format!(
            "the gateway answered {} ({})",
            answer.status,
            answer.problem().summary()
        ));
    }
    let answered: serde_json::Value = serde_json::from_slice(&answer.body)
        .map_err(|e| format!("the gateway's answer is not JSON: {e}"))?;
    if args.json {
        return Ok(format!("{answered}\n"));
    }
    Ok(report::lines(&answered))
}
