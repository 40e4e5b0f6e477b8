//! Claims taken for unlocked writes. A write to an id no gateway holds a
//! claim on costs its routing read and its INSERT; once this gateway is the
//! id's authority, its peers forward the id's writes here and each is
//! admitted from memory, for one statement, its INSERT (see
//! docs/gateways.md "Unlocked writes"). So an id written again through
//! this gateway within `--claim-idle` is claimed in the background, as an
//! acquire claims it but with no lease, and the claim is kept until
//! `--claim-idle` after its last write, as after a lease.
//!
//! A one-off write pays nothing for it: only a repeat starts the attempt,
//! and writes go on by the routing read while it settles. The attempt is an
//! acquire's (`Coordinator::try_claim`), marked under way in the slot
//! (`SlotState::start_claim_for_writes`) and cleared however it ends, so an
//! acquire arriving meanwhile waits for it and is then granted under it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::claim::{ClaimOutcome, Coordinator};
use super::record::Recorder;
use super::slot::{ClaimAttempt, Slot};
use super::slots::Slots;
use crate::domain::StateId;
use crate::metrics::LockEvent;

/// The ids written here lately with no claim anywhere, and when.
pub(super) struct RecentWrites {
    /// How far back a write makes the next one a repeat: `--claim-idle`.
    window: Duration,
    last: Mutex<Recent>,
}

#[derive(Default)]
struct Recent {
    by_id: HashMap<StateId, Written>,
    /// Size after the last sweep of entries that decide nothing any more;
    /// the next sweep runs when the map doubles.
    swept_at: usize,
}

#[derive(Clone, Copy)]
struct Written {
    /// The id's last unlocked write here.
    at: Instant,
    /// An attempt found the id claimed elsewhere, or failed: none is
    /// started again before this.
    not_before: Option<Instant>,
}

impl RecentWrites {
    pub fn new(window: Duration) -> Self {
        Self {
            window,
            last: Mutex::default(),
        }
    }

    fn last(&self) -> std::sync::MutexGuard<'_, Recent> {
        self.last.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Notes an unlocked write of `id` at `now`: answers whether to claim
    /// it, `id` having been written here within the window before, and no
    /// attempt having failed lately.
    pub fn repeat(&self, id: &StateId, now: Instant) -> bool {
        let mut last = self.last();
        let before = last.by_id.get(id).copied();
        let not_before = before.and_then(|w| w.not_before).filter(|t| now < *t);
        last.by_id.insert(
            id.clone(),
            Written {
                at: now,
                not_before,
            },
        );
        if last.by_id.len() >= 2 * last.swept_at.max(64) {
            let window = self.window;
            last.by_id.retain(|_, w| {
                now.duration_since(w.at) < window || w.not_before.is_some_and(|t| now < t)
            });
            last.swept_at = last.by_id.len();
        }
        not_before.is_none() && before.is_some_and(|w| now.duration_since(w.at) < self.window)
    }

    /// An attempt on `id` did not win: no other starts before `until`.
    pub fn hold_off(&self, id: &StateId, until: Instant) {
        if let Some(written) = self.last().by_id.get_mut(id) {
            written.not_before = Some(until);
        }
    }
}

/// Claims `id` for writes in the background, unless its slot claims or
/// holds it already or an acquire waits for it.
pub(super) fn claim_for_writes(
    id: &StateId,
    slots: &Arc<Slots>,
    coordinator: &Arc<Coordinator>,
    recorder: &Arc<Recorder>,
    recent: &Arc<RecentWrites>,
) {
    let slot = slots.get_or_make(id);
    if !slot.apply_current(id, slots.metrics(), |st, _| st.start_claim_for_writes()) {
        return;
    }
    tokio::spawn(attempt(
        id.clone(),
        slot,
        slots.clone(),
        coordinator.clone(),
        recorder.clone(),
        recent.clone(),
    ));
}

/// One claim attempt for writes: won, the claim is taken on with no lease
/// (and the leases a shut-down gateway handed on, adopted); found elsewhere,
/// the id's writes are forwarded to that gateway from now on.
async fn attempt(
    id: StateId,
    slot: Arc<Slot>,
    slots: Arc<Slots>,
    coordinator: Arc<Coordinator>,
    recorder: Arc<Recorder>,
    recent: Arc<RecentWrites>,
) {
    let under_way = ClaimAttempt::under_way(&slot);
    let outcome = coordinator.try_claim(&id, Instant::now(), None).await;
    // Cleared before the outcome is applied: the guard takes the lock.
    drop(under_way);
    match outcome {
        Ok(ClaimOutcome::Won(won)) => {
            let budget = coordinator.timing().write_budget();
            let adopted = slot.apply(|st, now| st.claim_won_for_writes(*won, now, budget));
            for (lease, version) in adopted {
                recorder.held(&lease, version);
            }
            slots.metrics().lock_event(LockEvent::ClaimForWrites);
        }
        // Another gateway holds or won the claim: the id's writes are
        // forwarded to it while it lasts, and one that reaches this gateway
        // after all (its holder advertises no URL) tries no sooner than it
        // lapses; an attempt too slow to win tries no sooner either.
        Ok(ClaimOutcome::Elsewhere(_) | ClaimOutcome::Lost | ClaimOutcome::Unsettled) => {
            recent.hold_off(&id, Instant::now() + coordinator.timing().ttl());
        }
        Err(err) => {
            recent.hold_off(&id, Instant::now() + coordinator.timing().ttl());
            tracing::debug!(state_id = %id, error = %err, "could not claim the id for its writes; they go on by the routing read");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str) -> StateId {
        StateId::parse(name.to_owned()).unwrap()
    }

    #[test]
    fn a_write_is_a_repeat_only_within_the_window_of_the_one_before() {
        let recent = RecentWrites::new(Duration::from_secs(10));
        let now = Instant::now();
        assert!(!recent.repeat(&id("a"), now), "a first write is a one-off");
        assert!(recent.repeat(&id("a"), now + Duration::from_secs(9)));
        assert!(!recent.repeat(&id("b"), now + Duration::from_secs(9)));
        assert!(
            !recent.repeat(&id("a"), now + Duration::from_secs(20)),
            "a write past the window of the one before is a one-off again"
        );
    }

    #[test]
    fn an_attempt_that_did_not_win_holds_the_next_off() {
        let recent = RecentWrites::new(Duration::from_secs(10));
        let now = Instant::now();
        recent.repeat(&id("a"), now);
        recent.hold_off(&id("a"), now + Duration::from_secs(5));
        assert!(!recent.repeat(&id("a"), now + Duration::from_secs(1)));
        assert!(!recent.repeat(&id("a"), now + Duration::from_secs(4)));
        assert!(recent.repeat(&id("a"), now + Duration::from_secs(6)));
    }

    #[test]
    fn old_writes_are_swept_as_the_map_grows() {
        let recent = RecentWrites::new(Duration::from_secs(1));
        let now = Instant::now();
        for n in 0..200 {
            recent.repeat(&id(&format!("old-{n}")), now);
        }
        let later = now + Duration::from_secs(5);
        for n in 0..200 {
            recent.repeat(&id(&format!("new-{n}")), later);
        }
        let kept = recent.last().by_id.len();
        assert!(kept <= 260, "{kept} entries kept");
    }
}
