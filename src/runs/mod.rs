//! Runs (design.md, "Runs (contract)"): one execution of a pipeline under a
//! state_id's lease, whose heartbeat is the lease. A run is ended by its
//! `PATCH`, or by its lease's end: whichever gateway reads a run still open
//! asks the lease history how its lease ended, and if it has, writes the run
//! `lost` at the lease's end. So no run stays `running` past its lease,
//! whichever gateway started it and whichever gateways restarted since.

mod advance;

use std::time::{Duration, Instant};

use uuid::Uuid;

use self::advance::advanced;
use crate::domain::{Lease, StateId};
use crate::locks::{LockError, LockManager};
use crate::metrics::Metrics;
use crate::store::{
    LeaseEnd, LeaseHistoryStore, RunEnd, RunStart, RunStore, StoreError, StoredRun, now_ms,
};

/// How long a run's start waits for its lease to show where it is asked:
/// a lease granted through another gateway reaches ClickHouse about a
/// second after its grant (`locks::record`).
const LEASE_LANDING: Duration = Duration::from_secs(3);

/// How often the start looks again meanwhile.
const LEASE_POLL: Duration = Duration::from_millis(200);

/// How long past its recorded expiry a lease counts as expired: its
/// renewals' rows are written behind (`locks::record`), so a renewed lease's
/// row may show the expiry it had before, for about a second.
const EXPIRY_LANDING: Duration = Duration::from_secs(3);

/// A run whose lease never reached ClickHouse this long after its start
/// had a lease that died with its gateway before its row was written: it is
/// `lost`, at its start.
const UNRECORDED_LEASE: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("the lease is not the state_id's current one")]
    LeaseNotCurrent,
    #[error("this lease already holds run {0}")]
    Exists(Uuid),
    #[error("run {0} has ended")]
    Ended(Uuid),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Lock(#[from] LockError),
}

/// How a run's command ended, as its `PATCH` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    Exit(i32),
    Signal(i32),
}

/// The run book: the runs table, read with the lease history.
pub struct RunBook<'a> {
    pub runs: &'a RunStore,
    /// What this gateway knows of the leases now, beside their history.
    pub locks: &'a LockManager,
    pub leases: &'a LeaseHistoryStore,
    pub metrics: &'a Metrics,
}

impl RunBook<'_> {
    /// Records a run on `lease_id`, which must be `id`'s current lease.
    pub async fn start(
        &self,
        id: &StateId,
        lease_id: Uuid,
        actor: &str,
        info: &str,
    ) -> Result<StoredRun, RunError> {
        let lease = self.current_lease(id, lease_id).await?;
        if let Some(run) = self.runs.of_lease(id, lease_id).await? {
            return Err(RunError::Exists(run.run_id));
        }
        let start = RunStart {
            run_id: Uuid::new_v4(),
            state_id: id,
            lease_id,
            owner: &lease.owner,
            fencing_token: lease.fencing_token,
            actor,
            info,
            started_ms: now_ms(),
        };
        self.runs.start(&start).await?;
        let (run_id, started_ms) = (start.run_id, start.started_ms);
        Ok(StoredRun {
            run_id,
            state_id: id.as_str().to_owned(),
            lease_id,
            owner: lease.owner,
            fencing_token: lease.fencing_token,
            actor: actor.to_owned(),
            info: info.to_owned(),
            started_ms,
            end: None,
        })
    }

    /// The lease, once it shows as `id`'s current one where this gateway
    /// looks; refused as soon as its history says it ended.
    async fn current_lease(&self, id: &StateId, lease_id: Uuid) -> Result<Lease, RunError> {
        let deadline = Instant::now() + LEASE_LANDING;
        loop {
            if let Some(lease) = self.locks.current(id, None).await?
                && lease.lease_id == lease_id
            {
                return Ok(lease);
            }
            let ends = self.leases.ends_of(&[(id.as_str(), lease_id)]).await?;
            if matches!(ends.get(&lease_id), Some(Some(_))) || Instant::now() >= deadline {
                return Err(RunError::LeaseNotCurrent);
            }
            tokio::time::sleep(LEASE_POLL).await;
        }
    }

    /// Ends `run` (read and settled) with `ending`, its info merged with
    /// `info`; refused if it has ended, by its lease or another `PATCH`.
    pub async fn end(
        &self,
        run: StoredRun,
        ending: Ending,
        info: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<StoredRun, RunError> {
        if run.end.is_some() {
            return Err(RunError::Ended(run.run_id));
        }
        let ended_ms = now_ms();
        let (versions, advanced) = self.window(&run, ended_ms).await?;
        let (status, exit_code, signal) = match ending {
            Ending::Exit(0) => ("succeeded", Some(0), None),
            Ending::Exit(code) => ("failed", Some(code), None),
            Ending::Signal(signal) => ("failed", None, Some(signal)),
        };
        let end = RunEnd {
            status: status.to_owned(),
            ended_ms,
            exit_code,
            signal,
            info: merged(&run.info, info),
            versions,
            advanced,
        };
        self.runs.end(&run, &end).await?;
        // Of two ends written at once (this one and a gateway finding the
        // lease ended), the first ClickHouse received stands.
        let stored = self.runs.get(run.run_id).await?.unwrap_or(run);
        if stored.end.as_ref() != Some(&end) {
            return Err(RunError::Ended(stored.run_id));
        }
        self.metrics.run_ended(status, ended_ms - stored.started_ms);
        Ok(stored)
    }

    /// Ends each open run of `runs` whose lease has ended, as `lost` at the
    /// lease's end, and answers them all as they stand.
    pub async fn settle(&self, runs: Vec<StoredRun>) -> Result<Vec<StoredRun>, RunError> {
        let open: Vec<(&str, Uuid)> = runs
            .iter()
            .filter(|run| run.end.is_none())
            .map(|run| (run.state_id.as_str(), run.lease_id))
            .collect();
        if open.is_empty() {
            return Ok(runs);
        }
        let ends = self.leases.ends_of(&open).await?;
        let now = now_ms();
        let mut settled = Vec::with_capacity(runs.len());
        for mut run in runs {
            let lease_end = match ends.get(&run.lease_id) {
                _ if run.end.is_some() => None,
                Some(Some((LeaseEnd::Expired, at))) => self.expired(&run, *at, now).await?,
                Some(end) => end.as_ref().map(|(_, at)| *at),
                None => (now - run.started_ms >= UNRECORDED_LEASE.as_millis() as i64)
                    .then_some(run.started_ms),
            };
            if let Some(ended_ms) = lease_end {
                let (versions, advanced) = self.window(&run, ended_ms).await?;
                let end = RunEnd {
                    status: "lost".to_owned(),
                    ended_ms,
                    exit_code: None,
                    signal: None,
                    info: run.info.clone(),
                    versions,
                    advanced,
                };
                self.runs.end(&run, &end).await?;
                self.metrics.run_ended("lost", ended_ms - run.started_ms);
                run = self.runs.get(run.run_id).await?.unwrap_or(run);
            }
            settled.push(run);
        }
        Ok(settled)
    }

    /// When the run's lease expired (`at`, as its row says), unless it may
    /// have been renewed since: its row is recent, or it is still the id's
    /// current lease where this gateway looks.
    async fn expired(&self, run: &StoredRun, at: i64, now: i64) -> Result<Option<i64>, RunError> {
        if now - at < EXPIRY_LANDING.as_millis() as i64 {
            return Ok(None);
        }
        // An id the API could not have taken holds no lease now.
        let Ok(id) = StateId::parse(&run.state_id) else {
            return Ok(Some(at));
        };
        let current = self.locks.current(&id, None).await?;
        Ok((current.map(|lease| lease.lease_id) != Some(run.lease_id)).then_some(at))
    }

    /// What the run did up to `end_ms`: the versions written, and the
    /// streams whose bookmark moved (JSON text).
    pub async fn window(&self, run: &StoredRun, end_ms: i64) -> Result<(u64, String), RunError> {
        let id = run.state_id.as_str();
        let versions = self
            .runs
            .versions_between(id, run.started_ms, end_ms)
            .await?;
        let before = self.runs.state_at(id, run.started_ms - 1).await?;
        let after = self.runs.state_at(id, end_ms).await?;
        let moved = advanced(before.as_ref(), after.as_ref());
        Ok((
            versions,
            serde_json::to_string(&moved).expect("streams always serialize"),
        ))
    }
}

/// The run's info (a JSON object's text) with `more`'s members over it.
fn merged(info: &str, more: Option<&serde_json::Map<String, serde_json::Value>>) -> String {
    let mut object = match serde_json::from_str::<serde_json::Value>(info) {
        Ok(serde_json::Value::Object(object)) => object,
        _ => serde_json::Map::new(),
    };
    for (key, value) in more.into_iter().flatten() {
        object.insert(key.clone(), value.clone());
    }
    serde_json::Value::Object(object).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_end_merges_its_info_over_the_start() {
        let more = serde_json::json!({"rows": 5, "host": "b"});
        let merged = merged(r#"{"host":"a","pid":7}"#, more.as_object());
        let value: serde_json::Value = serde_json::from_str(&merged).unwrap();
        assert_eq!(value, serde_json::json!({"host": "b", "pid": 7, "rows": 5}));
        assert_eq!(merged_none(), r#"{"pid":7}"#);
    }

    fn merged_none() -> String {
        merged(r#"{"pid":7}"#, None)
    }
}
