//! `statehouse lock STATE_ID -- COMMAND [ARGS...]`: runs a command while
//! holding a lease on a state_id, so that no two runs of one pipeline
//! overlap, whatever starts them.
//!
//! One process: it takes the lease (waiting up to `--wait` for it), runs the
//! command with the lease in its environment, renews the lease every third of
//! its TTL, passes SIGINT, SIGTERM and SIGHUP on to the command, and releases
//! the lease when the command ends. When the lease is lost (a renewal answers
//! 409, or the gateway stays unreachable until the lease would have expired)
//! the command gets SIGTERM, and SIGKILL after `--grace`. The command never
//! outlives the runner: it runs in a process group of its own, which is
//! killed when the runner is done with it, and on Linux the kernel kills the
//! command if the runner dies (`kill -9`).
//!
//! The pure parts (exit codes, the renewal schedule, argument checks) are
//! here; the gateway client is in `client`, the command in `child`.

mod child;
mod client;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use tokio::sync::oneshot;
use tokio::time::Instant;

pub use self::child::SpawnError;
use self::child::{Child, Signals};
use crate::client::TlsFiles;

use self::client::{Acquired, Gateway, GatewayUrl, Holder, Lease, Verdict};

/// The lock stayed held by another past `--wait`; nothing was run (EX_TEMPFAIL).
pub const EXIT_BUSY: u8 = 75;
/// The lease was lost while the command ran; the command was stopped.
pub const EXIT_LOST: u8 = 76;
/// A bad command line, or a gateway that could not be used before the command started.
pub const EXIT_UNUSABLE: u8 = 1;
/// The command exists but could not be run (as a shell answers).
pub const EXIT_CANNOT_EXECUTE: u8 = 126;
/// The command was not found (as a shell answers).
pub const EXIT_NOT_FOUND: u8 = 127;

/// Longest the gateway waits in one acquire (its `wait_seconds` limit); a
/// longer `--wait` asks again.
const MAX_WAIT_PER_ACQUIRE: Duration = Duration::from_secs(300);
/// Longest one renewal or release may take, within the lease's life.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Args)]
pub struct LockArgs {
    /// The gateway's base URL, http:// or https://.
    #[arg(long, env = "STATEHOUSE_URL", default_value = "http://127.0.0.1:8080", value_parser = GatewayUrl::parse)]
    pub url: GatewayUrl,

    /// Bearer token for the gateway (a write token, when it has tokens).
    #[arg(long, env = "STATEHOUSE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,

    /// A file holding the bearer token, which then stays out of `ps` and the
    /// environment (surrounding whitespace is ignored).
    #[arg(long, env = "STATEHOUSE_TOKEN_FILE", conflicts_with = "token")]
    pub token_file: Option<PathBuf>,

    /// Over https://, trust this PEM CA file for the gateway's certificate
    /// instead of the system's CAs.
    #[arg(long, env = "STATEHOUSE_CA_FILE")]
    pub ca_file: Option<PathBuf>,

    /// Over https://, present this PEM client certificate (mTLS), with --client-key-file.
    #[arg(
        long,
        env = "STATEHOUSE_CLIENT_CERT_FILE",
        requires = "client_key_file"
    )]
    pub client_cert_file: Option<PathBuf>,

    /// The key of --client-cert-file, in PEM.
    #[arg(
        long,
        env = "STATEHOUSE_CLIENT_KEY_FILE",
        requires = "client_cert_file"
    )]
    pub client_key_file: Option<PathBuf>,

    /// Who holds the lease, as lock listings show it (default: <hostname>:<pid>).
    #[arg(long, env = "STATEHOUSE_LOCK_OWNER")]
    pub owner: Option<String>,

    /// How long the lease lives without renewal, in whole seconds from 1s to
    /// 1h; it is renewed every third of it.
    #[arg(long, env = "STATEHOUSE_LOCK_TTL", default_value = "30s", value_parser = parse_ttl)]
    pub ttl: Duration,

    /// How long to wait while another holds the lock; 0s tries once. Past it
    /// the runner exits 75 without running the command.
    #[arg(long, env = "STATEHOUSE_LOCK_WAIT", default_value = "0s", value_parser = humantime::parse_duration)]
    pub wait: Duration,

    /// After the lease is lost, how long the command has between SIGTERM and SIGKILL.
    #[arg(long, env = "STATEHOUSE_LOCK_GRACE", default_value = "10s", value_parser = humantime::parse_duration)]
    pub grace: Duration,

    /// The state_id to hold; for `meltano run` it is <environment>:<tap>-to-<target>.
    pub state_id: String,

    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND", value_parser = clap::value_parser!(OsString))]
    pub command: Vec<OsString>,
}

/// A lease's TTL as the gateway takes it: whole seconds, 1 to 3600.
fn parse_ttl(raw: &str) -> Result<Duration, String> {
    let ttl = humantime::parse_duration(raw).map_err(|e| e.to_string())?;
    if ttl.subsec_nanos() != 0 || !(1..=3600).contains(&ttl.as_secs()) {
        return Err("the TTL must be a whole number of seconds from 1s to 1h".into());
    }
    Ok(ttl)
}

/// How a run ended, from which the exit status follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// The command exited with this code.
    Exited(i32),
    /// The command was killed by this signal.
    Signalled(i32),
    /// The runner got this signal before the command started; nothing ran.
    Interrupted(i32),
    /// Another kept the lock past `--wait`; nothing ran.
    Busy,
    /// The lease was lost while the command ran.
    Lost,
    /// The gateway could not be used before the command started; nothing ran.
    Unusable,
    /// The command could not be started.
    NotStarted(SpawnError),
}

/// The runner's exit status for an ending.
pub fn exit_code(ending: Ending) -> u8 {
    match ending {
        // A wait status carries 8 bits of exit code.
        Ending::Exited(code) => (code & 0xff) as u8,
        Ending::Signalled(signal) | Ending::Interrupted(signal) => {
            128u8.saturating_add(u8::try_from(signal).unwrap_or(u8::MAX))
        }
        Ending::Busy => EXIT_BUSY,
        Ending::Lost => EXIT_LOST,
        Ending::Unusable => EXIT_UNUSABLE,
        Ending::NotStarted(SpawnError::NotFound) => EXIT_NOT_FOUND,
        Ending::NotStarted(SpawnError::CannotExecute) => EXIT_CANNOT_EXECUTE,
    }
}

/// When to renew a lease and when it ends, seen from this side: a renewal
/// counts from the moment it was sent, before the gateway stamped it, so
/// the lease here never outlives the lease there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseClock {
    ttl: Duration,
    expires: Instant,
    next: Instant,
}

impl LeaseClock {
    /// A lease granted (or renewed) at `at`.
    pub fn new(ttl: Duration, at: Instant) -> Self {
        Self {
            ttl,
            expires: at + ttl,
            next: at + ttl / 3,
        }
    }

    /// A renewal sent at `sent` succeeded.
    pub fn renewed(&mut self, sent: Instant) {
        *self = Self::new(self.ttl, sent);
    }

    /// A renewal failed at `now` without a verdict (no answer, or not one
    /// about the lease): try again soon, until the lease would have expired.
    /// False when it has.
    pub fn failed(&mut self, now: Instant) -> bool {
        if now >= self.expires {
            return false;
        }
        self.next = (now + self.retry_delay()).min(self.expires);
        true
    }

    /// Between failed renewals: a tenth of the TTL, from 100 ms to 1 s.
    fn retry_delay(&self) -> Duration {
        (self.ttl / 10).clamp(Duration::from_millis(100), Duration::from_secs(1))
    }

    pub fn next_attempt(&self) -> Instant {
        self.next
    }

    /// How long a renewal starting at `now` may take: until the lease would
    /// expire, at most `REQUEST_TIMEOUT`; None when it has expired.
    pub fn time_left(&self, now: Instant) -> Option<Duration> {
        let left = self.expires.checked_duration_since(now)?;
        (!left.is_zero()).then(|| left.min(REQUEST_TIMEOUT))
    }
}

/// Why the lease was lost.
#[derive(Debug)]
enum Lost {
    /// The gateway said it is not the current lease (force-unlocked, or expired).
    Refused(String),
    /// No renewal got through before the lease would have expired.
    Unreachable(String),
}

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused(why) => write!(f, "the gateway refused its renewal: {why}"),
            Self::Unreachable(why) => write!(
                f,
                "no renewal got through before it would have expired: {why}"
            ),
        }
    }
}

fn say(line: std::fmt::Arguments<'_>) {
    eprintln!("statehouse lock: {line}");
}

/// Runs `statehouse lock` and answers its exit status.
pub fn run(args: LockArgs) -> ExitCode {
    // One thread: the command is started from the thread that lives as long
    // as the process, since Linux's parent-death signal follows the thread
    // that forked it (see `child`).
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            say(format_args!("cannot start: {err}"));
            return ExitCode::from(EXIT_UNUSABLE);
        }
    };
    ExitCode::from(exit_code(runtime.block_on(supervise(args))))
}

async fn supervise(args: LockArgs) -> Ending {
    let id = args.state_id.as_str();
    let owner = args.owner.clone().unwrap_or_else(child::default_owner);
    let gateway = match gateway(&args) {
        Ok(gateway) => gateway,
        Err(err) => {
            say(format_args!("{err}; nothing was run"));
            return Ending::Unusable;
        }
    };
    let mut signals = match Signals::install() {
        Ok(signals) => signals,
        Err(err) => {
            say(format_args!("cannot handle signals: {err}"));
            return Ending::Unusable;
        }
    };
    let acquired = tokio::select! {
        acquired = acquire(&gateway, id, &owner, args.ttl, args.wait) => acquired,
        signal = signals.recv() => return Ending::Interrupted(signal),
    };
    let lease = match acquired {
        Ok(Acquired::Granted(lease)) => lease,
        Ok(Acquired::Held(holder)) => {
            say(format_args!(
                "{id} is locked by {}; nothing was run",
                describe(holder.as_ref())
            ));
            return Ending::Busy;
        }
        Err(err) => {
            say(format_args!("{err}; nothing was run"));
            return Ending::Unusable;
        }
    };
    let child = match Child::spawn(&args.command, id, &lease) {
        Ok(child) => child,
        Err(err) => {
            say(format_args!(
                "cannot run {}: {err}",
                args.command[0].to_string_lossy()
            ));
            release(&gateway, id, &lease).await;
            return Ending::NotStarted(err.kind);
        }
    };
    let (lost_tx, lost_rx) = oneshot::channel();
    let keeper = tokio::spawn(keep(
        gateway.clone(),
        id.to_owned(),
        lease.lease_id.clone(),
        LeaseClock::new(args.ttl, lease.granted),
        lost_tx,
    ));
    let (status, lost) = watch(child, &mut signals, lost_rx, id, args.grace).await;
    keeper.abort();
    match lost {
        Some(Lost::Refused(_)) => Ending::Lost,
        Some(Lost::Unreachable(_)) => {
            // Best effort: the gateway may be back.
            release(&gateway, id, &lease).await;
            Ending::Lost
        }
        None if !release(&gateway, id, &lease).await => {
            say(format_args!(
                "lost the lease on {id}: it was no longer current when the command ended"
            ));
            Ending::Lost
        }
        None => status,
    }
}

/// The gateway client the flags describe: its token (given, or read from
/// --token-file) and its TLS files.
fn gateway(args: &LockArgs) -> Result<Gateway, String> {
    let token = match &args.token_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read the token file {}: {e}", path.display()))?
                .trim()
                .to_owned(),
        ),
        None => args.token.clone(),
    };
    let tls = TlsFiles {
        ca_file: args.ca_file.clone(),
        client_cert_file: args.client_cert_file.clone(),
        client_key_file: args.client_key_file.clone(),
    };
    Gateway::new(args.url.clone(), token, &tls)
}

/// Takes the lease, asking again while `wait` lasts (one acquire waits at
/// most the gateway's limit). A 503 that says when to come back
/// (`overloaded`, `authority-unreachable`) is retried then, within the wait
/// or 30 s, whichever is longer.
async fn acquire(
    gateway: &Gateway,
    id: &str,
    owner: &str,
    ttl: Duration,
    wait: Duration,
) -> Result<Acquired, client::GatewayError> {
    let started = Instant::now();
    let give_up = started + wait;
    let retry_until = give_up.max(started + Duration::from_secs(30));
    loop {
        let now = Instant::now();
        let this_wait = give_up
            .saturating_duration_since(now)
            .min(MAX_WAIT_PER_ACQUIRE);
        match gateway.acquire(id, owner, ttl, this_wait).await {
            Ok(Acquired::Held(_)) if Instant::now() < give_up => continue,
            Err(client::GatewayError::Busy { retry_after, .. })
                if Instant::now() + retry_after < retry_until =>
            {
                tokio::time::sleep(retry_after).await;
            }
            other => return other,
        }
    }
}

/// Renews the lease on schedule until it is lost; then says why on `lost`.
async fn keep(
    gateway: Gateway,
    id: String,
    lease_id: String,
    mut clock: LeaseClock,
    lost: oneshot::Sender<Lost>,
) {
    let ttl = clock.ttl;
    let mut failing: Option<String> = None;
    let why = loop {
        tokio::time::sleep_until(clock.next_attempt()).await;
        let sent = Instant::now();
        let Some(time_left) = clock.time_left(sent) else {
            break Lost::Unreachable(failing.unwrap_or_else(|| "no answer".into()));
        };
        let error = match tokio::time::timeout(time_left, gateway.renew(&id, &lease_id, ttl)).await
        {
            Ok(Ok(Verdict::Done)) => {
                if failing.take().is_some() {
                    say(format_args!("renewed the lease on {id} again"));
                }
                clock.renewed(sent);
                continue;
            }
            Ok(Ok(Verdict::NotCurrent(why))) => break Lost::Refused(why),
            Ok(Err(err)) => err.to_string(),
            Err(_) => format!("no answer within {time_left:?}"),
        };
        if failing.is_none() {
            say(format_args!(
                "could not renew the lease on {id} ({error}); retrying until it would expire"
            ));
        }
        failing = Some(error);
        if !clock.failed(Instant::now()) {
            break Lost::Unreachable(failing.unwrap_or_default());
        }
    };
    let _ = lost.send(why);
}

/// Waits for the command, passing signals on; when the lease is lost, stops
/// it (SIGTERM, then SIGKILL to its process group after `grace`). Answers
/// how it ended and whether the lease was lost.
async fn watch(
    mut child: Child,
    signals: &mut Signals,
    mut lost_rx: oneshot::Receiver<Lost>,
    id: &str,
    grace: Duration,
) -> (Ending, Option<Lost>) {
    let mut lost: Option<Lost> = None;
    let mut keeper_gone = false;
    let mut kill_at: Option<Instant> = None;
    let mut killed = false;
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            signal = signals.recv() => child.signal(signal),
            why = &mut lost_rx, if !keeper_gone => {
                keeper_gone = true;
                // A keeper that ended without a word was aborted: not a loss.
                let Ok(why) = why else { continue };
                say(format_args!(
                    "lost the lease on {id}: {why}; sending SIGTERM to the command, SIGKILL after {}",
                    humantime::format_duration(grace)
                ));
                child.signal(libc::SIGTERM);
                kill_at = Some(Instant::now() + grace);
                lost = Some(why);
            }
            () = sleep_until_some(kill_at) => {
                kill_at = None;
                killed = child.kill_group();
            }
        }
    };
    // Whatever the command left running in its group would outlive the lease.
    if child.kill_group() && !killed {
        say(format_args!(
            "killed what the command left running in its process group"
        ));
    }
    let ending = match status {
        Ok(status) => child::ending(status),
        Err(err) => {
            say(format_args!("lost track of the command: {err}"));
            Ending::Exited(i32::from(EXIT_UNUSABLE))
        }
    };
    (ending, lost)
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Releases the lease; false when the gateway said it was no longer current.
/// One that cannot be released now ends at its TTL, which is said.
async fn release(gateway: &Gateway, id: &str, lease: &Lease) -> bool {
    match tokio::time::timeout(REQUEST_TIMEOUT, gateway.release(id, &lease.lease_id)).await {
        Ok(Ok(Verdict::Done)) => true,
        Ok(Ok(Verdict::NotCurrent(_))) => false,
        Ok(Err(err)) => {
            say(format_args!(
                "could not release the lease on {id} ({err}); it ends at its TTL"
            ));
            true
        }
        Err(_) => {
            say(format_args!(
                "could not release the lease on {id} (no answer within {REQUEST_TIMEOUT:?}); it ends at its TTL"
            ));
            true
        }
    }
}

fn describe(holder: Option<&Holder>) -> String {
    match holder {
        Some(h) => format!("{} since {} until {}", h.owner, h.acquired_at, h.expires_at),
        None => "another holder (the gateway did not name it)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Only {
        #[command(flatten)]
        args: LockArgs,
    }

    fn parse(argv: &[&str]) -> Result<LockArgs, clap::Error> {
        Only::try_parse_from(["statehouse lock"].iter().chain(argv)).map(|only| only.args)
    }

    #[test]
    fn exit_codes_follow_the_contract() {
        assert_eq!(exit_code(Ending::Exited(0)), 0);
        assert_eq!(exit_code(Ending::Exited(3)), 3);
        assert_eq!(exit_code(Ending::Exited(255)), 255);
        assert_eq!(exit_code(Ending::Signalled(libc::SIGKILL)), 137);
        assert_eq!(exit_code(Ending::Signalled(libc::SIGTERM)), 143);
        assert_eq!(exit_code(Ending::Interrupted(libc::SIGINT)), 130);
        assert_eq!(exit_code(Ending::Busy), 75);
        assert_eq!(exit_code(Ending::Lost), 76);
        assert_eq!(exit_code(Ending::Unusable), 1);
        assert_eq!(exit_code(Ending::NotStarted(SpawnError::NotFound)), 127);
        assert_eq!(
            exit_code(Ending::NotStarted(SpawnError::CannotExecute)),
            126
        );
    }

    #[test]
    fn renews_every_third_of_the_ttl_counted_from_each_send() {
        let start = Instant::now();
        let ttl = Duration::from_secs(30);
        let mut clock = LeaseClock::new(ttl, start);
        assert_eq!(clock.next_attempt(), start + Duration::from_secs(10));
        let sent = start + Duration::from_secs(10);
        clock.renewed(sent);
        assert_eq!(clock.next_attempt(), sent + Duration::from_secs(10));
        assert_eq!(
            clock.time_left(sent + Duration::from_secs(29)),
            Some(Duration::from_secs(1))
        );
        assert_eq!(
            clock.time_left(sent),
            Some(REQUEST_TIMEOUT),
            "one request never takes longer than REQUEST_TIMEOUT"
        );
    }

    #[test]
    fn failed_renewals_retry_soon_until_the_lease_would_expire() {
        let start = Instant::now();
        let mut clock = LeaseClock::new(Duration::from_secs(3), start);
        let now = start + Duration::from_secs(1);
        assert!(clock.failed(now));
        assert_eq!(clock.next_attempt(), now + Duration::from_millis(300));
        // Never scheduled past the expiry, and lost once it is reached.
        let late = start + Duration::from_millis(2900);
        assert!(clock.failed(late));
        assert_eq!(clock.next_attempt(), start + Duration::from_secs(3));
        assert_eq!(clock.time_left(start + Duration::from_secs(3)), None);
        assert!(!clock.failed(start + Duration::from_secs(3)));
        // The delay between retries stays within 100 ms and 1 s.
        let mut long = LeaseClock::new(Duration::from_secs(3600), start);
        assert!(long.failed(start));
        assert_eq!(long.next_attempt(), start + Duration::from_secs(1));
        let mut short = LeaseClock::new(Duration::from_secs(1), start);
        assert!(short.failed(start));
        assert_eq!(short.next_attempt(), start + Duration::from_millis(100));
    }

    #[test]
    fn defaults_and_flags() {
        let args = parse(&["dev:tap-to-target", "--", "meltano", "run", "--force"]).unwrap();
        assert_eq!(args.state_id, "dev:tap-to-target");
        assert_eq!(args.command, ["meltano", "run", "--force"]);
        assert_eq!(args.ttl, Duration::from_secs(30));
        assert_eq!(args.wait, Duration::ZERO);
        assert_eq!(args.grace, Duration::from_secs(10));
        assert_eq!(args.url.as_str(), "http://127.0.0.1:8080");
        let args = parse(&[
            "--url=http://gw:9000/base/",
            "--ttl=1m",
            "--wait=90s",
            "--owner=cron",
            "id",
            "--",
            "true",
        ])
        .unwrap();
        assert_eq!(args.url.as_str(), "http://gw:9000/base");
        assert_eq!(args.ttl, Duration::from_secs(60));
        assert_eq!(args.wait, Duration::from_secs(90));
        assert_eq!(args.owner.as_deref(), Some("cron"));
    }

    #[test]
    fn bad_command_lines_are_refused() {
        for argv in [
            &["id"][..],
            &["id", "--"],
            &["id", "true"],
            &["--", "true"],
            &["--ttl=0s", "id", "--", "true"],
            &["--ttl=1500ms", "id", "--", "true"],
            &["--ttl=2h", "id", "--", "true"],
            &["--wait=soon", "id", "--", "true"],
            &["--url=ftp://gw", "id", "--", "true"],
            &["--token=t", "--token-file=f", "id", "--", "true"],
            &["--client-cert-file=c.pem", "id", "--", "true"],
            &["--url=gw:8080", "id", "--", "true"],
            &["--url=http://u:p@gw", "id", "--", "true"],
            &["--url=http://gw/?a=b", "id", "--", "true"],
        ] {
            assert!(parse(argv).is_err(), "{argv:?}");
        }
    }

    #[test]
    fn the_command_keeps_its_own_flags() {
        let args = parse(&["id", "--", "sh", "-c", "exit 3", "--ttl=5s"]).unwrap();
        assert_eq!(args.command, ["sh", "-c", "exit 3", "--ttl=5s"]);
        assert_eq!(args.ttl, Duration::from_secs(30));
    }
}
