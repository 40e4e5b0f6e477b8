//! Deciding a change, with no I/O: from the id's current row, the change
//! and the policy (If-Match, the bookmark guard), what goes out to
//! ClickHouse, or why nothing may. Every change of the API (PUT, PATCH,
//! DELETE, rollback, stream reset, bulk import) is decided here, so each
//! rule of a write is written once.

use crate::domain::{
    Allowed, AllowedStreams, Findings, GuardMode, GuardModes, IfMatch, StateDocument, StateId,
    Version,
};
use crate::store::{Operation, StoredRow, StoredState, next_version};

use super::error::StateError;

/// What a request asks to do to one state.
#[derive(Clone)]
pub enum Change {
    /// Meltano `set` (PUT): the document replaces the state.
    Replace(StateDocument),
    /// Meltano `update` (PATCH): see [`StateDocument::updated_by`]; a
    /// missing state is created.
    Update(StateDocument),
    /// Remove one stream's bookmark from both halves of an existing state.
    ResetStream(String),
    /// Delete the state; deleting what does not exist changes nothing.
    Delete,
    /// Delete it as one match of a delete by pattern: as `Delete`, but so
    /// recorded in its history.
    DeleteByPattern,
    /// Roll back to a version: its document, or None for a tombstone.
    Restore(Option<StateDocument>),
    /// One entry of a bulk import: replaces the state, as a PUT does.
    Import(StateDocument),
    /// One id of a restore to an instant: the document it had then (None:
    /// it did not exist) and the version that held it, which history keeps.
    RestoreAt(Option<StateDocument>, Option<Version>),
}

impl Change {
    pub fn operation(&self) -> Operation {
        match self {
            Self::Replace(_) => Operation::Put,
            Self::Update(_) => Operation::Patch,
            Self::ResetStream(_) => Operation::ResetStream,
            Self::Delete => Operation::Delete,
            Self::DeleteByPattern => Operation::DeleteByPattern,
            Self::Restore(_) => Operation::Rollback,
            Self::Import(_) => Operation::Import,
            Self::RestoreAt(..) => Operation::Restore,
        }
    }

    /// The version a restore brings back.
    fn restored_from(&self) -> Option<Version> {
        match self {
            Self::RestoreAt(_, from) => *from,
            _ => None,
        }
    }

    /// Rollbacks, stream resets and deletes are deliberate: a bookmark they
    /// move backwards is recorded, never refused, and one they drop is
    /// neither (dropping bookmarks is what they are for).
    fn refusable(&self) -> bool {
        matches!(self, Self::Replace(_) | Self::Update(_) | Self::Import(_))
    }

    /// Whether the bookmarks it drops are looked for (and recorded): in the
    /// changes that may be refused, and in a restore, whose losses are
    /// recorded though never refused.
    fn looks_for_losses(&self) -> bool {
        self.refusable() || matches!(self, Self::RestoreAt(..))
    }
}

/// The rules a change is held to besides the lock's.
pub struct Policy<'a> {
    pub if_match: Option<&'a IfMatch>,
    pub guard: GuardModes,
    /// The streams the request lets go back or away.
    pub allowed: &'a Allowed,
    /// Whether history is kept (it records each version's changed streams).
    pub history: bool,
}

/// A change decided and ready to go out.
pub struct Prepared {
    pub version: Version,
    pub operation: Operation,
    /// The row the state becomes, with the state as answered; None when
    /// the state goes (a tombstone in history, its row deleted).
    pub written: Option<(StoredRow, StoredState)>,
    /// Empty with history off, which records none.
    pub changed_streams: Vec<String>,
    /// Streams whose bookmarks the change moves backwards (recorded, and
    /// answered in `Statehouse-Bookmark-Regression`).
    pub regressed_streams: Vec<String>,
    /// How many regressions the bookmark guard found (partitions counted one
    /// by one), for the metric.
    pub regressions_found: usize,
    /// Streams whose bookmarks the change drops (recorded, and answered in
    /// `Statehouse-Bookmark-Loss`).
    pub lost_streams: Vec<String>,
    /// How many bookmarks it drops (partitions counted one by one), for
    /// the metric.
    pub losses_found: usize,
    /// Whether the state did not exist before.
    pub created: bool,
    /// The version a restore brings back.
    pub restored_from: Option<Version>,
}

/// Decides `change` of `id` against its `current` row. `failed` is the
/// version of an earlier write of the id that failed but may have landed,
/// and `now_ms` this gateway's clock: the version stamped comes after both
/// and after the current row's. Answers None when there is nothing to
/// write: a delete of a state that does not exist.
pub fn prepare(
    id: &StateId,
    current: Option<&StoredRow>,
    change: Change,
    policy: &Policy<'_>,
    failed: Option<Version>,
    now_ms: i64,
) -> Result<Option<Prepared>, StateError> {
    if let Some(precondition) = policy.if_match
        && !precondition.holds_for(current.map(StoredRow::etag).as_ref())
    {
        return Err(StateError::precondition_failed(current.is_some()));
    }
    let operation = change.operation();
    let refusable = change.refusable();
    let losses = change.looks_for_losses();
    let restored_from = change.restored_from();
    let before = before(current, &change, policy)?;
    let after = match change {
        Change::Replace(doc)
        | Change::Import(doc)
        | Change::Restore(Some(doc))
        | Change::RestoreAt(Some(doc), _) => Some(doc),
        Change::Update(doc) => Some(StateDocument::updated_by(before.clone(), doc)),
        Change::ResetStream(stream) => {
            let Some(before) = &before else {
                return Err(StateError::NotFound(id.as_str().to_owned()));
            };
            Some(
                before
                    .without_stream(&stream)
                    .ok_or(StateError::NoBookmark(stream))?,
            )
        }
        Change::Delete
        | Change::DeleteByPattern
        | Change::Restore(None)
        | Change::RestoreAt(None, _)
            if current.is_none() =>
        {
            return Ok(None);
        }
        Change::Delete
        | Change::DeleteByPattern
        | Change::Restore(None)
        | Change::RestoreAt(None, _) => None,
    };
    let found = guarded(before.as_ref(), after.as_ref(), (refusable, losses), policy)?;
    let changed_streams = if policy.history {
        StateDocument::changed_streams(before.as_ref(), after.as_ref())
    } else {
        Vec::new()
    };
    let version = next_version(current, failed, now_ms);
    Ok(Some(Prepared {
        version,
        operation,
        written: after.map(|doc| StoredRow::written(id, doc, version)),
        changed_streams,
        regressed_streams: found.regressed_streams(),
        regressions_found: found.regressions.len(),
        lost_streams: found.lost_streams(),
        losses_found: found.losses.len(),
        created: current.is_none(),
        restored_from,
    }))
}

/// The current state, parsed only when the change needs it: PATCH and a
/// stream reset build on it (and refuse one that is unreadable); history's
/// changed streams and the bookmark guard compare against it (an
/// unreadable one, written by something else, changed every stream). A
/// replacement that neither history nor the guard looks at needs none.
fn before(
    current: Option<&StoredRow>,
    change: &Change,
    policy: &Policy<'_>,
) -> Result<Option<StateDocument>, StateError> {
    let Some(current) = current else {
        return Ok(None);
    };
    let lenient = || current.clone().parse().ok().map(|s| s.doc);
    Ok(match change {
        Change::Update(_) | Change::ResetStream(_) => Some(current.clone().parse()?.doc),
        Change::Replace(_)
        | Change::Import(_)
        | Change::Restore(Some(_))
        | Change::RestoreAt(Some(_), _)
            if !policy.history && policy.guard == GuardModes::off() =>
        {
            None
        }
        Change::Delete
        | Change::DeleteByPattern
        | Change::Restore(None)
        | Change::RestoreAt(None, _)
            if !policy.history =>
        {
            None
        }
        _ => lenient(),
    })
}

/// What the bookmark guard finds in a change, as far as its modes look:
/// refused when a kind in reject mode finds a stream the request does not
/// allow, in a change that may be refused. Losses are looked for only when
/// `losses` says.
fn guarded(
    before: Option<&StateDocument>,
    after: Option<&StateDocument>,
    (refusable, losses): (bool, bool),
    policy: &Policy<'_>,
) -> Result<Findings, StateError> {
    let (Some(before), Some(after)) = (before, after) else {
        return Ok(Findings::default());
    };
    let GuardModes { regression, loss } = policy.guard;
    let loss = if losses { loss } else { GuardMode::Off };
    if regression == GuardMode::Off && loss == GuardMode::Off {
        return Ok(Findings::default());
    }
    let mut found = Findings::of(before, after);
    if regression == GuardMode::Off {
        found.regressions.clear();
    }
    if loss == GuardMode::Off {
        found.losses.clear();
    }
    let refused = |mode: GuardMode, allowed: &AllowedStreams, stream: &str| {
        refusable && mode == GuardMode::Reject && !allowed.allows(stream)
    };
    if found
        .regressions
        .iter()
        .any(|r| refused(regression, &policy.allowed.regressions, &r.stream))
    {
        return Err(StateError::BookmarkRegression(found.regressions));
    }
    if found
        .losses
        .iter()
        .any(|l| refused(loss, &policy.allowed.losses, &l.stream))
    {
        return Err(StateError::BookmarkLoss(found.losses));
    }
    Ok(found)
}

#[cfg(test)]
mod tests;
