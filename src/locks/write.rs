//! Writes under the lock rule, from admission to landing. A write is checked
//! against the id's lease when it is admitted, and again when its batch goes
//! out to ClickHouse (`states::group_commit`); in between it reads, merges
//! and waits in the queue, and a lease may end. The second check closes that
//! gap: a write whose lease ended before it went out is refused (409), never
//! sent. One that went out in time may land after its lease's end, so on the
//! authority the lease's end does not free the id until such writes are done:
//! the next holder reads them.
//!
//! A sent write's budget starts when it goes out: the query timeout, and
//! never past the claim's validity (another gateway may take the id over once
//! the claim can have lapsed) or a recorded lease's expiry. A write that
//! ClickHouse answered, or refused, is done. One whose outcome is unknown (it
//! timed out, or its future was dropped mid-flight) may still land: ClickHouse
//! works on a query it has received for up to its `max_execution_time`, the
//! query timeout. So it keeps the id from the next grant until its budget and
//! that much more have passed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::error::LockError;
use super::slot::{Slot, Standing};
use super::slots::Slots;
use super::ticket::RemoteTicket;
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
    /// The authority's ticket, when another gateway is the id's authority.
    remote: Option<Arc<RemoteTicket>>,
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
            remote: None,
            query_timeout,
        }
    }

    /// Admitted by another gateway, the id's authority, under its ticket.
    pub(super) fn remote(
        state_id: StateId,
        lease: Option<Lease>,
        ticket: Arc<RemoteTicket>,
        query_timeout: Duration,
    ) -> Self {
        Self {
            state_id,
            lease,
            local: None,
            remote: Some(ticket),
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
            remote: None,
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
        if let Some(ticket) = &self.remote {
            // The authority admitted it for the ticket's budget.
            return match ticket.until().checked_duration_since(now) {
                Some(left) if !left.is_zero() => Ok(self.query_timeout.min(left)),
                _ => Err(LockError::Moving(self.state_id.clone())),
            };
        }
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
        let mine = self.lease.as_ref().map(|l| l.lease_id);
        let standing = local.slot.read(|st| st.standing(local.claim_id, mine, now));
        match standing {
            Standing::Until(valid_until) => Ok(self.query_timeout.min(valid_until - now)),
            Standing::Locked(holder) => Err(LockError::Locked {
                state_id: self.state_id.clone(),
                holder: Box::new(holder),
            }),
            Standing::Gone => Err(not_current()),
            Standing::Lapsed => Err(LockError::Lapsed(self.state_id.clone())),
        }
    }
}

/// Permission to send writes: while it lasts (and, if dropped before
/// [`Sending::run`] finished, until its budget is spent), no lease is granted
/// on their ids here and their claims stay. It outlives the send: its holder
/// drops it once it has settled what it knows of the ids, since the next
/// holder, granted the moment it goes, may read them at once.
pub struct Sending {
    entries: Vec<(Arc<Slot>, u64)>,
    /// Other authorities' tickets for the writes they admitted.
    tickets: Vec<Arc<RemoteTicket>>,
    budget: Duration,
    /// When the budget is spent: every entry's end.
    until: Instant,
    /// How long past `until` a write whose outcome is unknown may still land
    /// (ClickHouse's `max_execution_time`, the query timeout).
    landing: Duration,
    /// ClickHouse answered: the write landed or failed, and frees its ids.
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
        let landing = writes
            .iter()
            .map(|w| w.query_timeout)
            .max()
            .unwrap_or(Duration::ZERO);
        let mut sending = Self {
            entries: Vec::with_capacity(writes.len()),
            tickets: writes.iter().filter_map(|w| w.remote.clone()).collect(),
            budget,
            until: now + budget,
            landing,
            done: true,
        };
        for (index, write) in writes.iter().enumerate() {
            let Some(local) = &write.local else { continue };
            let number = local.slot.apply(|st, now| st.send(now, sending.until));
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
            tickets: Vec::new(),
            budget: Duration::ZERO,
            until: Instant::now(),
            landing: Duration::ZERO,
            done: false,
        };
        for (n, mut permit) in permits.into_iter().enumerate() {
            if n == 0 || permit.until < joined.until {
                joined.until = permit.until;
                joined.budget = permit.budget;
            }
            joined.landing = joined.landing.max(permit.landing);
            joined.entries.append(&mut permit.entries);
            joined.tickets.append(&mut permit.tickets);
        }
        joined
    }

    /// How long the writes may take from when the permit was given.
    pub fn budget(&self) -> Duration {
        self.budget
    }

    /// When the budget is spent.
    pub fn until(&self) -> Instant {
        self.until
    }

    /// Ends a permit whose writes were sent elsewhere (a ticket): `known`
    /// when they landed or failed, else their outcome is unknown.
    pub fn settle(mut self, known: bool) {
        self.done = known;
    }

    /// Sends: runs `write` (ClickHouse round trips) within the budget. The
    /// ids stay held until the permit is dropped, whatever the outcome: the
    /// caller updates what it remembers of them first. A write that timed
    /// out, here or in the store, or whose connection was cut, leaves its
    /// outcome unknown (see `Drop`).
    pub async fn run<T>(
        &mut self,
        write: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout_at(self.until.into(), write).await {
            // Landed, but seen past the budget (a busy thread polls the
            // timer after the write): the slot may have let the ids go at
            // `until`, and a next holder read them before this landed. Not
            // acknowledged: its outcome is as unknown as a timeout's.
            Ok(Ok(_)) if Instant::now() >= self.until => Err(StoreError::Timeout(self.budget)),
            Ok(result) => {
                // Landed, or refused by ClickHouse: the outcome is known.
                self.done = result
                    .as_ref()
                    .map_or_else(StoreError::surely_not_applied, |_| true);
                result
            }
            Err(_) => Err(StoreError::Timeout(self.budget)),
        }
    }
}

impl Drop for Sending {
    fn drop(&mut self) {
        if self.done {
            for (slot, number) in &self.entries {
                slot.apply(|st, _| st.send_done(*number));
            }
            return;
        }
        // Timed out or abandoned mid-flight: ClickHouse may have the write
        // and still apply it, so its ids stay ungrantable until it can no
        // longer land (`SlotState::expire` drops the entries then).
        let unknown_until = self.until + self.landing;
        for ticket in &self.tickets {
            ticket.mark_unknown();
        }
        for (slot, number) in &self.entries {
            slot.apply(|st, _| st.send_unknown(*number, unknown_until));
        }
    }
}

/// The lock rule applied by this gateway as `id`'s authority; None when it
/// is not the authority.
pub(super) fn admit_here(
    slots: &Slots,
    id: &StateId,
    lease_id: Option<Uuid>,
    query_timeout: Duration,
) -> Option<Result<Admitted, LockError>> {
    let slot = slots.existing(id)?;
    let (claim_id, current) = match slot.current(id, slots.metrics(), |st| {
        st.claim_id()
            .map(|claim| (claim, st.lease().cloned()))
            .ok_or(st.answers_for())
    }) {
        Ok(claimed) => claimed,
        // Leases kept under a lapsed claim: nothing is written until it is re-won.
        Err(true) => return Some(Err(LockError::Lapsed(id.clone()))),
        Err(false) => return None,
    };
    Some(
        lease_rule(id, current.as_ref(), lease_id)
            .map(|lease| Admitted::local(id.clone(), lease, slot, claim_id, query_timeout)),
    )
}

/// The lock rule of a write: while `id` is locked it needs the holder's
/// lease, and a lease it carries must be the current one.
pub(super) fn lease_rule(
    id: &StateId,
    current: Option<&Lease>,
    lease_id: Option<Uuid>,
) -> Result<Option<Lease>, LockError> {
    match (current, lease_id) {
        (None, None) => Ok(None),
        (Some(lease), Some(given)) if lease.lease_id == given => Ok(Some(lease.clone())),
        (Some(holder), None) => Err(LockError::Locked {
            state_id: id.clone(),
            holder: Box::new(holder.clone()),
        }),
        (_, Some(given)) => Err(LockError::NotCurrent(given)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{LeaseInfo, LeaseVersion};
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
            lock_delay: Duration::ZERO,
            info: LeaseInfo::default(),
            limit: 1,
            slots: 1,
        }
    }

    /// A slot whose claim holds `lease` as current.
    fn slot_holding(lease: &Lease) -> Arc<Slot> {
        let slot = Arc::new(Slot::default());
        {
            let mut st = slot.lock();
            *st.claim_for_tests() = Some(HeldClaim {
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
            *st.leases_for_tests() = vec![LocalLease {
                lease: lease.clone(),
                version: LeaseVersion::granted(1),
                deadline: Instant::now() + Duration::from_secs(30),
            }];
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
        slot.lock().leases_for_tests().clear();
        assert!(matches!(write.sending(), Err(LockError::NotCurrent(id)) if id == mine.lease_id));
        assert!(slot.lock().sending_for_tests() == 0, "nothing left behind");
    }

    #[test]
    fn an_unleased_write_is_refused_once_a_lease_is_granted_and_once_the_claim_moved() {
        let holder = lease(2);
        let slot = slot_holding(&holder);
        slot.lock().leases_for_tests().clear();
        let write = Admitted::local(id(), None, slot.clone(), CLAIM, TIMEOUT);
        assert!(write.sending().is_ok());
        *slot.lock().leases_for_tests() =
            std::mem::take(slot_holding(&holder).lock().leases_for_tests());
        assert!(matches!(write.sending(), Err(LockError::Locked { .. })));
        *slot.lock().claim_for_tests() = None;
        slot.lock().leases_for_tests().clear();
        assert!(matches!(write.sending(), Err(LockError::Moving(_))));
    }

    #[test]
    fn a_batch_goes_out_whole_or_not_at_all() {
        let (a, b) = (lease(1), lease(2));
        let (slot_a, slot_b) = (slot_holding(&a), slot_holding(&b));
        let writes = [admitted(&slot_a, &a), admitted(&slot_b, &b)];
        slot_b.lock().leases_for_tests().clear();
        assert_eq!(Sending::all(&writes).err().map(|(index, _)| index), Some(1));
        assert!(slot_a.lock().sending_for_tests() == 0);
        assert!(slot_b.lock().sending_for_tests() == 0);
    }

    #[tokio::test]
    async fn a_write_clickhouse_refused_frees_the_id_at_once() {
        let mine = lease(1);
        let slot = slot_holding(&mine);
        let mut sending = admitted(&slot, &mine).sending().unwrap();
        assert_eq!(slot.lock().sending_for_tests(), 1);
        let refused: Result<(), StoreError> = sending
            .run(async {
                Err(StoreError::ClickHouse(
                    clickhouse::error::Error::BadResponse("Code: 60. DB::Exception".into()),
                ))
            })
            .await;
        assert!(refused.is_err());
        drop(sending);
        assert!(
            slot.lock().sending_for_tests() == 0,
            "a refused write has ended"
        );
    }

    #[tokio::test]
    async fn a_landed_write_keeps_its_id_from_the_next_grant_until_its_sender_lets_go() {
        let mine = lease(1);
        let slot = slot_holding(&mine);
        {
            let mut sending = admitted(&slot, &mine).sending().unwrap();
            let landed: Result<(), StoreError> = sending.run(async { Ok(()) }).await;
            assert!(landed.is_ok());
            // The sender brings what it remembers of the id up to date now:
            // a holder granted meanwhile could read the state from before.
            assert_eq!(
                slot.lock().sending_for_tests(),
                1,
                "the id is free before its sender has settled the write"
            );
        }
        assert!(
            slot.lock().sending_for_tests() == 0,
            "a settled write holds nothing back"
        );
    }

    #[tokio::test]
    async fn a_write_that_lands_past_its_budget_is_not_acknowledged() {
        let mine = lease(1);
        let slot = slot_holding(&mine);
        let short = Duration::from_millis(20);
        let admitted = Admitted::local(id(), Some(mine.clone()), slot.clone(), CLAIM, short);
        let mut sending = admitted.sending().unwrap();
        // The write is done only after the budget: the slot may have let the
        // id go meanwhile, so a success would not be one the next holder reads.
        let late: Result<(), StoreError> = sending
            .run(async {
                std::thread::sleep(short * 3);
                Ok(())
            })
            .await;
        assert!(matches!(late, Err(StoreError::Timeout(_))), "{late:?}");
    }

    #[tokio::test]
    async fn a_write_that_timed_out_in_the_store_may_still_land_past_its_budget() {
        let mine = lease(1);
        let slot = slot_holding(&mine);
        let mut sending = admitted(&slot, &mine).sending().unwrap();
        let timed_out: Result<(), StoreError> = sending
            .run(async { Err(StoreError::Timeout(TIMEOUT)) })
            .await;
        assert!(timed_out.is_err());
        drop(sending);
        let until = slot.lock().landing_until().expect("its outcome is unknown");
        assert!(
            until > Instant::now() + TIMEOUT + TIMEOUT / 2,
            "held for its budget and ClickHouse's max_execution_time"
        );
    }

    #[tokio::test]
    async fn a_write_dropped_in_flight_may_still_land_until_its_budget_is_spent() {
        let mine = lease(1);
        let slot = slot_holding(&mine);
        let mut sending = admitted(&slot, &mine).sending().unwrap();
        let in_flight = async move {
            sending
                .run(std::future::pending::<Result<(), StoreError>>())
                .await
        };
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
        slot.lock().claim_for_tests().as_mut().unwrap().valid_until =
            Instant::now() + Duration::from_secs(1);
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
