//! The slots of the state_ids this gateway has business with: found or
//! made on demand, visited without holding the map's lock, and dropped once
//! nobody refers to them and they hold nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use uuid::Uuid;

use super::slot::{Slot, SlotState};
use crate::domain::StateId;
use crate::metrics::Metrics;

pub(super) struct Slots {
    /// The map's lock is held only to find, add or drop a slot, never
    /// across an `.await`.
    map: Mutex<HashMap<StateId, Arc<Slot>>>,
    /// Where a slot's expiries are counted.
    metrics: Arc<Metrics>,
}

impl Slots {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            map: Mutex::default(),
            metrics,
        }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<StateId, Arc<Slot>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// `id`'s slot, made if there is none.
    pub fn get_or_make(&self, id: &StateId) -> Arc<Slot> {
        self.map().entry(id.clone()).or_default().clone()
    }

    pub fn existing(&self, id: &StateId) -> Option<Arc<Slot>> {
        self.map().get(id).cloned()
    }

    /// The slots as they are now, to visit without holding the map's lock.
    pub fn snapshot(&self) -> Vec<(StateId, Arc<Slot>)> {
        self.map()
            .iter()
            .map(|(id, slot)| (id.clone(), slot.clone()))
            .collect()
    }

    /// A slot nobody refers to and that holds nothing goes; the map's lock
    /// is what every acquire takes to find its slot, so none can be joining.
    pub fn forget_idle(&self) {
        self.map()
            .retain(|_, slot| Arc::strong_count(slot) > 1 || !slot.read(SlotState::is_idle));
    }

    /// The claim this gateway holds on `id`, if it is the id's authority: as
    /// long as it holds that claim, every write to the id comes through it.
    pub fn authority_claim(&self, id: &StateId) -> Option<Uuid> {
        let slot = self.existing(id)?;
        slot.current(id, &self.metrics, SlotState::claim_id)
    }

    /// The claim this gateway holds on `id` while a lease runs under it:
    /// the id's state is then written only through the lease holder here.
    pub fn leased_claim(&self, id: &StateId) -> Option<Uuid> {
        let slot = self.existing(id)?;
        slot.current(id, &self.metrics, |st| {
            st.claim_id().filter(|_| st.lease().is_some())
        })
    }

    /// Whether this gateway answers for `id`: it holds its claim, or keeps
    /// leases under its lapsed claim.
    pub fn answers_for(&self, id: &StateId) -> bool {
        self.existing(id)
            .is_some_and(|slot| slot.current(id, &self.metrics, SlotState::answers_for))
    }

    /// Whether no write sent under this gateway's claim on `id` may still
    /// land (its own, or one another gateway sends under its ticket): only
    /// then does what it reads of the id stay current.
    pub fn nothing_landing(&self, id: &StateId) -> bool {
        self.existing(id)
            .is_none_or(|slot| slot.read(SlotState::nothing_landing))
    }
}
