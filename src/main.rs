use std::process::ExitCode;

use clap::Parser;
use statehouse::config::{Cli, Command, Config};
use statehouse::{
    App, healthcheck, restorer, run_lease, runs_cli, shutdown_signal, telemetry, traces, waiter,
};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help and --version go to stdout and exit 0.
        Err(err) if !err.use_stderr() => err.exit(),
        // A bad command line exits 1, like any setting that is wrong.
        Err(err) => {
            let _ = err.print();
            return ExitCode::FAILURE;
        }
    };
    let args = match cli.command {
        Command::Serve(args) => args,
        Command::Lock(args) => return run_lease::run(*args),
        Command::LockWatchdog(args) => return run_lease::run_watchdog(&args),
        Command::Wait(args) => return waiter::run(*args),
        Command::Restore(args) => return restorer::run(*args),
        Command::Runs(args) => return runs_cli::run(*args),
        Command::Healthcheck(args) => {
            return match healthcheck::probe(&args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(why) => fail(&why),
            };
        }
    };
    let config = match Config::try_from(*args) {
        Ok(config) => config,
        Err(err) => return fail_with(&err, err.exit_status()),
    };
    let traces = match traces::start() {
        Ok(traces) => traces,
        Err(err) => return fail(&err),
    };
    telemetry::init(config.log_format, traces);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(err) => return fail(&err),
    };
    runtime.block_on(async {
        let app = match App::build(&config).await {
            Ok(app) => app,
            Err(err) => return fail(&err),
        };
        tracing::info!(
            listen = %app.local_addr(),
            scheme = app.scheme(),
            clickhouse = %config.clickhouse.endpoint(),
            schema = config.schema.as_str(),
            table = config.table.as_str(),
            "statehouse ready"
        );
        match app.serve(shutdown_signal()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => fail(&err),
        }
    })
}

fn fail(err: &dyn std::fmt::Display) -> ExitCode {
    fail_with(err, 1)
}

fn fail_with(err: &dyn std::fmt::Display, status: u8) -> ExitCode {
    eprintln!("statehouse: error: {err}");
    ExitCode::from(status)
}
