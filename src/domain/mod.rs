//! The service's vocabulary, parsed at the edge so the rest never re-checks it.

mod as_of;
mod bookmark_guard;
mod coordination;
mod document;
mod etag;
mod json;
mod json_parse;
mod lease;
mod lease_info;
mod page;
mod pattern;
mod provenance;
mod scope;
mod state_id;
mod version;
mod wait;

pub use as_of::{AsOf, InvalidAsOf};
pub use bookmark_guard::{
    Allowed, AllowedStreams, Findings, GuardMode, GuardModes, Loss, PartitionValue, Regression,
    compare_values, partition_values,
};
pub use coordination::Coordination;
pub use document::{BatchEntry, BatchError, CorruptState, DocumentError, StateDocument};
pub use etag::{ETag, IfMatch, IfNoneMatch};
pub use json::{Json, JsonObject};
pub use lease::{Lease, LeaseState, LeaseVersion};
pub use lease_info::{
    Forced, InfoError, LeaseInfo, MAX_INFO_BYTES, MAX_REASON_BYTES, parse_reason,
};
pub use page::{InvalidCursor, InvalidLimit, PageCursor, PageLimit};
pub use pattern::{PatternError, StatePattern};
pub use provenance::Provenance;
pub use scope::Scope;
pub use state_id::{StateId, StateIdError};
pub use version::{InvalidVersion, InvalidVersionCursor, Version, VersionCursor};
pub use wait::{InvalidWait, MAX_WAIT, Wait, parse_duration};
