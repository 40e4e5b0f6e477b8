//! How a ClickHouse round trip fails, each failure told on one line with
//! its causes (what no retry fixes is told apart in `diagnosis`).

use std::error::Error;
use std::sync::Arc;
use std::time::Duration;

use crate::domain::CorruptState;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("ClickHouse did not answer within {0:?}")]
    Timeout(Duration),
    #[error("ClickHouse request failed: {}", with_causes(.0))]
    ClickHouse(#[from] clickhouse::error::Error),
    /// An answer without a ClickHouse exception that is not a result either:
    /// a proxy's error page, or another server altogether.
    #[error("the answer is not ClickHouse's: HTTP {}: {excerpt}", status_line(*.status))]
    Unrecognized { status: u16, excerpt: String },
    #[error("state {id:?} in ClickHouse cannot be read: {source}")]
    Corrupt { id: String, source: CorruptState },
    /// The query of a batch failed: the INSERT of writes (see
    /// `states::group_commit`) or a coalesced read (see `read_batch`).
    #[error("{0}")]
    InBatch(Arc<StoreError>),
    #[error("the write was abandoned: the gateway is shutting down")]
    Abandoned,
    /// ClickHouse refused a checked INSERT (see `checked_insert`): a state
    /// it checks changed since the change was decided; nothing landed.
    #[error("a state changed in ClickHouse since the write was decided against it")]
    Stale,
    /// A table-mode claim renewal answered after this gateway's membership
    /// may have lapsed (see `locks::claim::membership`): it may have landed,
    /// but the claim keeps only the validity it had.
    #[error("the claim renewal was answered after this gateway's membership may have lapsed")]
    MembershipLapsed,
}

impl StoreError {
    /// Whether ClickHouse surely did not apply the request that failed so:
    /// it answered with an exception. After a timeout, a cut connection or
    /// an answer that is not ClickHouse's, the request may still be applied.
    pub fn surely_not_applied(&self) -> bool {
        match self {
            Self::ClickHouse(clickhouse::error::Error::BadResponse(_)) | Self::Stale => true,
            Self::InBatch(inner) => inner.surely_not_applied(),
            _ => false,
        }
    }
}

/// An error and its causes on one line: "client error (connect)" alone does
/// not say that the certificate was not trusted, and a server's message may
/// span lines.
fn with_causes(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = String::new();
    for cause in causes(err) {
        let cause_text = one_line(&cause.to_string());
        if !text.contains(&cause_text) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&cause_text);
        }
    }
    text
}

fn status_line(status: u16) -> String {
    let reason = hyper::StatusCode::from_u16(status)
        .ok()
        .and_then(|status| status.canonical_reason());
    match reason {
        Some(reason) => format!("{status} {reason}"),
        None => status.to_string(),
    }
}

pub(super) fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// An error and its causes, including what an `io::Error` wraps (its
/// `source()` skips the wrapped error, where TLS failures sit).
pub(super) fn causes<'a>(
    err: &'a (dyn Error + 'static),
) -> impl Iterator<Item = &'a (dyn Error + 'static)> {
    std::iter::successors(Some(err), |&err| {
        match err
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
        {
            Some(inner) => Some(inner as &(dyn Error + 'static)),
            None => err.source(),
        }
    })
}
