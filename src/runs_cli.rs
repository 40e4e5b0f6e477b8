//! `statehouse runs [--pattern GLOB] [--status S] [--since DURATION]
//! [--limit N] [--json]`: the runs recorded under leases (`GET /v1/runs`),
//! newest first, as a table for people or JSON lines for machines; the same
//! URL, token and TLS settings as `statehouse lock`. Exits 0, or 1 when the
//! gateway cannot be reached or refuses.

use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::Args;
use serde_json::Value;

use crate::client::{Connection, ConnectionArgs, error_chain, read_body};

/// How long the gateway has to answer one page.
const TIMEOUT: Duration = Duration::from_secs(30);
/// The most the API answers in one page.
const PAGE: u32 = 1000;
/// Listings are larger than lease answers; more is not the gateway's.
const MAX_ANSWER_BYTES: usize = 64 << 20;

#[derive(Debug, Clone, Args)]
pub struct RunsArgs {
    /// Where the gateway is and how to reach it: the same flags and
    /// variables as `statehouse lock`.
    #[command(flatten)]
    pub connection: ConnectionArgs,

    /// Only the runs of the state_ids this glob matches.
    #[arg(long, value_name = "GLOB")]
    pub pattern: Option<String>,

    /// Only runs of these statuses, comma-separated: running, succeeded,
    /// failed, lost.
    #[arg(long, value_name = "S")]
    pub status: Option<String>,

    /// Only runs started within this long: 30m, 12h, 7d.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub since: Option<Duration>,

    /// At most this many runs, newest first.
    #[arg(long, value_name = "N", default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    pub limit: u32,

    /// One JSON object per line, each run as the API answers it.
    #[arg(long)]
    pub json: bool,
}

/// Runs `statehouse runs` and answers its exit status.
pub fn run(args: RunsArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => return fail(&format!("cannot start: {err}")),
    };
    let listed = args
        .connection
        .resolve()
        .and_then(|connection| runtime.block_on(fetch(&connection, &args)));
    let runs = match listed {
        Ok(runs) => runs,
        Err(err) => return fail(&err),
    };
    if args.json {
        for run in &runs {
            println!("{run}");
        }
    } else {
        print!("{}", table(&runs));
    }
    ExitCode::SUCCESS
}

fn fail(why: &str) -> ExitCode {
    eprintln!("statehouse runs: {why}");
    ExitCode::FAILURE
}

/// Up to `--limit` runs, page after page.
async fn fetch(connection: &Connection, args: &RunsArgs) -> Result<Vec<Value>, String> {
    let client = crate::client::builder(&connection.tls)?
        .timeout(TIMEOUT)
        .user_agent(concat!("statehouse-runs/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| format!("cannot set up the HTTP client: {}", error_chain(&e)))?;
    let url = format!("{}/v1/runs", connection.base.as_str());
    let mut query: Vec<(&str, String)> = Vec::new();
    if let Some(pattern) = &args.pattern {
        query.push(("pattern", pattern.clone()));
    }
    if let Some(status) = &args.status {
        query.push(("status", status.clone()));
    }
    if let Some(since) = args.since {
        let from = SystemTime::now().checked_sub(since).ok_or_else(|| {
            format!(
                "--since {} reaches before 1970",
                humantime::format_duration(since)
            )
        })?;
        query.push(("since", humantime::format_rfc3339_millis(from).to_string()));
    }
    let mut runs: Vec<Value> = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let left = args.limit - runs.len() as u32;
        let mut request = client
            .get(&url)
            .query(&query)
            .query(&[("limit", left.min(PAGE))]);
        if let Some(cursor) = &cursor {
            request = request.query(&[("cursor", cursor)]);
        }
        request = connection.token.authorize(request);
        let response = request
            .send()
            .await
            .map_err(|e| format!("cannot reach the gateway at {url}: {}", error_chain(&e)))?;
        let status = response.status();
        let body = read_body(response, MAX_ANSWER_BYTES).await?;
        let page: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if !status.is_success() {
            let detail = page["detail"].as_str().unwrap_or("no detail").to_owned();
            return Err(format!(
                "the gateway answered GET /v1/runs with {status}: {detail}"
            ));
        }
        let listed = page["runs"]
            .as_array()
            .ok_or_else(|| "the gateway's answer has no runs".to_owned())?;
        runs.extend(listed.iter().cloned());
        cursor = page["next_cursor"].as_str().map(str::to_owned);
        if cursor.is_none() || runs.len() >= args.limit as usize {
            runs.truncate(args.limit as usize);
            return Ok(runs);
        }
    }
}

const HEADINGS: [&str; 6] = [
    "STATE_ID", "STATUS", "STARTED", "DURATION", "EXIT", "ADVANCED",
];

/// The runs as columns, newest first; a failed or lost run's status in capitals.
fn table(runs: &[Value]) -> String {
    let rows: Vec<[String; 6]> = runs.iter().map(row).collect();
    let mut widths = HEADINGS.map(str::len);
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let headings = HEADINGS.map(str::to_owned);
    for cells in std::iter::once(&headings).chain(&rows) {
        let line: Vec<String> = cells
            .iter()
            .zip(widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

fn row(run: &Value) -> [String; 6] {
    let text = |key: &str| run[key].as_str().unwrap_or("-").to_owned();
    let status = text("status");
    let status = match status.as_str() {
        "failed" | "lost" => status.to_uppercase(),
        _ => status,
    };
    let duration = run["duration_seconds"].as_f64().map_or_else(
        || "-".to_owned(),
        |s| humantime::format_duration(Duration::from_secs(s.round() as u64)).to_string(),
    );
    let exit = match (run["exit_code"].as_i64(), run["signal"].as_i64()) {
        (Some(code), _) => code.to_string(),
        (None, Some(signal)) => format!("SIG{signal}"),
        (None, None) => "-".to_owned(),
    };
    let advanced: Vec<&str> = run["advanced"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|moved| moved["stream"].as_str())
        .collect();
    [
        text("state_id"),
        status,
        text("started_at"),
        duration,
        exit,
        if advanced.is_empty() {
            "-".to_owned()
        } else {
            advanced.join(",")
        },
    ]
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn the_table_lines_up_and_marks_failed_and_lost_runs() {
        let runs = [
            json!({"state_id": "dev:tap-a-to-target", "status": "failed", "started_at": "2026-01-05T01:00:00.000Z",
                   "duration_seconds": 75.2, "exit_code": 3, "signal": null,
                   "advanced": [{"stream": "orders", "from": "a", "to": "b"}]}),
            json!({"state_id": "b", "status": "running", "started_at": "2026-01-05T02:00:00.000Z",
                   "duration_seconds": null, "exit_code": null, "signal": null, "advanced": []}),
            json!({"state_id": "c", "status": "failed", "started_at": "2026-01-05T03:00:00.000Z",
                   "duration_seconds": 1.0, "exit_code": null, "signal": 15, "advanced": []}),
        ];
        let printed = table(&runs);
        let lines: Vec<&str> = printed.lines().collect();
        assert_eq!(
            lines[0],
            "STATE_ID             STATUS   STARTED                   DURATION  EXIT   ADVANCED"
        );
        assert_eq!(
            lines[1],
            "dev:tap-a-to-target  FAILED   2026-01-05T01:00:00.000Z  1m 15s    3      orders"
        );
        assert_eq!(
            lines[2],
            "b                    running  2026-01-05T02:00:00.000Z  -         -      -"
        );
        assert!(lines[3].contains("SIG15"), "{}", lines[3]);
    }
}
