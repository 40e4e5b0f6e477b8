//! One async mutex per key, created on demand and forgotten when unused.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

pub struct KeyedMutex<K> {
    slots: Mutex<Slots<K>>,
}

struct Slots<K> {
    by_key: HashMap<K, Weak<AsyncMutex<()>>>,
    /// Size after the last sweep; the next sweep runs when the map doubles, so
    /// dead entries cost amortized O(1) per lock.
    swept_at: usize,
}

impl<K: Eq + Hash + Clone> Default for KeyedMutex<K> {
    fn default() -> Self {
        Self {
            slots: Mutex::new(Slots {
                by_key: HashMap::new(),
                swept_at: 0,
            }),
        }
    }
}

impl<K: Eq + Hash + Clone> KeyedMutex<K> {
    /// Waits for exclusive use of `key`; holders of other keys are not delayed.
    pub async fn lock(&self, key: &K) -> OwnedMutexGuard<()> {
        let slot = {
            let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            let existing = slots.by_key.get(key).and_then(Weak::upgrade);
            match existing {
                Some(slot) => slot,
                None => {
                    let slot = Arc::new(AsyncMutex::new(()));
                    slots.by_key.insert(key.clone(), Arc::downgrade(&slot));
                    if slots.by_key.len() > 2 * slots.swept_at.max(64) {
                        slots.by_key.retain(|_, weak| weak.strong_count() > 0);
                        slots.swept_at = slots.by_key.len();
                    }
                    slot
                }
            }
        };
        slot.lock_owned().await
    }

    #[cfg(test)]
    fn tracked_keys(&self) -> usize {
        self.slots.lock().unwrap().by_key.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn one_key_is_exclusive() {
        let mutex = Arc::new(KeyedMutex::<&str>::default());
        let inside = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..16)
            .map(|_| {
                let (mutex, inside, most) = (mutex.clone(), inside.clone(), most.clone());
                tokio::spawn(async move {
                    for _ in 0..20 {
                        let _guard = mutex.lock(&"k").await;
                        let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        tokio::task::yield_now().await;
                        inside.fetch_sub(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(most.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn other_keys_do_not_wait() {
        let mutex = KeyedMutex::<&str>::default();
        let _held = mutex.lock(&"a").await;
        tokio::time::timeout(Duration::from_secs(1), mutex.lock(&"b"))
            .await
            .expect("a different key must not wait");
    }

    #[tokio::test]
    async fn unused_keys_are_forgotten() {
        let mutex = KeyedMutex::<u32>::default();
        for key in 0..10_000 {
            drop(mutex.lock(&key).await);
        }
        assert!(
            mutex.tracked_keys() <= 256,
            "{} keys kept",
            mutex.tracked_keys()
        );
    }
}
