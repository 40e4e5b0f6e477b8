//! Read coalescing: point reads of one kind that arrive while one is on its
//! way to ClickHouse go out together in the next, as one `IN` query. This
//! is group commit (`states::group_commit`) for reads: there is no timer,
//! so a lone read goes out at once, and under load each query carries what
//! arrived during the one before. So the statements a write needs (its
//! routing read, its current row) do not grow with the number of writers.
//!
//! Each read is asked for before the query that answers it is sent, so it
//! sees every write acknowledged before it was asked for, as a read of its
//! own would. The queries run in a task of their own: a reader that hangs
//! up only stops waiting.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::oneshot;
use tracing::Instrument;

use super::error::StoreError;
use crate::metrics::Metrics;
use crate::traces::{self, Caller};
use crate::worker::{Running, Worker};

/// The most keys one query asks for; more wait for the next.
const MAX_KEYS: usize = 500;

/// One query for many keys: what it finds, by key (absent keys have nothing).
pub type ManyRead<K, V> = Pin<Box<dyn Future<Output = Result<HashMap<K, V>, StoreError>> + Send>>;

type Answer<V> = Result<Option<V>, Arc<StoreError>>;

pub struct ReadBatch<K, V> {
    /// The `read` label of `statehouse_read_batch_keys`.
    name: &'static str,
    read_many: Box<dyn Fn(Vec<K>) -> ManyRead<K, V> + Send + Sync>,
    metrics: Arc<Metrics>,
    /// Reads waiting for the next query, and the task reading them while
    /// any wait.
    queue: Worker<Vec<Waiting<K, V>>>,
}

/// A read waiting for its query: its key, where its answer goes, and the
/// span of the request that asked (the query's span links to it).
type Waiting<K, V> = (K, oneshot::Sender<Answer<V>>, Caller);

impl<K, V> ReadBatch<K, V>
where
    K: Eq + Hash + Clone + Send + 'static,
    V: Clone + Send + 'static,
{
    pub fn new(
        name: &'static str,
        metrics: Arc<Metrics>,
        read_many: impl Fn(Vec<K>) -> ManyRead<K, V> + Send + Sync + 'static,
    ) -> Self {
        Self {
            name,
            read_many: Box::new(read_many),
            metrics,
            queue: Worker::new(Vec::new()),
        }
    }

    /// What ClickHouse holds for `key` now, read with others asked for meanwhile.
    pub async fn read(self: &Arc<Self>, key: K) -> Result<Option<V>, StoreError> {
        let (answer, answered) = oneshot::channel();
        let waiting = (key, answer, Caller::current());
        self.queue.add(
            |queue| queue.push(waiting),
            |running| self.clone().read_all(running),
        );
        match answered.await {
            Ok(answer) => answer.map_err(StoreError::InBatch),
            // The task was stopped with the runtime (a shutdown), or died
            // holding this read.
            Err(_) => Err(StoreError::Abandoned),
        }
    }

    /// Sends queries until no read is waiting.
    async fn read_all(self: Arc<Self>, mut running: Running<Vec<Waiting<K, V>>>) {
        while let Some(taken) = running.next(take_oldest) {
            self.answer(taken).await;
        }
    }

    async fn answer(&self, taken: Vec<Waiting<K, V>>) {
        // The query is sent for every reader: its span is in no reader's
        // trace, and links to each.
        let span = traces::batch_span(
            || tracing::info_span!(parent: None, "read_batch", read = self.name),
            taken.iter().map(|(_, _, caller)| caller),
        );
        let mut readers: HashMap<K, Vec<oneshot::Sender<Answer<V>>>> = HashMap::new();
        for (key, answer, _) in taken {
            readers.entry(key).or_default().push(answer);
        }
        let keys: Vec<K> = readers.keys().cloned().collect();
        self.metrics.observe_read_batch(self.name, keys.len());
        let read = span.in_scope(|| (self.read_many)(keys));
        match read.instrument(span).await {
            Ok(mut found) => {
                for (key, answers) in readers {
                    let value = found.remove(&key);
                    for answer in answers {
                        let _ = answer.send(Ok(value.clone()));
                    }
                }
            }
            Err(err) => {
                let err = Arc::new(err);
                for answer in readers.into_values().flatten() {
                    let _ = answer.send(Err(err.clone()));
                }
            }
        }
    }
}

/// The next query's reads: the oldest, up to `MAX_KEYS`; the rest wait for
/// the query after. None when no read waits.
fn take_oldest<K, V>(waiting: &mut Vec<Waiting<K, V>>) -> Option<Vec<Waiting<K, V>>> {
    if waiting.is_empty() {
        return None;
    }
    let rest = waiting.split_off(MAX_KEYS.min(waiting.len()));
    Some(std::mem::replace(waiting, rest))
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use tokio::sync::Semaphore;

    use super::*;

    /// A reader over `0..100` (a key's value is its double) whose queries
    /// each wait for a permit of `gate`, recording the keys they asked for.
    /// A query for [`PANICS`] panics.
    struct Fake {
        batch: Arc<ReadBatch<u32, u32>>,
        gate: Arc<Semaphore>,
        queries: Arc<Mutex<Vec<Vec<u32>>>>,
    }

    const PANICS: u32 = 666;

    fn fake(fail_when: Option<u32>) -> Fake {
        let gate = Arc::new(Semaphore::new(0));
        let queries: Arc<Mutex<Vec<Vec<u32>>>> = Arc::default();
        let (g, q) = (gate.clone(), queries.clone());
        let batch = ReadBatch::new("test", Arc::default(), move |mut keys: Vec<u32>| {
            let (gate, queries) = (g.clone(), q.clone());
            Box::pin(async move {
                keys.sort_unstable();
                queries.lock().unwrap().push(keys.clone());
                gate.acquire().await.unwrap().forget();
                assert!(!keys.contains(&PANICS), "a query the test kills");
                if fail_when.is_some_and(|k| keys.contains(&k)) {
                    return Err(StoreError::Timeout(Duration::from_secs(1)));
                }
                Ok(keys
                    .into_iter()
                    .filter(|k| *k < 100)
                    .map(|k| (k, k * 2))
                    .collect())
            })
        });
        Fake {
            batch: Arc::new(batch),
            gate,
            queries,
        }
    }

    impl Fake {
        fn spawn_read(&self, key: u32) -> tokio::task::JoinHandle<Result<Option<u32>, StoreError>> {
            let batch = self.batch.clone();
            tokio::spawn(async move { batch.read(key).await })
        }

        async fn queries_sent(&self, n: usize) {
            while self.queries.lock().unwrap().len() < n {
                tokio::task::yield_now().await;
            }
        }

        fn queries(&self) -> Vec<Vec<u32>> {
            self.queries.lock().unwrap().clone()
        }
    }

    #[tokio::test]
    async fn a_lone_read_goes_out_at_once_and_a_missing_key_has_nothing() {
        let fake = fake(None);
        fake.gate.add_permits(2);
        assert_eq!(fake.batch.read(7).await.unwrap(), Some(14));
        assert_eq!(fake.batch.read(700).await.unwrap(), None);
        assert_eq!(fake.queries(), vec![vec![7], vec![700]]);
    }

    #[tokio::test]
    async fn reads_asked_while_one_is_on_its_way_go_out_together_in_the_next() {
        let fake = fake(None);
        let first = fake.spawn_read(1);
        fake.queries_sent(1).await;
        let later: Vec<_> = [2, 3, 3, 4]
            .into_iter()
            .map(|k| fake.spawn_read(k))
            .collect();
        // Each asked before the second query: none of them is in the first.
        tokio::time::sleep(Duration::from_millis(50)).await;
        fake.gate.add_permits(2);
        assert_eq!(first.await.unwrap().unwrap(), Some(2));
        let answers: Vec<_> = joined(later).await;
        assert_eq!(answers, vec![Some(4), Some(6), Some(6), Some(8)]);
        // Key 3 was asked for twice and read once.
        assert_eq!(fake.queries(), vec![vec![1], vec![2, 3, 4]]);
    }

    #[tokio::test]
    async fn a_failed_query_fails_exactly_its_reads() {
        let fake = fake(Some(5));
        let first = fake.spawn_read(1);
        fake.queries_sent(1).await;
        let failing: Vec<_> = [5, 6].into_iter().map(|k| fake.spawn_read(k)).collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        fake.gate.add_permits(3);
        assert_eq!(first.await.unwrap().unwrap(), Some(2));
        for read in failing {
            assert!(matches!(read.await.unwrap(), Err(StoreError::InBatch(_))));
        }
        assert_eq!(fake.batch.read(6).await.unwrap(), Some(12));
    }

    #[tokio::test]
    async fn a_reading_task_that_dies_is_replaced_for_the_next_read() {
        let fake = fake(None);
        fake.gate.add_permits(2);
        let died = fake.batch.read(PANICS).await;
        assert!(matches!(died, Err(StoreError::Abandoned)), "{died:?}");
        let served = tokio::time::timeout(Duration::from_secs(30), fake.batch.read(7));
        assert_eq!(served.await.expect("served").unwrap(), Some(14));
        assert_eq!(fake.queries(), vec![vec![PANICS], vec![7]]);
    }

    #[tokio::test]
    async fn a_reader_that_hangs_up_stops_nobody_else() {
        let fake = fake(None);
        let first = fake.spawn_read(1);
        fake.queries_sent(1).await;
        let dropped = fake.spawn_read(2);
        let kept = fake.spawn_read(3);
        tokio::time::sleep(Duration::from_millis(50)).await;
        dropped.abort();
        fake.gate.add_permits(2);
        assert_eq!(first.await.unwrap().unwrap(), Some(2));
        assert_eq!(kept.await.unwrap().unwrap(), Some(6));
    }

    #[tokio::test]
    async fn a_query_asks_for_at_most_max_keys() {
        let fake = fake(None);
        let first = fake.spawn_read(0);
        fake.queries_sent(1).await;
        let reads: Vec<_> = (0..MAX_KEYS as u32 + 10)
            .map(|k| fake.spawn_read(k))
            .collect();
        tokio::time::sleep(Duration::from_millis(100)).await;
        fake.gate.add_permits(3);
        first.await.unwrap().unwrap();
        joined(reads).await;
        let sizes: Vec<usize> = fake.queries().iter().map(Vec::len).collect();
        assert_eq!(sizes[0], 1);
        assert!(sizes[1..].iter().all(|n| *n <= MAX_KEYS), "{sizes:?}");
        assert_eq!(sizes[1..].iter().sum::<usize>(), MAX_KEYS + 10);
    }

    async fn joined(
        reads: Vec<tokio::task::JoinHandle<Result<Option<u32>, StoreError>>>,
    ) -> Vec<Option<u32>> {
        let mut answers = Vec::new();
        for read in reads {
            answers.push(read.await.unwrap().unwrap());
        }
        answers
    }
}
