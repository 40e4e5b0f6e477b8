//! What the gateway's answers other than a success say: its problem
//! documents, the holders they name, and which 409s to an acquire mean busy
//! (held by another, in a lock-delay, or a full pool) rather than refused.

use std::time::Duration;

use reqwest::StatusCode;
use serde::Deserialize;

/// Who holds a lock or a pool slot, as the gateway names them.
#[derive(Clone, Debug, Deserialize)]
pub struct Holder {
    pub owner: String,
    pub acquired_at: String,
    pub expires_at: String,
    /// What the holder said of itself; a gateway before `info` sends none.
    #[serde(default)]
    pub info: serde_json::Map<String, serde_json::Value>,
}

impl Holder {
    /// The command the holder runs, when its info names one (as `statehouse lock`'s does).
    pub fn command(&self) -> Option<&str> {
        self.info.get("command").and_then(serde_json::Value::as_str)
    }
}

/// Why an acquire got no lease within its wait: another may still let go.
pub enum Busy {
    /// Held by another for the whole wait; the holder, when the gateway could name it.
    Held(Option<Holder>),
    /// In the lock-delay after a lost lease, past the wait: no lease is
    /// granted before `free_at` (RFC 3339, as the gateway wrote it).
    Delayed { free_at: String },
    /// Every slot of the pool stayed taken for the whole wait.
    Full {
        limit: Option<u64>,
        holders: Vec<Holder>,
        waiting: Option<u64>,
        /// When no lease holds a slot and lock-delays keep them all: when
        /// the first comes free.
        free_at: Option<String>,
    },
}

/// An answer, as read.
pub struct Answer {
    pub status: StatusCode,
    pub retry_after: Option<Duration>,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn problem(&self) -> Problem {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| Problem {
            detail: String::from_utf8_lossy(&self.body[..self.body.len().min(200)]).into_owned(),
            ..Problem::default()
        })
    }

    /// A 409 to an acquire that means busy, or None.
    pub fn busy(&self) -> Option<Busy> {
        if self.status != StatusCode::CONFLICT {
            return None;
        }
        let problem = self.problem();
        if problem.is("lock-held") {
            Some(Busy::Held(problem.holder))
        } else if problem.is("lock-delay") {
            Some(Busy::Delayed {
                free_at: problem
                    .free_at
                    .unwrap_or_else(|| "a time the gateway did not name".into()),
            })
        } else if problem.is("pool-full") {
            Some(Busy::Full {
                limit: problem.limit,
                holders: problem.holders,
                waiting: problem.waiting,
                free_at: problem.free_at,
            })
        } else {
            None
        }
    }
}

#[derive(Deserialize, Default)]
pub struct Problem {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    title: String,
    #[serde(default)]
    detail: String,
    holder: Option<Holder>,
    /// When a lock-delay ends (`lock-delay` problems, and `pool-full`
    /// ones when only lock-delays keep the slots).
    free_at: Option<String>,
    /// A pool's limit, holders and line (`pool-full` problems).
    limit: Option<u64>,
    #[serde(default)]
    holders: Vec<Holder>,
    waiting: Option<u64>,
}

impl Problem {
    pub fn is(&self, slug: &str) -> bool {
        self.kind
            .strip_prefix("urn:statehouse:problem:")
            .is_some_and(|kind| kind == slug)
    }

    pub fn summary(&self) -> String {
        match (self.title.is_empty(), self.detail.is_empty()) {
            (false, false) => format!("{}: {}", self.title, self.detail),
            (false, true) => self.title.clone(),
            (true, false) => self.detail.clone(),
            (true, true) => "no detail".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: StatusCode, body: &str) -> Answer {
        Answer {
            status,
            retry_after: None,
            body: body.as_bytes().to_vec(),
        }
    }

    #[test]
    fn problems_are_read_by_their_type() {
        let held = answer(
            StatusCode::CONFLICT,
            r#"{"type":"urn:statehouse:problem:lock-held","title":"Lock held by another owner","status":409,"detail":"x","holder":{"state_id":"j","owner":"cron@a:1","fencing_token":3,"acquired_at":"2026-01-01T00:00:00.000Z","expires_at":"2026-01-01T00:00:30.000Z","gateway_id":"g"}}"#,
        );
        let problem = held.problem();
        assert!(problem.is("lock-held") && !problem.is("lock"));
        let holder = problem.holder.unwrap();
        assert_eq!(holder.owner, "cron@a:1");
        assert_eq!(holder.command(), None);
        let with_info: Holder = serde_json::from_str(
            r#"{"owner":"o","acquired_at":"a","expires_at":"b","info":{"command":"meltano run t"}}"#,
        )
        .unwrap();
        assert_eq!(with_info.command(), Some("meltano run t"));
        let garbage = answer(StatusCode::BAD_GATEWAY, "<html>bad gateway</html>");
        assert_eq!(garbage.problem().summary(), "<html>bad gateway</html>");
    }

    #[test]
    fn a_lock_delay_is_busy_until_its_free_at() {
        let delayed = answer(
            StatusCode::CONFLICT,
            r#"{"type":"urn:statehouse:problem:lock-delay","title":"In lock-delay","status":409,"detail":"the last lease was lost","free_at":"2026-12-05T01:00:15.000Z"}"#,
        );
        match delayed.busy() {
            Some(Busy::Delayed { free_at }) => assert_eq!(free_at, "2026-12-05T01:00:15.000Z"),
            _ => panic!("a lock-delay is busy"),
        }
        let unnamed = answer(
            StatusCode::CONFLICT,
            r#"{"type":"urn:statehouse:problem:lock-delay","status":409}"#,
        );
        assert!(
            matches!(unnamed.busy(), Some(Busy::Delayed { free_at }) if free_at.contains("did not name"))
        );
        let held = answer(
            StatusCode::CONFLICT,
            r#"{"type":"urn:statehouse:problem:lock-held","status":409,"holder":{"owner":"cron","acquired_at":"a","expires_at":"b"}}"#,
        );
        assert!(matches!(held.busy(), Some(Busy::Held(Some(h))) if h.owner == "cron"));
        // Another conflict, or the same type with another status, is not busy.
        let other = answer(
            StatusCode::CONFLICT,
            r#"{"type":"urn:statehouse:problem:lease-held-elsewhere","status":409}"#,
        );
        assert!(other.busy().is_none());
        let unavailable = answer(
            StatusCode::SERVICE_UNAVAILABLE,
            r#"{"type":"urn:statehouse:problem:lock-delay","status":503}"#,
        );
        assert!(unavailable.busy().is_none());
    }

    #[test]
    fn a_full_pool_is_busy_and_names_its_holders_but_a_limit_mismatch_is_not() {
        let full = answer(
            StatusCode::CONFLICT,
            r#"{"type":"urn:statehouse:problem:pool-full","title":"Pool full","status":409,"detail":"d","pool":"db","limit":2,"holders":[{"owner":"a","fencing_token":1,"acquired_at":"t1","expires_at":"t2","gateway_id":"g","lock_delay_seconds":0,"info":{"command":"sleep 1"}},{"owner":"b","fencing_token":2,"acquired_at":"t1","expires_at":"t2","gateway_id":"g","lock_delay_seconds":0,"info":{}}],"waiting":3}"#,
        );
        let Some(Busy::Full {
            limit,
            holders,
            waiting,
            free_at: None,
        }) = full.busy()
        else {
            panic!("a full pool is busy");
        };
        assert_eq!((limit, waiting), (Some(2), Some(3)));
        let owners: Vec<_> = holders.iter().map(|h| h.owner.as_str()).collect();
        assert_eq!(owners, ["a", "b"]);
        assert_eq!(holders[0].command(), Some("sleep 1"));
        let delayed = answer(
            StatusCode::CONFLICT,
            r#"{"type":"urn:statehouse:problem:pool-full","status":409,"pool":"db","limit":1,"holders":[],"waiting":0,"free_at":"2026-12-05T01:00:15.000Z"}"#,
        );
        assert!(
            matches!(delayed.busy(), Some(Busy::Full { holders, free_at: Some(at), .. }) if holders.is_empty() && at == "2026-12-05T01:00:15.000Z")
        );
        let mismatch = answer(
            StatusCode::CONFLICT,
            r#"{"type":"urn:statehouse:problem:pool-limit-mismatch","status":409,"pool":"db","limit":3}"#,
        );
        assert!(mismatch.busy().is_none());
    }
}
