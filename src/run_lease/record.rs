//! The run's record (design.md, "Runs (contract)"): started under the
//! state_id's lease after the grant and before the command starts, ended
//! with the command's exit code or signal before the lease goes. A gateway
//! that refuses either is reported and the pipeline goes on: the record
//! must never stop the run it records.

use super::args::LockArgs;
use super::client::Gateway;
use super::ending::Ending;
use super::info;
use super::say::say;

/// A run recorded, to be ended.
pub struct Recorded {
    run_id: String,
}

/// Records the run under the state_id's lease (none: `--no-run`, or a
/// runner holding only pools).
pub async fn start(
    gateway: &Gateway,
    args: &LockArgs,
    state: Option<(&str, &str)>,
) -> Option<Recorded> {
    let (state_id, lease_id) = state.filter(|_| !args.no_run)?;
    let info = info::lease_info(&args.command, &args.info);
    match gateway.start_run(state_id, lease_id, info).await {
        Ok(run_id) => Some(Recorded { run_id }),
        Err(err) => {
            say(format_args!(
                "the run is not recorded: {err}; the command runs all the same"
            ));
            None
        }
    }
}

/// Ends the run as the command ended. A run whose lease was lost is left
/// alone: it ended with its lease, as `lost`.
pub async fn end(gateway: &Gateway, recorded: Option<Recorded>, ending: Ending, lost: bool) {
    let Some(recorded) = recorded.filter(|_| !lost) else {
        return;
    };
    let body = match ending {
        Ending::Exited(code) => serde_json::json!({ "exit_code": code & 0xff }),
        Ending::Signalled(signal) => serde_json::json!({ "signal": signal }),
        _ => return,
    };
    if let Err(err) = gateway.end_run(&recorded.run_id, body).await {
        say(format_args!("the run's end is not recorded: {err}"));
    }
}
