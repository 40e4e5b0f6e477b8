//! Writes under the lock rule, from admission to landing. A write is checked
//! against the id's lease when it is admitted, and again when it goes out to
//! ClickHouse; in between it reads and merges, and a lease may end. The
//! second check closes that gap: a write whose lease ended before it went out
//! is refused (409), never sent. One that went out in time may land after
//! its lease's end, so on the authority the lease's end does not free the id
//! until such writes are done: the next holder reads them.
//!
//! A sent write is done when ClickHouse answers, or at its time budget: the
//! query timeout, and never past the claim's validity (another gateway may
//! take the id over once the claim can have lapsed). The same budget makes
//! ClickHouse stop work that the gateway gave up on (`max_execution_time`).
//! A write whose future is dropped mid-flight (its client hung up) counts as
//! in flight until its budget runs out: it may still land.

use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::LockError;
use super::slot::Slot;
use crate::domain::{Lease, StateId};
use crate::store::{StoreError, now_ms};

/// A write that passed the lock rule; [`Admitted::sending`] checks it again
/// as it goes out.
pub struct Admitted {
    state_id: StateId,
    /// The lease it carries, when the id is locked.
    lease: Option<Lease>,
    /// Where its lease lives, when this gateway is the id's authority.
    local: Option<LocalAuthority>,
    query_timeout: Duration,
}

struct LocalAuthority {
    slot: Arc<Slot>,
    claim_id: Uuid,
}

impl Admitted {
    pub(super) fn local(
        state_id: StateId,
        lease: Option<Lease>,
        slot: Arc<Slot>,
        claim_id: Uuid,
        query_timeout: Duration,
    ) -> Self {
        Self {
            state_id,
            lease,
            local: Some(LocalAuthority { slot, claim_id }),
            query_timeout,
        }
    }

    /// Admitted by what ClickHouse records: no gateway holds the id's claim.
    pub(super) fn recorded(
        state_id: StateId,
        lease: Option<Lease>,
        query_timeout: Duration,
    ) -> Self {
        Self {
            state_id,
            lease,
            local: None,
            query_timeout,
        }
    }

    /// The lease the write carries, when the id is locked.
    pub fn lease(&self) -> Option<&Lease> {
        self.lease.as_ref()
    }

    /// The claim under which this gateway is the id's authority, if it is.
    pub fn claim(&self) -> Option<Uuid> {
        self.local.as_ref().map(|l| l.claim_id)
    }

    /// Checks the write once more as it goes out, and answers the permit to
    /// send it: refused when its lease ended meanwhile.
    pub fn sending(&self) -> Result<Sending, LockError> {
        Sending::all(std::slice::from_ref(self)).map_err(|(_, err)| err)
    }

    /// What refuses this write now, if anything, and how long it may take.
    fn budget(&self, now: Instant) -> Result<Duration, LockError> {
        let not_current = || match &self.lease {
            Some(lease) => LockError::NotCurrent(lease.lease_id),
            None => LockError::Moving(self.state_id.clone()),
        };
        let Some(local) = &self.local else {
            // Its lease, if any, ends at its recorded expiry; the write must
            // be done by then.
            return match &self.lease {
                Some(lease) => {
                    let left = u64::try_from(lease.expires_ms - now_ms()).unwrap_or(0);
                    if left == 0 {
                        return Err(not_current());
                    }
                    Ok(self.query_timeout.min(Duration::from_millis(left)))
                }
                None => Ok(self.query_timeout),
            };
        };
        let st = local.slot.lock();
        let claim = st
            .claim
            .as_ref()
            .filter(|c| c.candidate.claim_id == local.claim_id && now < c.valid_until);
        // A lease past its deadline has ended, whether or not anyone has
        // looked since (`SlotState::expire`).
        let current = st
            .lease
            .as_ref()
            .filter(|l| now < l.deadline)
            .map(|l| &l.lease);
        match (claim, current, &self.lease) {
            (Some(claim), None, None) => Ok(self.query_timeout.min(claim.valid_until - now)),
            (Some(claim), Some(current), Some(mine)) if current.lease_id == mine.lease_id => {
                Ok(self.query_timeout.min(claim.valid_until - now))
            }
            (Some(_), Some(holder), None) => Err(LockError::Locked {
                state_id: self.state_id.clone(),
                holder: Box::new(holder.clone()),
            }),
            _ => Err(not_current()),
        }
    }
}

/// Permission to send writes: while it lasts (and, if dropped before
/// [`Sending::run`] finished, until its budget is spent), no lease is granted
/// on their ids here and their claims stay.
pub struct Sending {
    entries: Vec<(Arc<Slot>, u64)>,
    budget: Duration,
    /// When the budget is spent: every entry's end.
    until: Instant,
    /// The write ran to its end (answered, failed or timed out).
    done: bool,
}

impl Sending {
    /// Checks every write of a batch as it goes out: all are sent together,
    /// or none. Answers the index of the first one refused.
    pub fn all(writes: &[Admitted]) -> Result<Self, (usize, LockError)> {
        let now = Instant::now();
        let mut budget = writes.first().map_or(Duration::ZERO, |w| w.query_timeout);
        for (index, write) in writes.iter().enumerate() {
            budget = budget.min(write.budget(now).map_err(|err| (index, err))?);
        }
        // Checked and registered one slot at a time: a slot whose lease ends
        // between the check above and its registration is caught below.
        let mut sending = Self {
            entries: Vec::with_capacity(writes.len()),
            budget,
            until: now + budget,
            done: true,
        };
        for (index, write) in writes.iter().enumerate() {
            let Some(local) = &write.local else { continue };
            let mut st = local.slot.lock();
            let number = st.next_send;
            st.next_send += 1;
            st.sending.insert(number, sending.until);
            drop(st);
            sending.entries.push((local.slot.clone(), number));
            if let Err(err) = write.budget(now) {
                return Err((index, err));
            }
        }
        sending.done = false;
        Ok(sending)
    }

    /// Several writes' permits as one, for writes that go out in one INSERT
    /// (group commit): the earliest budget bounds them all.
    pub fn join(permits: Vec<Sending>) -> Sending {
        let mut joined = Sending {
            entries: Vec::new(),
            budget: Duration::ZERO,
            until: Instant::now(),
            done: false,
        };
        for (n, mut permit) in permits.into_iter().enumerate() {
            if n == 0 || permit.until < joined.until {
                joined.until = permit.until;
                joined.budget = permit.budget;
            }
            joined.entries.append(&mut permit.entries);
        }
        joined
    }

    /// When this permit's budget is spent.
    pub fn until(&self) -> Instant {
        self.until
    }

    /// Sends: runs `write` (ClickHouse round trips) within the budget.
    pub async fn run<T>(
        mut self,
        write: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let result = match tokio::time::timeout_at(self.until.into(), write).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(self.budget)),
        };
        self.done = true;
        result
    }
}

impl Drop for Sending {
    fn drop(&mut self) {
        if !self.done {
            // Abandoned mid-flight: the write may still land, so its entry
            // stays until its budget is spent (`SlotState::expire`).
            return;
        }
        for (slot, number) in &self.entries {
            slot.lock().sending.remove(number);
            slot.changed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::LeaseVersion;
    use crate::locks::slot::{HeldClaim, LocalLease};
    use crate::store::Candidate;

    const TIMEOUT: Duration = Duration::from_secs(5);
    const CLAIM: Uuid = Uuid::from_u128(1);

    fn id() -> StateId {
        StateId::parse("dev:tap-to-target".to_owned()).unwrap()
    }

    fn lease(n: u128) -> Lease {
        Lease {
            state_id: id(),
            lease_id: Uuid::from_u128(n),
            owner: "worker".to_owned(),
            fencing_token: 1,
            gateway_id: Uuid::nil(),
            acquired_ms: now_ms(),
            expires_ms: now_ms() + 30_000,
        }
    }

    /// A slot whose claim holds `lease` as current.
    fn slot_holding(lease: &Lease) -> Arc<Slot> {
        let slot = Arc::new(Slot::default());
        {
            let mut st = slot.lock();
            st.claim = Some(HeldClaim {
                candidate: Candidate {
                    claim_id: CLAIM,
                    gateway_id: Uuid::nil(),
                    created_ms: 0,
                    advertise_url: String::new(),
                    expires_ms: 0,
                },
                valid_until: Instant::now() + Duration::from_secs(9),
                handover: false,
            });
            st.lease = Some(LocalLease {
                lease: lease.clone(),
                version: LeaseVersion::granted(1),
                deadline: Instant::now() + Duration::from_secs(30),
            });
        }
        slot
    }

    fn admitted(slot: &Arc<Slot>, lease: &Lease) -> Admitted {
        Admitted::local(id(), Some(lease.clone()), slot.clone(), CLAIM, TIMEOUT)
    }

    #[test]
    fn a_write_whose_lease_ended_before_it_went_out_is_refused() {
        let mine = lease(1);
        let slot = slot_holding(&mine);
        let write = admitted(&slot, &mine);
        slot.lock().lease = None;
        assert!(matches!(write.sending(), Err(LockError::NotCurrent(id)) if id == mine.lease_id));
        assert!(slot.lock().sending.is_empty(), "nothing left behind");
    }

    #[test]
    fn an_unleased_write_is_refused_once_a_lease_is_granted_and_once_the_claim_moved() {
        let holder = lease(2);
        let slot = slot_holding(&holder);
        slot.lock().lease = None;
        let write = Admitted::local(id(), None, slot.clone(), CLAIM, TIMEOUT);
        assert!(write.sending().is_ok());
        slot.lock().lease = slot_holding(&holder).lock().lease.take();
        assert!(matches!(write.sending(), Err(LockError::Locked { .. })));
        slot.lock().claim = None;
        slot.lock().lease = None;
        assert!(matches!(write.sending(), Err(LockError::Moving(_))));
    }

    #[test]
    fn a_batch_goes_out_whole_or_not_at_all() {
        let (a, b) = (lease(1), lease(2));
        let (slot_a, slot_b) = (slot_holding(&a), slot_holding(&b));
        let writes = [admitted(&slot_a, &a), admitted(&slot_b, &b)];
        slot_b.lock().lease = None;
        assert_eq!(Sending::all(&writes).err().map(|(index, _)| index), Some(1));
        assert!(slot_a.lock().sending.is_empty());
        assert!(slot_b.lock().sending.is_empty());
    }

    #[tokio::test]
    async fn a_write_that_answered_frees_the_id_at_once() {
        let mine = lease(1);
        let slot = slot_holding(&mine);
        let sending = admitted(&slot, &mine).sending().unwrap();
        assert_eq!(slot.lock().sending.len(), 1);
        let failed: Result<(), StoreError> = sending
            .run(async { Err(StoreError::Timeout(Duration::ZERO)) })
            .await;
        assert!(failed.is_err());
        assert!(
            slot.lock().sending.is_empty(),
            "a failed write has ended too"
        );
    }

    #[tokio::test]
    async fn a_write_dropped_in_flight_may_still_land_until_its_budget_is_spent() {
        let mine = lease(1);
        let slot = slot_holding(&mine);
        let sending = admitted(&slot, &mine).sending().unwrap();
        let in_flight = sending.run(std::future::pending::<Result<(), StoreError>>());
        // The client hangs up: the future is dropped mid-flight.
        assert!(
            tokio::time::timeout(Duration::from_millis(10), in_flight)
                .await
                .is_err()
        );
        let until = slot.lock().landing_until().expect("still landing");
        assert!(until > Instant::now() + TIMEOUT - Duration::from_secs(1));
    }

    #[test]
    fn a_write_must_be_done_within_the_claim_validity() {
        let mine = lease(1);
        let slot = slot_holding(&mine);
        slot.lock().claim.as_mut().unwrap().valid_until = Instant::now() + Duration::from_secs(1);
        let sending = admitted(&slot, &mine).sending().unwrap();
        assert!(sending.budget <= Duration::from_secs(1));
    }

    #[test]
    fn a_recorded_lease_bounds_the_write_by_its_expiry() {
        let mut mine = lease(1);
        mine.expires_ms = now_ms() + 1_000;
        let write = Admitted::recorded(id(), Some(mine.clone()), TIMEOUT);
        assert!(write.sending().unwrap().budget <= Duration::from_secs(1));
        mine.expires_ms = now_ms() - 1;
        let write = Admitted::recorded(id(), Some(mine), TIMEOUT);
        assert!(matches!(write.sending(), Err(LockError::NotCurrent(_))));
    }
}
