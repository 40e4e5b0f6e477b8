//! Why a change of state was refused or failed: one enum for the whole
//! commit path, mapped to problem+json by `http::error`.

use crate::domain::{AsOf, Loss, Regression, Version};
use crate::locks::LockError;
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    PreconditionFailed(&'static str),
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("no state with id {0:?}")]
    NotFound(String),
    #[error("the state has no bookmark for stream {0:?} in completed or partial")]
    NoBookmark(String),
    #[error("entry {index} (state_id {state_id:?}): {source}")]
    InBatch {
        index: usize,
        state_id: String,
        source: Box<StateError>,
    },
    #[error("entry {index}: state_id {state_id:?} is in the batch twice (first at entry {first})")]
    Duplicate {
        index: usize,
        first: usize,
        state_id: String,
    },
    #[error("{} went backwards (--bookmark-regression reject); send Statehouse-Allow-Regression naming the streams to write it anyway", names(.0.iter().map(|r| r.stream.as_str())))]
    BookmarkRegression(Vec<Regression>),
    #[error("{} would lose its bookmark (--bookmark-loss reject); send Statehouse-Allow-Loss naming the streams to write it anyway", names(.0.iter().map(|l| l.stream.as_str())))]
    BookmarkLoss(Vec<Loss>),
    #[error("history is off on this gateway (--history=false), so no versions are kept")]
    HistoryOff,
    #[error("at {} is in the future; ask for an instant up to now", rfc3339(.0.millis()))]
    FutureInstant(AsOf),
    #[error("at {} is older than history keeps (--history-retention); the oldest instant to ask is {}", rfc3339(.at.millis()), rfc3339(*.oldest_ms))]
    HistoryExpired { at: AsOf, oldest_ms: i64 },
    #[error(
        "the restore would touch more than {0} state ids; narrow the pattern (nothing was written)"
    )]
    TooManyIds(usize),
    #[error("this state has no version {}", .0.to_rfc3339())]
    VersionNotFound(Version),
    /// ClickHouse refused the write's INSERT each time: another writer
    /// changed the state after the write was decided against it.
    #[error(
        "another writer changed the state in ClickHouse after this write was decided against it ({attempts} attempt(s)); nothing was written, retry"
    )]
    Stale { attempts: u32 },
}

impl StateError {
    /// `source`, as the refusal of entry `index` of a batch.
    pub fn in_batch(index: usize, state_id: &str, source: StateError) -> Self {
        Self::InBatch {
            index,
            state_id: state_id.to_owned(),
            source: Box::new(source),
        }
    }

    pub fn precondition_failed(exists: bool) -> Self {
        Self::PreconditionFailed(if exists {
            "If-Match does not match the current ETag of the state"
        } else {
            "If-Match was given but the state does not exist"
        })
    }
}

fn rfc3339(ms: i64) -> String {
    Version::from_millis(ms).to_rfc3339()
}

/// Stream names for a message: each once, comma-separated.
fn names<'a>(streams: impl Iterator<Item = &'a str>) -> String {
    let mut names: Vec<&str> = streams.collect();
    names.dedup();
    names.join(", ")
}
