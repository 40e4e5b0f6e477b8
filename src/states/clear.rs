//! A delete by pattern, through the same door as every other write: each
//! match is admitted by the lock rule as a DELETE without a lease would be,
//! by its authority wherever that is, and one whose lease another holds is
//! left as it is, and named. So `meltano state clear --all` never erases the
//! bookmark of a run in progress.

use std::collections::HashMap;

use axum::http::HeaderValue;

use super::group_commit::Submission;
use super::prepare::{Change, Policy, prepare};
use super::{States, batch_error, outgoing};
use crate::domain::{Allowed, PageCursor, PageLimit, Provenance, Scope, StateId, StatePattern};
use crate::locks::LockError;
use crate::store::{StoredRow, now_ms};

use super::StateError;

/// How many matches go through the door at once: one read of their leases
/// and rows, one ticket per authority, one DELETE.
const CHUNK: u32 = 500;

/// How many of the ids left for their leases an answer names.
const NAMED_LOCKED: usize = 100;

/// What a delete by pattern did.
#[derive(Debug, Default)]
pub struct Cleared {
    pub deleted: u64,
    /// Matches left because another holds their lease.
    pub skipped_locked: u64,
    /// The first [`NAMED_LOCKED`] of them, in byte order.
    pub locked: Vec<StateId>,
}

/// What one chunk did.
#[derive(Default)]
struct Chunk {
    deleted: u64,
    /// Every match left because another holds its lease, in byte order.
    locked: Vec<StateId>,
}

/// How often a chunk is tried again when a lease was granted on one of its
/// ids between its admission and its sending (its batch then goes unsent),
/// or it shared a batch that another write's check refused (nothing landed).
const ATTEMPTS: usize = 3;

impl States {
    /// Deletes every match of `pattern` within `scope` whose lease no one
    /// holds; peers that are the authority for some admit theirs by ticket,
    /// asked with `authorization`, the request's credentials.
    pub async fn delete_matching(
        &self,
        pattern: &StatePattern,
        scope: &Scope,
        provenance: &Provenance,
        authorization: Option<&HeaderValue>,
    ) -> Result<Cleared, StateError> {
        let mut cleared = Cleared::default();
        let mut cursor = None;
        let limit = PageLimit::parse(Some(CHUNK)).expect("the chunk is a valid page size");
        loop {
            let (page, more) = self
                .store
                .list(pattern, scope, cursor.as_ref(), limit)
                .await?;
            let ids: Vec<StateId> = page.into_iter().map(|summary| summary.id).collect();
            cursor = ids.last().cloned().map(PageCursor::after);
            let mut attempt = 1;
            let chunk = loop {
                match self.delete_chunk(&ids, provenance, authorization).await {
                    Err(err) if attempt < ATTEMPTS && worth_another_try(&err) => attempt += 1,
                    done => break done?,
                }
            };
            cleared.deleted += chunk.deleted;
            cleared.skipped_locked += chunk.locked.len() as u64;
            let room = NAMED_LOCKED - cleared.locked.len().min(NAMED_LOCKED);
            cleared.locked.extend(chunk.locked.into_iter().take(room));
            if !more {
                return Ok(cleared);
            }
        }
    }

    /// Deletes those of `ids` whose lease no one holds; answers how many it
    /// deleted and every id it left.
    async fn delete_chunk(
        &self,
        ids: &[StateId],
        provenance: &Provenance,
        authorization: Option<&HeaderValue>,
    ) -> Result<Chunk, StateError> {
        let mut chunk = Chunk::default();
        if ids.is_empty() {
            return Ok(chunk);
        }
        // Listed in byte order: the order every batch takes its writers in.
        let mut writing = Vec::with_capacity(ids.len());
        for id in ids {
            writing.push(self.writers.lock(id).await);
        }
        let refs: Vec<&StateId> = ids.iter().collect();
        let admissions = self
            .locks
            .check_writes_around_leases(&refs, authorization)
            .await
            .map_err(|(index, err)| StateError::in_batch(index, ids[index].as_str(), err.into()))?;
        let mut free = Vec::with_capacity(ids.len());
        for (id, admitted) in ids.iter().zip(admissions) {
            match admitted {
                Some(admitted) => free.push((id.clone(), admitted)),
                None => chunk.locked.push(id.clone()),
            }
        }
        let free_ids: Vec<StateId> = free.iter().map(|(id, _)| id.clone()).collect();
        let current: HashMap<StateId, StoredRow> = self
            .store
            .get_many(&free_ids)
            .await?
            .into_iter()
            .map(|row| (row.id.clone(), row))
            .collect();
        let allowed = Allowed::default();
        let policy = Policy {
            if_match: None,
            guard: self.guard,
            allowed: &allowed,
            history: self.history.is_some(),
        };
        let now = now_ms();
        let (mut changes, mut admitted, mut deleting) = (Vec::new(), Vec::new(), Vec::new());
        for (id, admission) in free {
            let row = current.get(&id);
            // A delete is never refused; None: gone meanwhile, nothing to do.
            if let Some(prepared) = prepare(&id, row, Change::DeleteByPattern, &policy, None, now)?
            {
                changes.push(outgoing(id.clone(), prepared, &admission, None));
                admitted.push(admission);
                deleting.push(id);
            }
        }
        chunk.deleted = changes.len() as u64;
        if changes.is_empty() {
            return Ok(chunk);
        }
        let submission = Submission {
            changes,
            admitted,
            provenance: provenance.clone(),
            writing,
        };
        self.commits
            .commit(submission)
            .await
            .map_err(|err| batch_error(err, &deleting))?;
        Ok(chunk)
    }
}

/// Whether a chunk went unsent because one of its ids was locked after it
/// was admitted, or landed nothing because its batch was refused for
/// another write's check.
fn worth_another_try(err: &StateError) -> bool {
    let err = match err {
        StateError::InBatch { source, .. } => source.as_ref(),
        other => other,
    };
    matches!(
        err,
        StateError::Lock(LockError::Locked { .. } | LockError::LockedElsewhere(_))
            | StateError::Stale { .. }
    )
}
