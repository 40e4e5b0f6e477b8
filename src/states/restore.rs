//! `POST /v1/restore`: a glob put back as it was at an instant, through the
//! one door. The plan compares each id now with the id at the instant (two
//! reads: the current rows, the rows at the instant); the writes go as
//! batches, as a delete by pattern's do: each chunk's writers taken, its ids
//! admitted around leases (one another holds is left, `skipped-locked`),
//! decided against their rows read under the writers, and sent as one
//! INSERT. A dry run reads the leases instead and writes nothing.

use std::collections::HashSet;

use axum::http::HeaderValue;

use super::clear::worth_another_try;
use super::prepare::Change;
use super::restore_plan::{Action, Planned, plan};
use super::{StateError, States};
use crate::domain::{
    Allowed, AsOf, PageCursor, PageLimit, Provenance, Scope, StateId, StatePattern,
};
use crate::retry::retried;
use crate::store::{Selection, StoredRow};

/// The most ids one restore may touch (now or at the instant).
pub const MAX_RESTORE_IDS: usize = 10_000;

/// How many changes go through the door at once: one read of their leases
/// and rows, one ticket per authority, one INSERT.
const CHUNK: usize = 500;

/// What a restore asks.
pub struct RestoreAsk<'a> {
    pub pattern: &'a StatePattern,
    pub scope: &'a Scope,
    pub at: AsOf,
    pub dry_run: bool,
    /// The request's, with the restore's reason.
    pub provenance: &'a Provenance,
    /// The request's credentials, for peers that admit their ids by ticket.
    pub authorization: Option<&'a HeaderValue>,
}

impl States {
    /// The plan of putting `ask.pattern` back as it was at `ask.at`, each id
    /// with what was (or, in a dry run, would be) done; written unless a dry
    /// run. More than [`MAX_RESTORE_IDS`] ids: refused, nothing written.
    pub async fn restore(&self, ask: &RestoreAsk<'_>) -> Result<Vec<Planned>, StateError> {
        let history = self.history_at(ask.at)?;
        let selection = Selection::Matching(ask.pattern.clone(), ask.scope.clone());
        let (then, more) = history
            .rows_at(&selection, ask.at, None, MAX_RESTORE_IDS as u32)
            .await?;
        if more {
            return Err(StateError::TooManyIds(MAX_RESTORE_IDS));
        }
        let now = self.current_rows(ask.pattern, ask.scope).await?;
        let mut planned = plan(now, then);
        if planned.len() > MAX_RESTORE_IDS {
            return Err(StateError::TooManyIds(MAX_RESTORE_IDS));
        }
        if ask.dry_run {
            self.mark_locked(&mut planned).await?;
            return Ok(planned);
        }
        let mut locked = HashSet::new();
        let writes: Vec<&Planned> = planned
            .iter()
            .filter(|p| matches!(p.action, Action::Restore | Action::Delete))
            .collect();
        for chunk in writes.chunks(CHUNK) {
            let left = retried(
                || self.restore_chunk(chunk, ask),
                |outcome| outcome.as_ref().is_err_and(worth_another_try),
            )
            .await?;
            locked.extend(left);
        }
        for change in &mut planned {
            if locked.contains(&change.id) {
                change.action = Action::SkippedLocked;
            }
        }
        Ok(planned)
    }

    /// The current rows of the ids `pattern` matches within `scope`, up to
    /// one more than a restore may touch.
    async fn current_rows(
        &self,
        pattern: &StatePattern,
        scope: &Scope,
    ) -> Result<Vec<StoredRow>, StateError> {
        let limit = PageLimit::parse(Some(1000)).expect("the largest page is valid");
        let (mut rows, mut cursor) = (Vec::new(), None);
        loop {
            let (page, more) = self
                .store
                .list_rows(pattern, scope, cursor.as_ref(), limit)
                .await?;
            cursor = page.last().map(|row| PageCursor::after(row.id.clone()));
            rows.extend(page);
            if !more || rows.len() > MAX_RESTORE_IDS {
                return Ok(rows);
            }
        }
    }

    /// In a dry run, the changes whose id another holds the lease of.
    async fn mark_locked(&self, planned: &mut [Planned]) -> Result<(), StateError> {
        let leased: HashSet<StateId> = self
            .locks
            .all()
            .await?
            .into_iter()
            .map(|lease| lease.state_id)
            .collect();
        for change in planned {
            if change.action != Action::Unchanged && leased.contains(&change.id) {
                change.action = Action::SkippedLocked;
            }
        }
        Ok(())
    }

    /// Writes one chunk of the plan's changes whose lease no one holds;
    /// answers the ids it left for their leases.
    async fn restore_chunk(
        &self,
        chunk: &[&Planned],
        ask: &RestoreAsk<'_>,
    ) -> Result<Vec<StateId>, StateError> {
        let ids: Vec<StateId> = chunk.iter().map(|p| p.id.clone()).collect();
        let writing = self.batch_writers(&ids).await;
        let refs: Vec<&StateId> = ids.iter().collect();
        let admissions = self
            .locks
            .check_writes_around_leases(&refs, ask.authorization)
            .await
            .map_err(|(index, err)| StateError::in_batch(index, ids[index].as_str(), err.into()))?;
        let (mut free, mut locked) = (Vec::new(), Vec::new());
        for (planned, admitted) in chunk.iter().zip(admissions) {
            match admitted {
                Some(admitted) => free.push((
                    planned.id.clone(),
                    Change::RestoreAt(planned.doc.clone(), planned.to_version),
                    admitted,
                )),
                None => locked.push(planned.id.clone()),
            }
        }
        self.write_batch(free, writing, &Allowed::default(), ask.provenance)
            .await?;
        Ok(locked)
    }
}
