//! The command line of `statehouse restore`.

use std::time::SystemTime;

use clap::Args;

use crate::client::ConnectionArgs;
use crate::domain::{AsOf, Version, parse_duration};

#[derive(Debug, Clone, Args)]
pub struct RestoreArgs {
    /// Where the gateway is and how to reach it: the same flags and
    /// variables as `statehouse lock` (a write token).
    #[command(flatten)]
    pub connection: ConnectionArgs,

    /// The glob of state ids to put back (`*` for every one in the token's scope).
    #[arg(long)]
    pub pattern: String,

    /// The instant to put them back to: RFC 3339 in any offset
    /// (2026-12-01T13:59:00Z), or a duration ago (2h, 90m, 1d).
    #[arg(long, value_name = "T")]
    pub at: String,

    /// Only show what would change; write nothing.
    #[arg(long)]
    pub dry_run: bool,

    /// Why, kept in each written version's history.
    #[arg(long)]
    pub reason: Option<String>,

    /// Print the gateway's answer as JSON instead of lines.
    #[arg(long)]
    pub json: bool,
}

impl RestoreArgs {
    /// `--at` as the RFC 3339 instant the gateway takes: as given when it
    /// is one, else that long before `now`.
    pub fn instant(&self, now: SystemTime) -> Result<String, String> {
        if AsOf::parse(&self.at).is_ok() {
            return Ok(self.at.clone());
        }
        let ago = parse_duration(&self.at).ok_or_else(|| {
            format!(
                "--at {:?} is neither an RFC 3339 instant (2026-12-01T13:59:00Z) nor a duration ago (2h, 90m, 1d)",
                self.at
            )
        })?;
        let then = now
            .checked_sub(ago)
            .and_then(|then| then.duration_since(SystemTime::UNIX_EPOCH).ok())
            .ok_or_else(|| format!("--at {:?} is before 1970", self.at))?;
        let ms = i64::try_from(then.as_millis()).map_err(|_| "--at is out of range".to_owned())?;
        Ok(Version::from_millis(ms).to_rfc3339())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn args(at: &str) -> RestoreArgs {
        RestoreArgs {
            connection: ConnectionArgs {
                url: None,
                token: None,
                token_file: None,
                ca_file: None,
                client_cert_file: None,
                client_key_file: None,
            },
            pattern: "*".into(),
            at: at.into(),
            dry_run: false,
            reason: None,
            json: false,
        }
    }

    #[test]
    fn an_instant_or_a_duration_ago() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_133_540);
        let instant = "2026-12-01T14:59:00+01:00";
        assert_eq!(args(instant).instant(now).unwrap(), instant);
        assert_eq!(args("2h").instant(now).unwrap(), "2026-12-01T11:59:00.000Z");
        assert_eq!(args("1d").instant(now).unwrap(), "2026-11-30T13:59:00.000Z");
        for bad in ["yesterday", "2026-12-01", "-2h", ""] {
            assert!(args(bad).instant(now).is_err(), "{bad}");
        }
    }
}
