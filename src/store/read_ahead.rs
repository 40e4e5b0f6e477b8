//! Rows read ahead: a write's routing read (see `route_read`) finds the id's
//! current row in the statement that routes it, and files it here for the
//! write to take, instead of reading it again. Each row is tagged with when
//! its read was asked for: it holds every write acknowledged before then.
//!
//! A row is taken once: a write refused and decided again, or any later
//! write, reads afresh (or takes a row read after it began). Rows nobody
//! takes (a write sent on to a peer, or failed) leave after [`KEPT`], or as
//! newer ones come: at most [`MAX_ROWS`] rows and [`MAX_BYTES`] of document
//! text are kept.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::stored::StoredRow;
use crate::domain::StateId;

/// How long a row waits for its write. A write takes its row right after
/// its routing read; a row is used only while the lease that read saw is
/// (half the claim settle), and one older than this is read again.
const KEPT: Duration = Duration::from_secs(10);

/// The most rows kept at once.
const MAX_ROWS: usize = 1024;

/// The most document text kept at once, in bytes.
const MAX_BYTES: usize = 64 * 1024 * 1024;

/// The current rows that routing reads found, by state_id.
#[derive(Default)]
pub struct ReadAhead {
    kept: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    by_id: HashMap<StateId, Ahead>,
    /// Each row filed, oldest first: what leaves first. A row taken or
    /// replaced leaves its entry here until its turn comes.
    filed: VecDeque<(StateId, Instant)>,
    /// Document text of the rows in `by_id`.
    bytes: usize,
}

/// One id's row, and when the read that found it was asked for.
struct Ahead {
    asked_at: Instant,
    /// None when the id has no state.
    row: Option<StoredRow>,
}

impl Ahead {
    fn size(&self) -> usize {
        self.row.as_ref().map_or(0, StoredRow::size)
    }
}

impl ReadAhead {
    /// Keeps `row`, `id`'s current row as a read asked for at `asked_at`
    /// found it (None: no state), unless a read asked for later is kept.
    pub(super) fn file(&self, id: &StateId, asked_at: Instant, row: Option<StoredRow>) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if kept.by_id.get(id).is_some_and(|a| a.asked_at > asked_at) {
            return;
        }
        let ahead = Ahead { asked_at, row };
        kept.bytes += ahead.size();
        if let Some(replaced) = kept.by_id.insert(id.clone(), ahead) {
            kept.bytes -= replaced.size();
        }
        kept.filed.push_back((id.clone(), asked_at));
        kept.prune(Instant::now());
    }

    /// `id`'s row, taken (a second take finds none), if its read was asked
    /// for at `since` or later: as fresh as a read of the taker's own. With
    /// when that read was asked for; None when no such row is kept.
    pub(super) fn take(
        &self,
        id: &StateId,
        since: Instant,
    ) -> Option<(Instant, Option<StoredRow>)> {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.prune(Instant::now());
        let ahead = kept.by_id.remove(id)?;
        kept.bytes -= ahead.size();
        (ahead.asked_at >= since).then_some((ahead.asked_at, ahead.row))
    }
}

impl Kept {
    /// Lets the oldest rows go while they are too old or too many.
    fn prune(&mut self, now: Instant) {
        while let Some((id, asked_at)) = self.filed.front() {
            let over = self.filed.len() > MAX_ROWS || self.bytes > MAX_BYTES;
            if !over && now.duration_since(*asked_at) < KEPT {
                return;
            }
            // The row filed then, unless it was taken or replaced since.
            if self.by_id.get(id).is_some_and(|a| a.asked_at == *asked_at)
                && let Some(gone) = self.by_id.remove(id)
            {
                self.bytes -= gone.size();
            }
            self.filed.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str) -> StateId {
        StateId::parse(name.to_owned()).unwrap()
    }

    fn row(name: &str, text: &str, updated_at_ms: i64) -> StoredRow {
        StoredRow::from_columns(id(name), Some(text.to_owned()), None, updated_at_ms)
    }

    #[test]
    fn a_row_is_taken_once() {
        let ahead = ReadAhead::default();
        let asked_at = Instant::now();
        ahead.file(&id("a"), asked_at, Some(row("a", "{}", 1)));
        ahead.file(&id("b"), asked_at, None);
        assert_eq!(
            ahead.take(&id("a"), asked_at),
            Some((asked_at, Some(row("a", "{}", 1))))
        );
        assert_eq!(ahead.take(&id("a"), asked_at), None);
        assert_eq!(ahead.take(&id("b"), asked_at), Some((asked_at, None)));
        assert_eq!(ahead.take(&id("b"), asked_at), None);
        assert_eq!(ahead.take(&id("c"), asked_at), None);
    }

    #[test]
    fn a_row_read_before_the_taker_began_is_not_taken() {
        let ahead = ReadAhead::default();
        let asked_at = Instant::now();
        ahead.file(&id("a"), asked_at, Some(row("a", "{}", 1)));
        let later = asked_at + Duration::from_millis(1);
        assert_eq!(ahead.take(&id("a"), later), None);
        // Nor by anyone after: it is gone.
        assert_eq!(ahead.take(&id("a"), asked_at), None);
    }

    #[test]
    fn the_row_of_the_read_asked_for_last_is_kept() {
        let ahead = ReadAhead::default();
        let first = Instant::now();
        let second = first + Duration::from_millis(1);
        ahead.file(&id("a"), second, Some(row("a", "{}", 2)));
        ahead.file(&id("a"), first, Some(row("a", "{}", 1)));
        assert_eq!(
            ahead.take(&id("a"), first),
            Some((second, Some(row("a", "{}", 2))))
        );
        ahead.file(&id("a"), first, Some(row("a", "{}", 1)));
        ahead.file(&id("a"), second, Some(row("a", "{}", 2)));
        assert_eq!(
            ahead.take(&id("a"), first),
            Some((second, Some(row("a", "{}", 2))))
        );
        assert_eq!(ahead.kept.lock().unwrap().bytes, 0);
    }

    #[test]
    fn a_row_older_than_kept_is_gone() {
        let ahead = ReadAhead::default();
        let long_ago = Instant::now()
            .checked_sub(KEPT + Duration::from_millis(1))
            .expect("a clock running longer than KEPT");
        ahead.file(&id("a"), long_ago, Some(row("a", "{}", 1)));
        assert_eq!(ahead.take(&id("a"), long_ago), None);
        assert_eq!(ahead.kept.lock().unwrap().bytes, 0);
    }

    #[test]
    fn at_most_max_rows_are_kept_the_newest() {
        let ahead = ReadAhead::default();
        let asked_at = Instant::now();
        for n in 0..=MAX_ROWS {
            let name = format!("id-{n}");
            ahead.file(&id(&name), asked_at, Some(row(&name, "{}", 1)));
        }
        let kept = ahead.kept.lock().unwrap();
        assert_eq!(kept.by_id.len(), MAX_ROWS);
        assert!(!kept.by_id.contains_key(&id("id-0")));
        assert!(kept.by_id.contains_key(&id(&format!("id-{MAX_ROWS}"))));
        assert_eq!(kept.bytes, 2 * MAX_ROWS);
    }

    #[test]
    fn at_most_max_bytes_of_documents_are_kept() {
        let ahead = ReadAhead::default();
        let asked_at = Instant::now();
        let half = "x".repeat(MAX_BYTES / 2);
        for name in ["a", "b", "c"] {
            ahead.file(&id(name), asked_at, Some(row(name, &half, 1)));
        }
        assert_eq!(ahead.take(&id("a"), asked_at), None);
        assert!(ahead.take(&id("b"), asked_at).is_some());
        assert!(ahead.take(&id("c"), asked_at).is_some());
        assert_eq!(ahead.kept.lock().unwrap().bytes, 0);
    }
}
