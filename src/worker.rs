//! One on-demand worker: work that callers hand over, done by at most one
//! background task, started when there is work and none runs, and ending
//! when none is left. The group commit, the read batch and the two pollers
//! (the change feed's, the long-poll's) are each one.
//!
//! The two rules that make "start a task if none runs" safe live here once:
//! - a task ends under the same lock as its last look at the work, so work
//!   added before that look is taken, and work added after it finds no task
//!   and starts one;
//! - a task that dies (a panic, or cancelled with its runtime) is marked gone
//!   by its guard ([`Running`]'s drop), so the next caller starts another
//!   rather than waiting for one that will never come.
//!
//! As in mini-redis's `db.rs`, the handle ([`Worker`]), the state it shares
//! with the task ([`Shared`], under a std mutex never held across an
//! `.await`) and the task's side ([`Running`]) are kept apart.

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};

/// Work of type `S` that callers change and one background task at a time
/// works off.
pub struct Worker<S> {
    /// What the handle and the running task share.
    shared: Arc<Shared<S>>,
}

/// What the handle and the running task's guard share.
struct Shared<S> {
    /// The work, and whether a task runs; never held across an `.await`.
    state: Mutex<State<S>>,
    /// Run on the work under the lock as a task ends, however it ends: what
    /// exists only while a task runs goes with it.
    ended: Box<dyn Fn(&mut S) + Send + Sync>,
    /// Set by a test: the next task to take work panics holding it.
    #[cfg(test)]
    fail_next: std::sync::atomic::AtomicBool,
}

/// The work and its task, under one lock.
struct State<S> {
    /// The owner's: what callers add and the task takes.
    work: S,
    /// Whether a task runs: set by the caller that starts one, cleared as it
    /// ends (by [`Running::next`], or by its guard when it dies).
    running: bool,
}

/// The work, locked, to look at or change without starting a task. A std
/// mutex guard: never held across an `.await`.
pub struct Locked<'a, S>(MutexGuard<'a, State<S>>);

/// The running task's side: it takes its work through [`Running::next`], and
/// dropped (the task returned, panicked or was cancelled) it marks the task
/// gone.
pub struct Running<S> {
    /// Where the task is marked gone.
    shared: Arc<Shared<S>>,
    /// Whether this task is still the one running: false once
    /// [`Running::next`] has ended it, when another may have started since.
    current: bool,
}

impl<S: Send + 'static> Worker<S> {
    pub fn new(work: S) -> Self {
        Self::ending(work, |_| {})
    }

    /// As [`Worker::new`], with `ended` run on the work under the lock each
    /// time a task ends, however it ends.
    pub fn ending(work: S, ended: impl Fn(&mut S) + Send + Sync + 'static) -> Self {
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    work,
                    running: false,
                }),
                ended: Box::new(ended),
                #[cfg(test)]
                fail_next: std::sync::atomic::AtomicBool::new(false),
            }),
        }
    }

    /// Changes the work with `change` and, if no task runs, starts one: the
    /// future `task` makes of its [`Running`] is spawned. Answers what
    /// `change` answers, and whether a task was started.
    pub fn add<R, F>(
        &self,
        change: impl FnOnce(&mut S) -> R,
        task: impl FnOnce(Running<S>) -> F,
    ) -> (R, bool)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let (answer, start) = {
            let mut state = self.shared.lock();
            let answer = change(&mut state.work);
            (answer, !std::mem::replace(&mut state.running, true))
        };
        if start {
            tokio::spawn(task(Running {
                shared: self.shared.clone(),
                current: true,
            }));
        }
        (answer, start)
    }

    /// The work, locked: to look at it or change it without starting a task.
    pub fn lock(&self) -> Locked<'_, S> {
        Locked(self.shared.lock())
    }

    /// Whether a task runs now.
    pub fn running(&self) -> bool {
        self.shared.lock().running
    }

    /// The next task to take work panics holding it: how a test kills one.
    #[cfg(test)]
    pub fn fail_next_task(&self) {
        self.shared
            .fail_next
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl<S> Shared<S> {
    fn lock(&self) -> MutexGuard<'_, State<S>> {
        // A task that panicked holding the lock left the work as it was.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the task gone, under the lock the caller holds.
    fn end(&self, state: &mut State<S>) {
        state.running = false;
        (self.ended)(&mut state.work);
    }
}

impl<S> Running<S> {
    /// The task's next piece of work, taken by `take` under the lock. None
    /// when `take` finds none: the task has ended then, marked gone under the
    /// same lock as the look, and must return.
    pub fn next<T>(&mut self, take: impl FnOnce(&mut S) -> Option<T>) -> Option<T> {
        if !self.current {
            return None;
        }
        let mut state = self.shared.lock();
        let Some(work) = take(&mut state.work) else {
            self.shared.end(&mut state);
            self.current = false;
            return None;
        };
        drop(state);
        #[cfg(test)]
        if self
            .shared
            .fail_next
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            panic!("a test kills this task as it holds its work");
        }
        Some(work)
    }
}

impl<S> Drop for Running<S> {
    fn drop(&mut self) {
        if self.current {
            let mut state = self.shared.lock();
            self.shared.end(&mut state);
        }
    }
}

impl<S> Deref for Locked<'_, S> {
    type Target = S;

    fn deref(&self) -> &S {
        &self.0.work
    }
}

impl<S> DerefMut for Locked<'_, S> {
    fn deref_mut(&mut self) -> &mut S {
        &mut self.0.work
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::sync::{Semaphore, mpsc};

    use super::*;

    /// A worker over a list of numbers whose task takes all that wait at
    /// once, reports each take on `taken`, then waits for a permit of `gate`;
    /// `ends` counts the tasks that ended.
    struct Fake {
        worker: Worker<Vec<u32>>,
        gate: Arc<Semaphore>,
        taken: mpsc::UnboundedSender<Vec<u32>>,
        ends: Arc<AtomicUsize>,
    }

    fn fake() -> (Fake, mpsc::UnboundedReceiver<Vec<u32>>) {
        let ends = Arc::new(AtomicUsize::new(0));
        let counted = ends.clone();
        let worker = Worker::ending(Vec::new(), move |_| {
            counted.fetch_add(1, Ordering::SeqCst);
        });
        let (taken, takes) = mpsc::unbounded_channel();
        let fake = Fake {
            worker,
            gate: Arc::new(Semaphore::new(0)),
            taken,
            ends,
        };
        (fake, takes)
    }

    impl Fake {
        /// Adds `n`; answers whether that started a task.
        fn add(&self, n: u32) -> bool {
            let (gate, taken) = (self.gate.clone(), self.taken.clone());
            let ((), started) = self.worker.add(
                |waiting| waiting.push(n),
                |mut running| async move {
                    while let Some(work) = running
                        .next(|waiting| (!waiting.is_empty()).then(|| std::mem::take(waiting)))
                    {
                        taken.send(work).unwrap();
                        gate.acquire().await.unwrap().forget();
                    }
                },
            );
            started
        }

        /// Until the task has ended (a test that never gets there fails
        /// rather than hangs).
        async fn stopped(&self) {
            let stopped = async {
                while self.worker.running() {
                    tokio::task::yield_now().await;
                }
            };
            tokio::time::timeout(std::time::Duration::from_secs(30), stopped)
                .await
                .expect("the task ends");
        }
    }

    #[tokio::test]
    async fn work_added_while_a_task_runs_is_its_and_the_task_ends_when_none_is_left() {
        let (fake, mut takes) = fake();
        assert!(fake.add(1), "no task ran");
        assert_eq!(takes.recv().await, Some(vec![1]));
        assert!(!fake.add(2), "one task at a time");
        assert!(!fake.add(3));
        fake.gate.add_permits(1);
        assert_eq!(takes.recv().await, Some(vec![2, 3]));
        fake.gate.add_permits(1);
        fake.stopped().await;
        assert_eq!(fake.ends.load(Ordering::SeqCst), 1);
        assert!(fake.add(4), "the task ended: work after it starts another");
        assert_eq!(takes.recv().await, Some(vec![4]));
        assert!(fake.worker.lock().is_empty());
    }

    #[tokio::test]
    async fn a_task_that_panics_is_marked_gone_and_the_next_caller_starts_another() {
        let (fake, mut takes) = fake();
        fake.worker.fail_next_task();
        assert!(fake.add(1));
        fake.stopped().await;
        assert_eq!(fake.ends.load(Ordering::SeqCst), 1);
        assert!(fake.add(2), "a fresh task");
        assert_eq!(
            takes.recv().await,
            Some(vec![2]),
            "1 went with the dead task"
        );
    }

    #[test]
    fn a_task_cancelled_with_its_runtime_is_marked_gone_and_the_next_caller_starts_another() {
        let (fake, mut takes) = fake();
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap()
        };
        let first = runtime();
        first.block_on(async {
            assert!(fake.add(1));
            assert_eq!(takes.recv().await, Some(vec![1]));
        });
        assert!(fake.worker.running(), "waiting at the gate");
        drop(first);
        assert!(!fake.worker.running());
        assert_eq!(fake.ends.load(Ordering::SeqCst), 1);
        runtime().block_on(async {
            assert!(fake.add(2), "a fresh task");
            assert_eq!(takes.recv().await, Some(vec![2]));
        });
    }
}
