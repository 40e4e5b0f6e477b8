//! The command line of `statehouse lock`, with its environment variables.

use std::ffi::OsString;
use std::time::Duration;

use clap::{ArgGroup, Args};

use crate::client::ConnectionArgs;

use super::info;
use super::target::Target;

// What to hold: a state_id, pools, or both (a run that holds nothing would
// guard nothing). One group, so that a command line with neither names both
// in its error.
#[derive(Debug, Clone, Args)]
#[command(group(
    ArgGroup::new("held").required(true).multiple(true).args(["pools", "state_id"])
))]
pub struct LockArgs {
    /// Where the gateway is and how to reach it: URL, token and TLS files.
    #[command(flatten)]
    pub connection: ConnectionArgs,

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

    /// Asked of the gateway with the lease: should it be lost (expiry or
    /// force-unlock), no next run is granted the id for this long, time for
    /// this run's tree to be stopped. Default: 2s (the runner notices a
    /// lost lease within 2s) + --grace + 5s, 17s with the default --grace:
    /// a command that ignores SIGTERM is killed before the next run's
    /// starts. The gateway cuts it to its --max-lock-delay (60s by default),
    /// and the runner says so. A release has none.
    #[arg(long, env = "STATEHOUSE_LOCK_DELAY", value_parser = humantime::parse_duration)]
    pub lock_delay: Option<Duration>,

    /// Added to the lease's info beside host, pid and command, as operators
    /// see it in the lock's views and history; repeatable.
    #[arg(long = "info", value_name = "KEY=VALUE", value_parser = info::parse_pair)]
    pub info: Vec<(String, String)>,

    /// Record no run: by default the command's run is recorded under the
    /// state_id's lease (`GET /v1/runs`), ended with its exit code or signal.
    #[arg(long = "no-run")]
    pub no_run: bool,

    /// Also take SLOTS (default 1) of pool NAME's LIMIT (1 to 1000) slots:
    /// runs whose slots add up to at most LIMIT hold it at once; repeatable.
    /// Pools are taken in name order, then the state_id, all within --wait;
    /// a pool still full past it exits 75.
    #[arg(long = "pool", value_name = "NAME=LIMIT[:SLOTS]", value_parser = parse_pool)]
    pub pools: Vec<PoolArg>,

    /// This run's place in the pools' lines, -1000 to 1000: higher goes
    /// first, runs of one priority in arrival order.
    #[arg(long, default_value_t = 0, requires = "pools", allow_hyphen_values = true,
          value_parser = clap::value_parser!(i16).range(-1000..=1000))]
    pub priority: i16,

    /// The state_id to hold; for `meltano run` it is <environment>:<tap>-to-<target>.
    /// May be left out when --pool is given.
    pub state_id: Option<String>,

    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND", value_parser = clap::value_parser!(OsString))]
    pub command: Vec<OsString>,
}

/// The contract's bound on how late the runner notices its lease's end
/// (`leases` looks often enough); the default lock-delay counts it in.
pub const NOTICED_WITHIN: Duration = Duration::from_secs(2);

/// Beyond the time to notice the loss and the grace, how long the next
/// run's lease waits by default after this one was lost: the SIGKILL has to
/// land and the processes to go.
const LOCK_DELAY_MARGIN: Duration = Duration::from_secs(5);

impl LockArgs {
    /// What to take, in order: the pools by name (byte order, the same in
    /// every run, so that two runs never each hold a pool the other waits
    /// for), then the state_id. A pool named twice is a bad command line.
    pub fn targets(&self) -> Result<Vec<Target>, String> {
        let mut pools = self.pools.clone();
        pools.sort_by(|a, b| a.name.cmp(&b.name));
        if let Some(twice) = pools.windows(2).find(|pair| pair[0].name == pair[1].name) {
            return Err(format!("--pool {:?} is given twice", twice[0].name));
        }
        let pools = pools.into_iter().map(|pool| Target::Pool {
            name: pool.name,
            limit: pool.limit,
            slots: pool.slots,
            priority: self.priority,
        });
        Ok(pools
            .chain(self.state_id.clone().map(Target::State))
            .collect())
    }

    /// The lock-delay to ask for: --lock-delay, or the time to notice a
    /// lost lease + --grace + 5s (design.md, "Run leases (contract)").
    pub fn lock_delay(&self) -> Duration {
        self.lock_delay
            .unwrap_or(NOTICED_WITHIN + self.grace + LOCK_DELAY_MARGIN)
    }
}

/// The limits a pool may have, as the gateway takes them.
const POOL_LIMITS: std::ops::RangeInclusive<u16> = 1..=1000;

/// A `--pool NAME=LIMIT[:SLOTS]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolArg {
    pub name: String,
    pub limit: u16,
    pub slots: u16,
}

/// A `--pool NAME=LIMIT[:SLOTS]`: the name is whatever comes before the
/// last `=` (a pool name may hold one, as a state_id may), the limit 1 to
/// 1000, the slots 1 (the default) to the limit.
fn parse_pool(raw: &str) -> Result<PoolArg, String> {
    let (name, value) = raw
        .rsplit_once('=')
        .filter(|(name, _)| !name.is_empty())
        .ok_or("expected NAME=LIMIT[:SLOTS] with a non-empty NAME")?;
    let (limit, slots) = value.split_once(':').unwrap_or((value, "1"));
    let limit = match limit.parse::<u16>() {
        Ok(limit) if POOL_LIMITS.contains(&limit) => limit,
        _ => {
            return Err(format!(
                "the LIMIT of pool {name:?} must be a whole number from 1 to 1000, not {limit:?}"
            ));
        }
    };
    match slots.parse::<u16>() {
        Ok(slots) if (1..=limit).contains(&slots) => Ok(PoolArg {
            name: name.to_owned(),
            limit,
            slots,
        }),
        _ => Err(format!(
            "the SLOTS of pool {name:?} must be a whole number from 1 to its LIMIT, {limit}, not {slots:?}"
        )),
    }
}

/// A lease's TTL as the gateway takes it: whole seconds, 1 to 3600.
fn parse_ttl(raw: &str) -> Result<Duration, String> {
    let ttl = humantime::parse_duration(raw).map_err(|e| e.to_string())?;
    if ttl.subsec_nanos() != 0 || !(1..=3600).contains(&ttl.as_secs()) {
        return Err("the TTL must be a whole number of seconds from 1s to 1h".into());
    }
    Ok(ttl)
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
    fn defaults_and_flags() {
        let args = parse(&["dev:tap-to-target", "--", "meltano", "run", "--force"]).unwrap();
        assert_eq!(args.state_id.as_deref(), Some("dev:tap-to-target"));
        assert_eq!(
            args.targets().unwrap(),
            [Target::State("dev:tap-to-target".into())]
        );
        assert_eq!(args.command, ["meltano", "run", "--force"]);
        assert_eq!(args.ttl, Duration::from_secs(30));
        assert_eq!(args.wait, Duration::ZERO);
        assert_eq!(args.grace, Duration::from_secs(10));
        assert_eq!(args.lock_delay(), Duration::from_secs(17));
        let args = parse(&[
            "--url=http://gw:9000/base/",
            "--ttl=1m",
            "--wait=90s",
            "--owner=cron",
            "--grace=30s",
            "id",
            "--",
            "true",
        ])
        .unwrap();
        assert_eq!(
            args.connection.url.as_ref().unwrap().as_str(),
            "http://gw:9000/base"
        );
        assert_eq!(args.ttl, Duration::from_secs(60));
        assert_eq!(args.wait, Duration::from_secs(90));
        assert_eq!(args.owner.as_deref(), Some("cron"));
        assert_eq!(args.lock_delay(), Duration::from_secs(37));
        let args = parse(&["--lock-delay=0s", "id", "--", "true"]).unwrap();
        assert_eq!(args.lock_delay(), Duration::ZERO);
        assert!(args.info.is_empty());
        let args = parse(&["--info", "dag=nightly", "--info=try=2", "id", "--", "true"]).unwrap();
        assert_eq!(
            args.info,
            [
                ("dag".to_owned(), "nightly".to_owned()),
                ("try".to_owned(), "2".to_owned())
            ]
        );
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
            &["--info=novalue", "id", "--", "true"],
            &["--info==v", "id", "--", "true"],
            &["--pool=db", "--", "true"],
            &["--pool==2", "--", "true"],
            &["--pool=db=", "--", "true"],
            &["--pool=db=0", "--", "true"],
            &["--pool=db=1001", "--", "true"],
            &["--pool=db=-1", "--", "true"],
            &["--pool=db=1.5", "--", "true"],
            &["--pool=db=2", "--"],
            &["--pool=db=2"],
            &["--pool=db=4:0", "--", "true"],
            &["--pool=db=4:5", "--", "true"],
            &["--pool=db=4:", "--", "true"],
            &["--pool=db=4:2:1", "--", "true"],
            &["--pool=db=2", "--priority=1001", "--", "true"],
            &["--pool=db=2", "--priority=-1001", "--", "true"],
            &["--pool=db=2", "--priority=high", "--", "true"],
            &["--priority=5", "id", "--", "true"],
        ] {
            assert!(parse(argv).is_err(), "{argv:?}");
        }
    }

    #[test]
    fn pools_are_taken_in_name_order_then_the_state_id() {
        let pool = |name: &str, limit| Target::Pool {
            name: name.into(),
            limit,
            slots: 1,
            priority: 0,
        };
        let args = parse(&[
            "--pool=source-db=2",
            "--pool",
            "api=1000",
            "--pool=Zed=1",
            "--pool=a=b=3",
            "dev:t-to-u",
            "--",
            "true",
        ])
        .unwrap();
        assert_eq!(
            args.targets().unwrap(),
            [
                pool("Zed", 1),
                pool("a=b", 3),
                pool("api", 1000),
                pool("source-db", 2),
                Target::State("dev:t-to-u".into()),
            ],
            "byte order (upper case first), the state_id last"
        );
        // A pool alone is enough: the next argument after `--` is the command.
        let args = parse(&["--pool=db=2", "--", "sh", "-c", "exit 0"]).unwrap();
        assert_eq!(args.state_id, None);
        assert_eq!(args.targets().unwrap(), [pool("db", 2)]);
        assert_eq!(args.command, ["sh", "-c", "exit 0"]);
    }

    #[test]
    fn a_pool_named_twice_is_refused_whatever_its_limits() {
        for argv in [
            &["--pool=db=2", "--pool=db=2", "--", "true"][..],
            &[
                "--pool=db=2",
                "--pool=x=1",
                "--pool=db=3",
                "id",
                "--",
                "true",
            ],
        ] {
            let err = parse(argv).unwrap().targets().unwrap_err();
            assert!(err.contains("\"db\"") && err.contains("twice"), "{err}");
        }
        // Names differing only in case are different pools.
        let args = parse(&["--pool=db=2", "--pool=DB=2", "--", "true"]).unwrap();
        assert_eq!(args.targets().unwrap().len(), 2);
    }

    #[test]
    fn pool_limits_run_from_1_to_1000_and_slots_from_1_to_the_limit() {
        let arg = |name: &str, limit, slots| PoolArg {
            name: name.into(),
            limit,
            slots,
        };
        assert_eq!(parse_pool("db=1"), Ok(arg("db", 1, 1)));
        assert_eq!(parse_pool("db=1000"), Ok(arg("db", 1000, 1)));
        assert_eq!(parse_pool("db=4:2"), Ok(arg("db", 4, 2)));
        assert_eq!(parse_pool("db=4:4"), Ok(arg("db", 4, 4)));
        assert_eq!(parse_pool("dev:db=4:1"), Ok(arg("dev:db", 4, 1)));
        for bad in ["db=0", "db=1001", "db=65536", "db=", "db=two", "=5", "db"] {
            assert!(parse_pool(bad).is_err(), "{bad}");
        }
        for bad in ["db=4:0", "db=4:5", "db=4:", "db=4:x", "db=:2"] {
            assert!(parse_pool(bad).is_err(), "{bad}");
        }
        assert!(parse_pool("db=0").unwrap_err().contains("1 to 1000"));
        assert!(
            parse_pool("db=4:5")
                .unwrap_err()
                .contains("to its LIMIT, 4")
        );
    }

    #[test]
    fn a_priority_goes_with_every_pool_and_the_slots_with_theirs() {
        let args = parse(&[
            "--pool=b=4:3",
            "--pool=a=2",
            "--priority",
            "-7",
            "--",
            "true",
        ])
        .unwrap();
        assert_eq!(
            args.targets().unwrap(),
            [
                Target::Pool {
                    name: "a".into(),
                    limit: 2,
                    slots: 1,
                    priority: -7
                },
                Target::Pool {
                    name: "b".into(),
                    limit: 4,
                    slots: 3,
                    priority: -7
                },
            ]
        );
        let args = parse(&["--pool=a=2", "--", "true"]).unwrap();
        assert_eq!(args.priority, 0);
    }

    #[test]
    fn the_command_keeps_its_own_flags() {
        let args = parse(&["id", "--", "sh", "-c", "exit 3", "--ttl=5s"]).unwrap();
        assert_eq!(args.command, ["sh", "-c", "exit 3", "--ttl=5s"]);
        assert_eq!(args.ttl, Duration::from_secs(30));
    }
}
