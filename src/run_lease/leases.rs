//! The leases of one run: the pools in name order, then the state_id's lock,
//! all taken within one `--wait`, each renewed from the moment it is granted
//! (a later one may be waited for longer than an earlier one's TTL), and all
//! released on every way out. The run itself is in `super`.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::args::LockArgs;
use super::client::{self, Acquired, Gateway, Lease, Verdict};
use super::clock::{LeaseClock, REQUEST_TIMEOUT};
use super::ending::Ending;
use super::info;
use super::problem::{Busy, Holder};
use super::say::say;
use super::target::Target;

/// Longest the gateway waits in one acquire (its `wait_seconds` limit); a
/// longer `--wait` asks again.
const MAX_WAIT_PER_ACQUIRE: Duration = Duration::from_secs(300);
/// However short `--wait` is, a 503 that says when to come back is retried
/// for this long.
const MIN_RETRY: Duration = Duration::from_secs(30);

/// Why a lease was lost.
#[derive(Debug)]
pub enum Lost {
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

/// A lease lost, as its keeper reports it.
#[derive(Debug)]
pub struct LostLease {
    /// Which of the run's leases.
    lease_id: String,
    /// What it was on, as messages name it.
    pub what: String,
    pub why: Lost,
}

struct Held {
    target: Target,
    lease: Lease,
    /// Renews it; none until its clock is confirmed.
    keeper: Option<JoinHandle<()>>,
}

pub struct Leases {
    gateway: Gateway,
    held: Vec<Held>,
    /// Every keeper reports a loss here; the run watches the other end. The
    /// sender is kept, so the channel never closes while leases are held.
    lost_tx: mpsc::UnboundedSender<LostLease>,
    lost_rx: mpsc::UnboundedReceiver<LostLease>,
}

impl Leases {
    pub fn new(gateway: Gateway) -> Self {
        let (lost_tx, lost_rx) = mpsc::unbounded_channel();
        Self {
            gateway,
            held: Vec::new(),
            lost_tx,
            lost_rx,
        }
    }

    /// Takes every target in order, asking again while `--wait` lasts, and
    /// renews each from its grant. A busy target (or an error, or a lease
    /// lost meanwhile) ends it with the ending to give, said on stderr;
    /// what it took is then still held, for [`Leases::release_all`].
    /// Cancel safe in that sense too: a grant is held as soon as it answers.
    pub async fn take(
        &mut self,
        targets: &[Target],
        owner: &str,
        args: &LockArgs,
    ) -> Result<(), Ending> {
        let info = info::lease_info(&args.command, &args.info);
        let started = Instant::now();
        let wait = Wait {
            give_up: started + args.wait,
            retry_until: (started + args.wait).max(started + MIN_RETRY),
        };
        for target in targets {
            let acquired = tokio::select! {
                acquired = acquire(&self.gateway, target, owner, args, &info, &wait) => acquired,
                Some(lost) = self.lost_rx.recv() => {
                    say(format_args!(
                        "lost the lease on {}: {}; nothing was run",
                        lost.what, lost.why
                    ));
                    self.forget(&lost);
                    return Err(Ending::Lost);
                }
            };
            let lease = match acquired {
                Ok(Acquired::Granted(lease)) => lease,
                Ok(Acquired::Busy(busy)) => {
                    say(format_args!("{}; nothing was run", busy_line(target, busy)));
                    return Err(Ending::Busy);
                }
                Err(err) => {
                    say(format_args!("{err}; nothing was run"));
                    return Err(Ending::Unusable);
                }
            };
            warn_if_cut(target, &lease, args.lock_delay());
            let index = self.held.len();
            self.held.push(Held {
                target: target.clone(),
                lease,
                keeper: None,
            });
            let held = &self.held[index];
            let clock = match start_clock(&self.gateway, target, &held.lease, args.ttl).await {
                Ok(clock) => clock,
                Err(why) => {
                    say(format_args!(
                        "the lease on {target} could not be confirmed ({why}); nothing was run"
                    ));
                    return Err(Ending::Unusable);
                }
            };
            let keeper = tokio::spawn(keep(
                self.gateway.clone(),
                target.clone(),
                held.lease.clone(),
                clock,
                self.lost_tx.clone(),
            ));
            self.held[index].keeper = Some(keeper);
        }
        Ok(())
    }

    /// The state_id's lease, for the command's environment, if one is held.
    pub fn state(&self) -> Option<(&str, &Lease)> {
        self.held.iter().find_map(|held| match &held.target {
            Target::State(id) => Some((id.as_str(), &held.lease)),
            Target::Pool { .. } => None,
        })
    }

    /// The next lease lost (cancel safe).
    pub async fn next_loss(&mut self) -> Option<LostLease> {
        self.lost_rx.recv().await
    }

    /// A lease the gateway refused is no longer ours to release.
    fn forget(&mut self, lost: &LostLease) {
        if !matches!(lost.why, Lost::Refused(_)) {
            return;
        }
        if let Some(at) = self
            .held
            .iter()
            .position(|held| held.lease.lease_id == lost.lease_id)
        {
            let held = self.held.remove(at);
            if let Some(keeper) = held.keeper {
                keeper.abort();
            }
        }
    }

    /// Stops renewing and releases every lease held, the last taken first.
    /// Answers those the gateway said were no longer current.
    pub async fn release_all(&mut self) -> Vec<Target> {
        let mut not_current = Vec::new();
        while let Some(held) = self.held.pop() {
            if let Some(keeper) = held.keeper {
                keeper.abort();
            }
            if !release(&self.gateway, &held.target, &held.lease).await {
                not_current.push(held.target);
            }
        }
        not_current
    }

    /// Once the command ended as `status`, with `lost` the first lease lost
    /// while it ran: releases the rest and answers how the run ended. A lease
    /// found no longer current at its release was lost too.
    pub async fn finish(mut self, status: Ending, lost: Option<LostLease>) -> Ending {
        if let Some(lost) = &lost {
            self.forget(lost);
        }
        let not_current = self.release_all().await;
        if let (None, Some(target)) = (&lost, not_current.first()) {
            say(format_args!(
                "lost the lease on {target}: it was no longer current when the command ended"
            ));
        }
        match (&lost, not_current.is_empty()) {
            (None, true) => status,
            _ => Ending::Lost,
        }
    }
}

/// Says so when the gateway granted less lock-delay than asked (it cuts
/// them to its `--max-lock-delay`): should the lease be lost, the next run
/// may then start before this one's command is gone.
fn warn_if_cut(target: &Target, lease: &Lease, asked: Duration) {
    let asked = client::whole_seconds(asked);
    if let Some(granted) = lease.lock_delay_seconds.filter(|&granted| granted < asked) {
        say(format_args!(
            "the gateway cut the lock-delay on {target} to {granted}s (its --max-lock-delay) from the {asked}s asked: should this lease be lost, the next run may start before this one's command is gone"
        ));
    }
}

/// When the run stops asking: `give_up` for a busy answer, `retry_until`
/// for a 503 that says when to come back.
struct Wait {
    give_up: Instant,
    retry_until: Instant,
}

/// Takes one lease, asking again while the wait lasts (one acquire waits at
/// most the gateway's limit). A 503 that says when to come back
/// (`overloaded`, `authority-unreachable`) is retried then, within the wait
/// or 30 s, whichever is longer.
async fn acquire(
    gateway: &Gateway,
    target: &Target,
    owner: &str,
    args: &LockArgs,
    info: &serde_json::Value,
    wait: &Wait,
) -> Result<Acquired, client::GatewayError> {
    loop {
        let this_wait = wait
            .give_up
            .saturating_duration_since(Instant::now())
            .min(MAX_WAIT_PER_ACQUIRE);
        match gateway
            .acquire(target, owner, args.ttl, this_wait, args.lock_delay(), info)
            .await
        {
            Ok(Acquired::Busy(Busy::Held(_) | Busy::Full { .. }))
                if Instant::now() < wait.give_up =>
            {
                continue;
            }
            Err(client::GatewayError::Busy { retry_after, .. })
                if Instant::now() + retry_after < wait.retry_until =>
            {
                tokio::time::sleep(retry_after).await;
            }
            other => return other,
        }
    }
}

/// The lease's clock, counted from when the acquire that got it was sent.
/// A grant at the end of a wait in line may date from any moment of the
/// wait, so one renewal at once tells from when it counts.
async fn start_clock(
    gateway: &Gateway,
    target: &Target,
    lease: &Lease,
    ttl: Duration,
) -> Result<LeaseClock, String> {
    let mut clock = LeaseClock::new(ttl, lease.sent);
    if !lease.waited {
        return Ok(clock);
    }
    let sent = Instant::now();
    match tokio::time::timeout(REQUEST_TIMEOUT, gateway.renew(target, &lease.lease_id, ttl)).await {
        Ok(Ok(Verdict::Done)) => {
            clock.renewed(sent);
            Ok(clock)
        }
        Ok(Ok(Verdict::NotCurrent(why))) => Err(why),
        Ok(Err(err)) => Err(err.to_string()),
        Err(_) => Err(format!("no answer within {REQUEST_TIMEOUT:?}")),
    }
}

/// Renews one lease on schedule until it is lost; then says why on `lost`.
/// Between renewals it looks every [`WATCH_EVERY`] whether the lease still
/// holds its target (see [`watching`]), and renews at once when it does not:
/// a 409 then is the loss, noticed within about a second of the lease's end
/// rather than at the next renewal (design.md, "Run leases (contract)").
async fn keep(
    gateway: Gateway,
    target: Target,
    lease: Lease,
    mut clock: LeaseClock,
    lost: mpsc::UnboundedSender<LostLease>,
) {
    let ttl = clock.ttl();
    let watch = watching(ttl);
    let mut failing: Option<String> = None;
    let mut look_at = Instant::now() + WATCH_EVERY;
    let mut refused_look = false;
    let why = loop {
        let renew_at = clock.next_attempt();
        if watch && look_at < renew_at {
            tokio::time::sleep_until(look_at).await;
            look_at = Instant::now() + WATCH_EVERY;
            // One look at a time, and never one that holds up the renewal
            // due next: a look stuck on a peer that does not answer gives
            // way to the next, which may be routed afresh.
            let within = renew_at
                .saturating_duration_since(Instant::now())
                .min(WATCH_EVERY);
            match gateway.holds(&target, lease.fencing_token, within).await {
                Ok(false) => {}
                // No word on the lease now: the next look, or the renewal.
                Ok(true)
                | Err(
                    client::GatewayError::Unreachable { .. } | client::GatewayError::Busy { .. },
                ) => continue,
                Err(err) => {
                    // Renewals still find the loss; only later.
                    if !std::mem::replace(&mut refused_look, true) {
                        say(format_args!(
                            "cannot look at the lease on {target} between renewals ({err}); its loss is found at the next renewal"
                        ));
                    }
                    continue;
                }
            }
        } else {
            tokio::time::sleep_until(renew_at).await;
        }
        let sent = Instant::now();
        let Some(time_left) = clock.time_left(sent) else {
            break Lost::Unreachable(failing.unwrap_or_else(|| "no answer".into()));
        };
        // On schedule, or early because the look found the lease gone: the
        // renewal's verdict is the one that counts (a look through a gateway
        // that has not yet heard of the grant may miss it), and a renewal
        // that lands is one like any other.
        let renewal = gateway.renew(&target, &lease.lease_id, ttl);
        let error = match tokio::time::timeout(time_left, renewal).await {
            Ok(Ok(Verdict::Done)) => {
                if failing.take().is_some() {
                    say(format_args!("renewed the lease on {target} again"));
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
                "could not renew the lease on {target} ({error}); retrying until it would expire"
            ));
        }
        failing = Some(error);
        if !clock.failed(Instant::now()) {
            break Lost::Unreachable(failing.unwrap_or_default());
        }
    };
    let _ = lost.send(LostLease {
        lease_id: lease.lease_id,
        what: target.to_string(),
        why,
    });
}

/// How often a lease is looked at between renewals. The contract gives the
/// runner [`super::args::NOTICED_WITHIN`] to notice its lease's end (a force-unlock, an expiry it did
/// not see coming, a claim lost); a look every second, answered by the
/// authority from memory, keeps within it with room for the look and the
/// renewal that confirms it. The locks API has no long-poll to wait on
/// instead, and one GET a second per run is cheaper than renewing (a
/// ClickHouse write) every second.
const WATCH_EVERY: Duration = Duration::from_secs(1);

/// Whether a lease with this TTL is looked at between renewals: not when
/// renewals (every third of the TTL) come as often as the looks would.
fn watching(ttl: Duration) -> bool {
    ttl / 3 > WATCH_EVERY
}

/// Releases the lease; false when the gateway said it was no longer current.
/// One that cannot be released now ends at its TTL, which is said.
async fn release(gateway: &Gateway, target: &Target, lease: &Lease) -> bool {
    match tokio::time::timeout(REQUEST_TIMEOUT, gateway.release(target, &lease.lease_id)).await {
        Ok(Ok(Verdict::Done)) => true,
        Ok(Ok(Verdict::NotCurrent(_))) => false,
        Ok(Err(err)) => {
            say(format_args!(
                "could not release the lease on {target} ({err}); it ends at its TTL"
            ));
            true
        }
        Err(_) => {
            say(format_args!(
                "could not release the lease on {target} (no answer within {REQUEST_TIMEOUT:?}); it ends at its TTL"
            ));
            true
        }
    }
}

/// One line on why `target` stayed busy past the wait.
fn busy_line(target: &Target, busy: Busy) -> String {
    match busy {
        Busy::Held(holder) => format!("{target} is locked by {}", describe(holder.as_ref())),
        Busy::Delayed { free_at } => {
            format!("{target} is in its lock-delay after a lost lease, free at {free_at}")
        }
        Busy::Full {
            limit,
            holders,
            waiting,
            free_at,
        } => {
            let limit = limit.map_or_else(|| "its limit".to_owned(), |n| n.to_string());
            let held = match (holders.is_empty(), free_at) {
                (false, _) => {
                    let names: Vec<_> = holders.iter().map(name).collect();
                    format!("{limit} held, by {}", names.join(", "))
                }
                // Lost leases' lock-delays keep the slots: no one to name.
                (true, Some(free_at)) => format!(
                    "{limit} kept by the lock-delays of lost leases, the first free at {free_at}"
                ),
                (true, None) => format!("{limit} held, by holders the gateway did not name"),
            };
            let waiting = waiting.map_or_else(String::new, |n| format!("; {n} waiting"));
            format!("{target} is full ({held}{waiting})")
        }
    }
}

/// A state lock's holder: who, since when, until when, running what.
fn describe(holder: Option<&Holder>) -> String {
    match holder {
        Some(h) => {
            let mut text = format!("{} since {} until {}", h.owner, h.acquired_at, h.expires_at);
            if let Some(command) = h.command() {
                text.push_str(&format!(", running `{command}`"));
            }
            text
        }
        None => "another holder (the gateway did not name it)".into(),
    }
}

/// A pool's holder, shorter, since a pool names many: who, running what.
fn name(holder: &Holder) -> String {
    match holder.command() {
        Some(command) => format!("{} running `{command}`", holder.owner),
        None => holder.owner.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(owner: &str, command: Option<&str>) -> Holder {
        let info = command.map_or_else(
            || serde_json::json!({}),
            |c| serde_json::json!({ "command": c }),
        );
        serde_json::from_value(serde_json::json!({
            "owner": owner, "acquired_at": "t1", "expires_at": "t2", "info": info,
        }))
        .unwrap()
    }

    #[test]
    fn a_full_pool_names_its_holders_and_their_commands() {
        let pool = Target::Pool {
            name: "db".into(),
            limit: 2,
            slots: 1,
            priority: 0,
        };
        let full = Busy::Full {
            limit: Some(2),
            holders: vec![holder("a@h:1", Some("sleep 1")), holder("b@h:2", None)],
            waiting: Some(1),
            free_at: None,
        };
        assert_eq!(
            busy_line(&pool, full),
            "pool db is full (2 held, by a@h:1 running `sleep 1`, b@h:2; 1 waiting)"
        );
        let bare = Busy::Full {
            limit: None,
            holders: vec![],
            waiting: None,
            free_at: None,
        };
        assert_eq!(
            busy_line(&pool, bare),
            "pool db is full (its limit held, by holders the gateway did not name)"
        );
        let delayed = Busy::Full {
            limit: Some(1),
            holders: vec![],
            waiting: Some(0),
            free_at: Some("t3".into()),
        };
        assert_eq!(
            busy_line(&pool, delayed),
            "pool db is full (1 kept by the lock-delays of lost leases, the first free at t3; 0 waiting)"
        );
    }

    #[test]
    fn a_held_state_id_reads_as_it_always_has() {
        let state = Target::State("job".into());
        assert_eq!(
            busy_line(
                &state,
                Busy::Held(Some(holder("cron", Some("meltano run"))))
            ),
            "job is locked by cron since t1 until t2, running `meltano run`"
        );
        assert_eq!(
            busy_line(&state, Busy::Held(None)),
            "job is locked by another holder (the gateway did not name it)"
        );
    }
}
