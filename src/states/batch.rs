//! The skeleton every batch write follows, a bulk import as a chunk of a
//! delete by pattern: its ids' writers taken in byte order, its admission
//! (each its own), one read of the admitted ids' stored rows, each change
//! decided against its row under one policy, and one submission through
//! the door.

use std::collections::HashMap;

use tokio::sync::OwnedMutexGuard;

use super::group_commit::Submission;
use super::prepare::{Change, prepare};
use super::{StateError, States, batch_error, outgoing};
use crate::domain::{Allowed, Provenance, StateId};
use crate::locks::Admitted;
use crate::store::{StoredRow, now_ms};

/// What a batch sent.
#[derive(Default)]
pub(super) struct Batched {
    /// How many changes went out.
    pub sent: usize,
    /// How many of them created their state.
    pub created: usize,
}

impl States {
    /// Takes the writers of `ids` in byte order, the order every batch
    /// takes them in, so that two batches never wait on each other.
    pub(super) async fn batch_writers(&self, ids: &[StateId]) -> Vec<OwnedMutexGuard<()>> {
        let mut sorted: Vec<&StateId> = ids.iter().collect();
        sorted.sort();
        let mut writing = Vec::with_capacity(sorted.len());
        for id in sorted {
            writing.push(self.writers.lock(id).await);
        }
        writing
    }

    /// Decides each admitted change against its id's stored row and sends
    /// them all as one submission, holding `writing`, the batch's writers
    /// (see [`States::batch_writers`]). A change with nothing to write (a
    /// delete of a state gone meanwhile) is left out. An entry refused is
    /// named by its index in `changes`. Its rows are not checked in the
    /// INSERT: they were read for the batch, under its writers.
    pub(super) async fn write_batch(
        &self,
        changes: Vec<(StateId, Change, Admitted)>,
        writing: Vec<OwnedMutexGuard<()>>,
        allowed: &Allowed,
        provenance: &Provenance,
    ) -> Result<Batched, StateError> {
        let ids: Vec<StateId> = changes.iter().map(|(id, _, _)| id.clone()).collect();
        let current: HashMap<StateId, StoredRow> = self
            .store
            .get_many(&ids)
            .await?
            .into_iter()
            .map(|row| (row.id.clone(), row))
            .collect();
        let policy = self.policy(None, allowed);
        let now = now_ms();
        let (mut outgoing_changes, mut admitted, mut sent_ids) =
            (Vec::new(), Vec::new(), Vec::new());
        for (index, (id, change, admission)) in changes.into_iter().enumerate() {
            let decided = prepare(
                &id,
                current.get(&id),
                change,
                &policy,
                self.memory.failed_version(&id),
                now,
            );
            let Some(prepared) = self
                .guarded(&id, decided)
                .map_err(|err| StateError::in_batch(index, id.as_str(), err))?
            else {
                continue;
            };
            outgoing_changes.push(outgoing(id.clone(), prepared, &admission, None));
            admitted.push(admission);
            sent_ids.push(id);
        }
        if outgoing_changes.is_empty() {
            return Ok(Batched::default());
        }
        let created = outgoing_changes
            .iter()
            .filter(|c| c.prepared.created)
            .count();
        let submission = Submission {
            changes: outgoing_changes,
            admitted,
            provenance: provenance.clone(),
            writing,
        };
        let sent = self
            .commits
            .commit(submission)
            .await
            .map_err(|err| batch_error(err, &sent_ids))?
            .len();
        Ok(Batched { sent, created })
    }
}
