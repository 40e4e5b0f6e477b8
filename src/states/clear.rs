//! A delete by pattern, through the same door as every other write: each
//! match is admitted by the lock rule as a DELETE without a lease would be,
//! by its authority wherever that is, and one whose lease another holds is
//! left as it is, and named. So `meltano state clear --all` never erases the
//! bookmark of a run in progress.

use axum::http::HeaderValue;

use super::prepare::Change;
use super::{StateError, States};
use crate::domain::{Allowed, PageCursor, PageLimit, Provenance, Scope, StateId, StatePattern};
use crate::locks::LockError;
use crate::retry::retried;

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
            let chunk = retried(
                || self.delete_chunk(&ids, provenance, authorization),
                |outcome| outcome.as_ref().is_err_and(worth_another_try),
            )
            .await?;
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
        let writing = self.batch_writers(ids).await;
        let refs: Vec<&StateId> = ids.iter().collect();
        let admissions = self
            .locks
            .check_writes_around_leases(&refs, authorization)
            .await
            .map_err(|(index, err)| StateError::in_batch(index, ids[index].as_str(), err.into()))?;
        let mut free = Vec::with_capacity(ids.len());
        for (id, admitted) in ids.iter().zip(admissions) {
            match admitted {
                Some(admitted) => free.push((id.clone(), Change::DeleteByPattern, admitted)),
                None => chunk.locked.push(id.clone()),
            }
        }
        let batched = self
            .write_batch(free, writing, &Allowed::default(), provenance)
            .await?;
        chunk.deleted = batched.sent as u64;
        Ok(chunk)
    }
}

/// Whether a chunk went unsent because one of its ids was locked after it
/// was admitted, or landed nothing because its batch was refused for
/// another write's check.
pub(super) fn worth_another_try(err: &StateError) -> bool {
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
