//! The one rule for trying an operation again after an outcome that a
//! second try may change (a write refused for another's, a conditional
//! write that raced one): three attempts in all, then the last outcome
//! stands. Nothing waits between attempts: each follows a race lost to
//! another writer, which has already moved on.

use std::future::Future;

/// How many times in all an operation is tried.
pub const ATTEMPTS: usize = 3;

/// Runs `attempt` again while `again` says its outcome is worth another
/// try, `ATTEMPTS` times in all; answers the last outcome. `again` is asked
/// after every attempt but the last, so it may also ready the next one.
pub async fn retried<T, F: Future<Output = T>>(
    mut attempt: impl FnMut() -> F,
    mut again: impl FnMut(&T) -> bool,
) -> T {
    for _ in 1..ATTEMPTS {
        let outcome = attempt().await;
        if !again(&outcome) {
            return outcome;
        }
    }
    attempt().await
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    #[tokio::test]
    async fn an_outcome_not_worth_another_try_stands_at_once() {
        let tries = Cell::new(0);
        let outcome = retried(
            || async {
                tries.set(tries.get() + 1);
                "done"
            },
            |_| false,
        )
        .await;
        assert_eq!((outcome, tries.get()), ("done", 1));
    }

    #[tokio::test]
    async fn an_attempt_that_succeeds_on_its_second_try_is_tried_twice() {
        let tries = Cell::new(0);
        let outcome = retried(
            || async {
                tries.set(tries.get() + 1);
                tries.get()
            },
            |n| *n < 2,
        )
        .await;
        assert_eq!((outcome, tries.get()), (2, 2));
    }

    #[tokio::test]
    async fn the_last_of_three_attempts_stands_and_again_is_not_asked_of_it() {
        let (tries, asked) = (Cell::new(0), Cell::new(0));
        let outcome = retried(
            || async {
                tries.set(tries.get() + 1);
                Err::<(), usize>(tries.get())
            },
            |_| {
                asked.set(asked.get() + 1);
                true
            },
        )
        .await;
        assert_eq!(outcome, Err(ATTEMPTS));
        assert_eq!((tries.get(), asked.get()), (ATTEMPTS, ATTEMPTS - 1));
    }
}
