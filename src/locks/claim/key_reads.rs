//! Keeper mode's routing reads of claim keys, kept a moment for the claim
//! that follows: a first acquire reads the key to route, finds it free, and
//! claims; the claim takes that read instead of reading the key again (one
//! Keeper round trip less). Any age is safe: the claim's write is
//! conditional on the key as read (a strict INSERT, or an UPDATE that holds
//! only if the key is unchanged and still free, by the server's clock), so a
//! stale read costs a refused write and a fresh read, nothing more. The id's
//! lock rows read beside the key are kept with it: a claim on a missing key
//! goes by them too (see `keeper`).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::domain::StateId;
use crate::store::{ClaimRead, IdLocks};

/// How long a routing read is kept for a claim: a claim follows its
/// routing read at once, so this is only a bound on what is kept.
const KEPT: Duration = Duration::from_secs(1);

/// Past this many reads kept, the ones older than [`KEPT`] are dropped.
const PRUNE_AT: usize = 256;

/// A routing read: the key as read, and the id's lock rows read beside it.
type Routed = (ClaimRead, IdLocks);

/// Routing reads of keys, by id, each with when it was asked for.
#[derive(Default)]
pub(super) struct KeyReads(Mutex<HashMap<StateId, (Instant, Routed)>>);

impl KeyReads {
    fn reads(&self) -> std::sync::MutexGuard<'_, HashMap<StateId, (Instant, Routed)>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `read` of `id`'s key and the `locks` read beside it, asked
    /// for at `at`.
    pub fn keep(&self, id: &StateId, at: Instant, read: ClaimRead, locks: IdLocks) {
        let mut reads = self.reads();
        if reads.len() >= PRUNE_AT {
            reads.retain(|_, (at, _)| at.elapsed() < KEPT);
        }
        reads.insert(id.clone(), (at, (read, locks)));
    }

    /// The routing read of `id` kept within [`KEPT`], taken: each is used once.
    pub fn take(&self, id: &StateId) -> Option<Routed> {
        self.reads()
            .remove(id)
            .filter(|(at, _)| at.elapsed() < KEPT)
            .map(|(_, routed)| routed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str) -> StateId {
        StateId::parse(name).unwrap()
    }

    #[test]
    fn a_kept_read_is_taken_once_and_a_stale_one_not_at_all() {
        let reads = KeyReads::default();
        let read = ClaimRead {
            claim: None,
            now_ms: 1,
        };
        let locks = IdLocks::default();
        reads.keep(&id("a"), Instant::now(), read.clone(), locks.clone());
        assert_eq!(reads.take(&id("a")), Some((read.clone(), locks.clone())));
        assert_eq!(reads.take(&id("a")), None);
        let stale = Instant::now().checked_sub(KEPT * 2).unwrap();
        reads.keep(&id("b"), stale, read, locks);
        assert_eq!(reads.take(&id("b")), None);
    }
}
