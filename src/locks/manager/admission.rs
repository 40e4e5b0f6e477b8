//! The lock handle's side of writes: admitting them by the lock rule (see
//! `locks::write`), here or by a ticket from the id's authority, and the
//! tickets this gateway issues as an authority to writes that came in
//! elsewhere (see `locks::ticket`).

use std::collections::HashMap;
use std::time::Instant;

use axum::http::HeaderValue;
use uuid::Uuid;

use super::LockManager;
use crate::domain::{Lease, StateId};
use crate::locks::error::LockError;
use crate::locks::peer::{Peer, Route, SeenLease};
use crate::locks::ticket::{TicketGrant, request_ticket};
use crate::locks::write::{Admitted, admit_here, lease_rule};
use crate::locks::write_claim::claim_for_writes;

impl LockManager {
    /// Admits a write to `id` carrying `lease_id` (or none) if the lock rule
    /// lets it go ahead now; it is checked again as it goes out
    /// ([`Admitted::sending`]). An unlocked write to an id nobody holds a
    /// claim on that was written here within `--claim-idle` before starts a
    /// claim for its writes (see `write_claim`).
    pub async fn check_write(
        &self,
        id: &StateId,
        lease_id: Option<Uuid>,
        seen: Option<&SeenLease>,
    ) -> Result<Admitted, LockError> {
        if let Some(admitted) = admit_here(&self.slots, id, lease_id, self.query_timeout) {
            return admitted;
        }
        let current = self.coordinator.recorded_lease(id, seen).await?;
        let lease = lease_rule(id, current.as_ref(), lease_id)?;
        if current.is_none() && self.recent_writes.repeat(id, Instant::now()) {
            claim_for_writes(
                id,
                &self.slots,
                &self.coordinator,
                &self.recorder,
                &self.recent_writes,
            );
        }
        Ok(Admitted::recorded(id.clone(), lease, self.query_timeout))
    }

    /// [`LockManager::check_write`] for a batch: against this gateway's own
    /// leases where it is the authority; by a ticket from the authority
    /// where another gateway is (asked once per authority, with
    /// `authorization`, the request's credentials); and against the leases
    /// ClickHouse records, read once, for ids nobody holds a claim on.
    /// Answers each entry's admission, or the first entry refused.
    pub async fn check_writes(
        &self,
        writes: &[(&StateId, Option<Uuid>)],
        authorization: Option<&HeaderValue>,
    ) -> Result<Vec<Admitted>, (usize, LockError)> {
        let admitted = self.admit_batch(writes, authorization, false).await?;
        Ok(admitted
            .into_iter()
            .map(|write| write.expect("every write admitted or refused"))
            .collect())
    }

    /// [`LockManager::check_writes`] for writes that carry no lease and give
    /// way to one (a delete by pattern): an id whose lease another holds is
    /// left out (None) instead of refusing the batch.
    pub async fn check_writes_around_leases(
        &self,
        ids: &[&StateId],
        authorization: Option<&HeaderValue>,
    ) -> Result<Vec<Option<Admitted>>, (usize, LockError)> {
        let writes: Vec<(&StateId, Option<Uuid>)> = ids.iter().map(|id| (*id, None)).collect();
        self.admit_batch(&writes, authorization, true).await
    }

    /// Admits each of `writes`, leaving out (None) those a lease keeps
    /// locked when `around_leases`, else refusing the batch at the first.
    async fn admit_batch(
        &self,
        writes: &[(&StateId, Option<Uuid>)],
        authorization: Option<&HeaderValue>,
        around_leases: bool,
    ) -> Result<Vec<Option<Admitted>>, (usize, LockError)> {
        let locked = |err: &LockError| {
            around_leases
                && matches!(
                    err,
                    LockError::Locked { .. } | LockError::LockedElsewhere(_)
                )
        };
        let recorded: HashMap<String, Lease> = self
            .coordinator
            .recorded_leases()
            .await
            .map_err(|err| (0, err.into()))?
            .into_iter()
            .map(|lease| (lease.state_id.as_str().to_owned(), lease))
            .collect();
        // With no other gateway holding any claim, none is an authority.
        let peers_hold_claims = !self
            .coordinator
            .claim_holders()
            .await
            .map_err(|err| (0, err.into()))?
            .is_empty();
        let mut admitted: Vec<Option<Admitted>> = writes.iter().map(|_| None).collect();
        let mut by_authority: HashMap<Uuid, (Peer, Vec<usize>)> = HashMap::new();
        for (index, (id, lease_id)) in writes.iter().enumerate() {
            if let Some(here) = admit_here(&self.slots, id, *lease_id, self.query_timeout) {
                match here {
                    Ok(write) => admitted[index] = Some(write),
                    Err(err) if locked(&err) => {}
                    Err(err) => return Err((index, err)),
                }
                continue;
            }
            if peers_hold_claims
                && let Route::Peer(peer) =
                    self.route(id, true, false).await.map_err(|e| (index, e))?
            {
                by_authority
                    .entry(peer.gateway_id)
                    .or_insert_with(|| (peer, Vec::new()))
                    .1
                    .push(index);
                continue;
            }
            match lease_rule(id, recorded.get(id.as_str()), *lease_id) {
                Ok(lease) => {
                    admitted[index] =
                        Some(Admitted::recorded((*id).clone(), lease, self.query_timeout));
                }
                Err(err) if locked(&err) => {}
                Err(err) => return Err((index, err)),
            }
        }
        for (peer, mut indexes) in by_authority.into_values() {
            // The authority refuses a ticket whole, naming the first write
            // it refused: one left out is asked for again without it.
            while !indexes.is_empty() {
                let theirs: Vec<(&StateId, Option<Uuid>)> =
                    indexes.iter().map(|&i| writes[i]).collect();
                match request_ticket(&self.router, &peer, &theirs, authorization).await {
                    Ok((ticket, leases)) => {
                        for (&index, lease) in indexes.iter().zip(leases) {
                            admitted[index] = Some(Admitted::remote(
                                writes[index].0.clone(),
                                lease,
                                ticket.clone(),
                                self.query_timeout,
                            ));
                        }
                        break;
                    }
                    Err((n, err)) if locked(&err) => {
                        indexes.remove(n);
                    }
                    Err((n, err)) => return Err((indexes[n], err)),
                }
            }
        }
        Ok(admitted)
    }

    /// As the authority of every id of `writes`: admits them by the lock
    /// rule and registers them as sending, under a new ticket (see
    /// `ticket`). Answers the index of the first write refused.
    pub fn issue_ticket(
        &self,
        writes: &[(StateId, Option<Uuid>)],
    ) -> Result<TicketGrant, (usize, LockError)> {
        let mut admitted = Vec::with_capacity(writes.len());
        for (index, (id, lease_id)) in writes.iter().enumerate() {
            match admit_here(&self.slots, id, *lease_id, self.query_timeout) {
                Some(Ok(write)) => admitted.push(write),
                Some(Err(err)) => return Err((index, err)),
                None => return Err((index, LockError::NotAuthority(id.clone()))),
            }
        }
        let ids = writes.iter().map(|(id, _)| id.clone()).collect();
        self.issued.issue(ids, &admitted)
    }

    /// Settles a ticket this gateway issued: `known` when its writes landed
    /// or failed. `before_release` sees its ids before they are free (what
    /// the gateway remembers of them is stale). False for an unknown ticket.
    pub fn settle_ticket(
        &self,
        ticket: Uuid,
        known: bool,
        before_release: impl FnOnce(&[StateId]),
    ) -> bool {
        self.issued.settle(ticket, known, before_release)
    }
}
