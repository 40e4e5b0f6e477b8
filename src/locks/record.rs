//! Lease rows are written behind the lock hot path: grants, renewals and
//! releases are decided in memory by the id's authority, and their rows
//! (which let other gateways and dashboards see locks, carry handed-over
//! leases to the next authority, and make each id's lease history) are
//! coalesced per lease and written in one INSERT per flush, retried through
//! a ClickHouse outage. Flushes come at most one per `SPACING`: a fleet's
//! lock traffic costs ClickHouse about one INSERT a second, while a lone
//! grant is written within `GATHER`. A pool's grants and renewals are the
//! exception: its holders write nothing through a gateway, so a next
//! authority knows of them only by their rows, which land before the
//! holder hears of its lease ([`Recorder::landed`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use uuid::Uuid;

use super::claim::Coordinator;
use crate::domain::{Forced, Lease, LeaseState, LeaseVersion, StateId};
use crate::store::{Candidate, LeaseRecord, LeaseRows, LeaseStore, StoreError, now_ms};

/// How long a flush waits for more rows to join it once one is pending.
const GATHER: Duration = Duration::from_millis(10);

/// The least time between two flushes; rows meanwhile wait for the next.
const SPACING: Duration = Duration::from_secs(1);

pub(super) struct Recorder {
    store: LeaseStore,
    /// The newest unwritten row per lease: a row only ever replaces an
    /// older version of its lease's row, so older ones need no write. A
    /// lease ended and followed by the next within one flush still gets its
    /// end written: the id's history shows how it ended.
    pending: Mutex<HashMap<(StateId, Uuid), LeaseRecord>>,
    wake: Notify,
}

impl Recorder {
    pub fn new(store: LeaseStore) -> Self {
        Self {
            store,
            pending: Mutex::new(HashMap::new()),
            wake: Notify::new(),
        }
    }

    /// The row of a lease granted or renewed.
    pub fn held(&self, lease: &Lease, version: LeaseVersion) {
        self.record(LeaseRecord {
            lease: lease.clone(),
            version,
            state: LeaseState::Held,
            ended_ms: None,
            forced: None,
        });
    }

    /// The row of a lease its holder released: the holder knows its run is
    /// done, so the id is free at once, with no lock-delay.
    pub fn released(&self, lease: Lease, version: LeaseVersion) {
        self.record(ended_row(
            Lease {
                lock_delay: Duration::ZERO,
                ..lease
            },
            version,
            now_ms(),
            None,
        ));
    }

    /// The row of a lease ended by force at `at_ms`: its lock-delay runs
    /// from then, and the row carries it to whichever gateway is the id's
    /// authority next, and who forced it to the id's history.
    pub fn forced(&self, lease: Lease, version: LeaseVersion, at_ms: i64, forced: Forced) {
        self.record(ended_row(lease, version, at_ms, Some(forced)));
    }

    /// Where rows must land before their lease is answered (a pool's),
    /// writes what is pending now; elsewhere nothing.
    pub async fn landed(&self) -> Result<(), StoreError> {
        match self.store.rows() {
            LeaseRows::PerId => Ok(()),
            LeaseRows::PerLease => self.flush().await,
        }
    }

    pub fn record(&self, record: LeaseRecord) {
        {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            keep_newest(&mut pending, record);
        }
        self.wake.notify_one();
    }

    /// Writes what is pending now; on failure it stays pending. Rows leave
    /// the pending set only once written, so a flush abandoned midway (its
    /// task stopped at shutdown) loses none of them.
    pub async fn flush(&self) -> Result<(), StoreError> {
        let batch: Vec<LeaseRecord> = {
            let pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            pending.values().cloned().collect()
        };
        if batch.is_empty() {
            return Ok(());
        }
        let written = self.store.write_leases(&batch).await;
        let now = now_ms();
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        for record in &batch {
            let key = key(record);
            // A row about a lease whose time and lock-delay have run out by
            // now says nothing anyone needs: it is not retried.
            let done = written.is_ok() || record.matters_until_ms() <= now;
            if done
                && pending
                    .get(&key)
                    .is_some_and(|p| p.version <= record.version)
            {
                pending.remove(&key);
            }
        }
        written
    }

    /// Flushes whenever rows are pending; runs until dropped.
    pub async fn run(&self) {
        let mut pause = Duration::from_millis(200);
        let mut next_flush = tokio::time::Instant::now();
        loop {
            self.wake.notified().await;
            tokio::time::sleep_until(next_flush.max(tokio::time::Instant::now() + GATHER)).await;
            next_flush = tokio::time::Instant::now() + SPACING;
            while let Err(err) = self.flush().await {
                tracing::warn!(error = %err, retry_in = ?pause, "could not record lease rows yet");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
            }
            pause = Duration::from_millis(200);
        }
    }
}

/// The row of a lease that a release or a force-unlock (`forced`) ended at `at_ms`.
pub(super) fn ended_row(
    lease: Lease,
    version: LeaseVersion,
    at_ms: i64,
    forced: Option<Forced>,
) -> LeaseRecord {
    LeaseRecord {
        lease,
        version: version.released(),
        state: LeaseState::Released,
        ended_ms: Some(at_ms),
        forced,
    }
}

fn key(record: &LeaseRecord) -> (StateId, Uuid) {
    (record.lease.state_id.clone(), record.lease.lease_id)
}

fn keep_newest(pending: &mut HashMap<(StateId, Uuid), LeaseRecord>, record: LeaseRecord) {
    match pending.get(&key(&record)) {
        Some(existing) if existing.version >= record.version => {}
        _ => {
            pending.insert(key(&record), record);
        }
    }
}

/// Gives `candidate`'s claim on `id` up behind the caller (a hand-over to a
/// waiting gateway), once the lease rows queued so far are written: the
/// gateway that claims the id next reads how its leases ended, where a
/// lease whose release is not on record yet would keep its place until it
/// would have expired. Should the rows fail, the claim goes all the same:
/// that errs on the side of waiting.
pub(super) fn withdraw_after_rows(
    recorder: &Arc<Recorder>,
    coordinator: &Arc<Coordinator>,
    id: StateId,
    candidate: Candidate,
) {
    let (recorder, coordinator) = (recorder.clone(), coordinator.clone());
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return coordinator.withdraw_in_background(id, candidate);
    };
    runtime.spawn(async move {
        if let Err(err) = recorder.flush().await {
            tracing::warn!(state_id = %id, error = %err, "lease rows not written before a hand-over");
        }
        coordinator.withdraw_in_background(id, candidate);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::LeaseInfo;

    fn lease(n: u128, token: u64) -> Lease {
        Lease {
            state_id: StateId::parse("id".to_owned()).unwrap(),
            lease_id: Uuid::from_u128(n),
            owner: "worker".to_owned(),
            fencing_token: token,
            gateway_id: Uuid::nil(),
            acquired_ms: 1,
            expires_ms: 2,
            lock_delay: Duration::ZERO,
            info: LeaseInfo::default(),
            limit: 1,
            slots: 1,
        }
    }

    fn held(lease: Lease, version: LeaseVersion) -> LeaseRecord {
        LeaseRecord {
            lease,
            version,
            state: LeaseState::Held,
            ended_ms: None,
            forced: None,
        }
    }

    #[test]
    fn a_lease_keeps_its_newest_row_and_its_end_outlives_the_next_grant() {
        let mut pending = HashMap::new();
        let first = LeaseVersion::granted(1);
        keep_newest(&mut pending, held(lease(1, 1), first.renewed()));
        keep_newest(&mut pending, held(lease(1, 1), first));
        assert_eq!(pending.len(), 1);
        assert_eq!(pending.values().next().unwrap().version, first.renewed());
        let forced = Forced {
            actor: "ops".into(),
            reason: "stuck".into(),
        };
        keep_newest(&mut pending, ended_row(lease(1, 1), first, 5, Some(forced)));
        keep_newest(&mut pending, held(lease(2, 2), LeaseVersion::granted(2)));
        assert_eq!(pending.len(), 2, "the forced end is still written");
        let ended = &pending[&(lease(1, 1).state_id, Uuid::from_u128(1))];
        assert_eq!(ended.state, LeaseState::Released);
        assert_eq!(ended.forced.as_ref().unwrap().actor, "ops");
    }
}
