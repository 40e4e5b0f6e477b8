//! The bookmark guard: what a write does to the bookmarks under
//! `singer_state.bookmarks` of the stored effective state (partial merged
//! over completed), found in one walk of the two documents, stream by
//! stream and, for partitioned bookmarks, partition by partition (paired by
//! context).
//!
//! - A regression: a `replication_key_value` that moves backwards under an
//!   unchanged `replication_key` (see `order` for what orders). Other
//!   values, a changed key, a new or removed stream are not regressions.
//! - A loss: a stream (or partition) with a bookmark before and none after:
//!   the stream gone, its value gone (or null), one of its partitions gone,
//!   or the whole state emptied. A changed key with a value, a new stream,
//!   or a value that moves (even backwards) is not a loss.

mod order;
#[cfg(test)]
mod tests;

use std::cmp::Ordering;

use serde::Serialize;

use super::json::Text;
use super::{Json, JsonObject, StateDocument};

pub use order::compare_values;

/// What a gateway does with a write the guard flags, for each kind
/// (`--bookmark-regression`, `--bookmark-loss`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum GuardMode {
    /// Write it, and say so: an answer header, a log line, a metric.
    #[default]
    Warn,
    /// Refuse it with 409, unless the request allows the streams.
    Reject,
    /// Compare nothing.
    Off,
}

/// The streams a request lets through the guard
/// (`Statehouse-Allow-Regression`, `Statehouse-Allow-Loss`): a
/// comma-separated list of names, or `*` for all.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum AllowedStreams {
    #[default]
    None,
    All,
    Streams(Vec<String>),
}

impl AllowedStreams {
    pub fn parse(header: &str) -> Self {
        let streams: Vec<String> = header
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        if streams.iter().any(|s| s == "*") {
            Self::All
        } else if streams.is_empty() {
            Self::None
        } else {
            Self::Streams(streams)
        }
    }

    pub fn allows(&self, stream: &str) -> bool {
        match self {
            Self::None => false,
            Self::All => true,
            Self::Streams(streams) => streams.iter().any(|s| s == stream),
        }
    }
}

/// What a gateway does with each kind the guard finds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GuardModes {
    /// `--bookmark-regression`.
    pub regression: GuardMode,
    /// `--bookmark-loss`.
    pub loss: GuardMode,
}

impl GuardModes {
    /// Both kinds off: the guard compares nothing.
    pub fn off() -> Self {
        Self {
            regression: GuardMode::Off,
            loss: GuardMode::Off,
        }
    }
}

/// The streams a request lets through, for each kind the guard finds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allowed {
    /// `Statehouse-Allow-Regression`: streams whose bookmarks may go back.
    pub regressions: AllowedStreams,
    /// `Statehouse-Allow-Loss`: streams whose bookmarks may go away.
    pub losses: AllowedStreams,
}

type Raw = Box<serde_json::value::RawValue>;

/// One stream's (or one partition's) bookmark that went backwards, with its
/// values as the documents wrote them.
#[derive(Clone, Debug, Serialize)]
pub struct Regression {
    pub stream: String,
    /// The stored `replication_key_value`.
    pub from: Raw,
    /// The one the write sends.
    pub to: Raw,
    /// The partition's context, for a partitioned bookmark.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<Json>,
}

/// One stream's (or one partition's) bookmark that the write drops, with
/// the value it had as stored.
#[derive(Clone, Debug, Serialize)]
pub struct Loss {
    /// The stream whose bookmark (or one of whose partitions) goes.
    pub stream: String,
    /// The stored `replication_key_value` (the partition's, for a lost
    /// partition).
    pub from: Raw,
    /// The lost partition's context, for a partitioned bookmark.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<Json>,
}

/// One partition of a partitioned bookmark as the guard pairs it: its
/// `context` and its `replication_key_value` as stored (None when it has
/// none), what a 409 `bookmark-loss` names for a lost partition.
#[derive(Clone, Debug, Serialize)]
pub struct PartitionValue {
    pub context: Option<Json>,
    pub replication_key_value: Option<Json>,
}

/// A stream's partitions, each with its context and value, when its
/// bookmark (`bookmark`, the stream's object) is partitioned; None when it
/// is not. Items that are no object are passed over, as the guard does.
pub fn partition_values(bookmark: &Json) -> Option<Vec<PartitionValue>> {
    let Json::Object(bookmark) = bookmark else {
        return None;
    };
    let all = partitions(bookmark)?;
    Some(
        all.into_iter()
            .filter_map(|p| match p {
                Json::Object(p) => Some(PartitionValue {
                    context: p.get("context").cloned(),
                    replication_key_value: value(&p).map(|v| Json::Raw(v.clone())),
                }),
                Json::Raw(_) => None,
            })
            .collect(),
    )
}

/// What the guard found in a write, each list in stream byte order.
#[derive(Debug, Default)]
pub struct Findings {
    /// Bookmarks that went backwards.
    pub regressions: Vec<Regression>,
    /// Bookmarks that went away.
    pub losses: Vec<Loss>,
}

impl Findings {
    /// The regressions and losses of `after` against `before`, in one walk of
    /// the streams `before` has bookmarks for.
    pub fn of(before: &StateDocument, after: &StateDocument) -> Self {
        let mut found = Self::default();
        let Some(before) = before.bookmarks() else {
            return found;
        };
        // No bookmarks after (`{}`, empty halves): every stream went.
        let after = after.bookmarks().unwrap_or_default();
        for (stream, was) in before.iter() {
            let Json::Object(was) = was else {
                continue;
            };
            let now = match after.get(stream) {
                Some(Json::Object(now)) => Some(now.as_ref()),
                _ => None,
            };
            found.stream(stream, was, now);
        }
        found.regressions.sort_by(|a, b| a.stream.cmp(&b.stream));
        found.losses.sort_by(|a, b| a.stream.cmp(&b.stream));
        found
    }

    /// Compares one stream's bookmark before and after (None: gone).
    fn stream(&mut self, stream: &str, was: &JsonObject, now: Option<&JsonObject>) {
        let now_partitions = now.and_then(partitions);
        let Some(was_partitions) = partitions(was) else {
            // Partitioned from now on: the stream's own value is lost only
            // when no partition has one either.
            let moved_into_partitions = now_partitions.is_some()
                && now.is_some_and(|now| value(now).is_none() && has_bookmark(now));
            if !moved_into_partitions {
                self.compare(stream, was, now, None);
            }
            return;
        };
        if now_partitions.is_none() && now.and_then(value).is_some() {
            // One unpartitioned bookmark with a value from now on: the
            // stream keeps a bookmark, and its partitions have nothing to
            // be compared with.
            return;
        }
        for partition in &was_partitions {
            let Json::Object(partition) = partition else {
                continue;
            };
            let context = partition.get("context");
            let later = now_partitions.iter().flatten().find_map(|p| match p {
                Json::Object(p) if p.get("context") == context => Some(p.as_ref()),
                _ => None,
            });
            self.compare(stream, partition, later, context);
        }
    }

    /// Compares one bookmark (a stream's, or a partition's) before and after.
    fn compare(
        &mut self,
        stream: &str,
        was: &JsonObject,
        now: Option<&JsonObject>,
        context: Option<&Json>,
    ) {
        let Some(from) = value(was) else {
            return;
        };
        let Some((now, to)) = now.and_then(|now| Some((now, value(now)?))) else {
            self.lost(stream, from, context);
            return;
        };
        if was.get("replication_key").is_some()
            && now.get("replication_key") == was.get("replication_key")
            && compare_values(from.get(), to.get()) == Some(Ordering::Greater)
        {
            self.regressions.push(Regression {
                stream: stream.to_owned(),
                from: from.to_raw(),
                to: to.to_raw(),
                context: context.cloned(),
            });
        }
    }

    fn lost(&mut self, stream: &str, from: &Text, context: Option<&Json>) {
        self.losses.push(Loss {
            stream: stream.to_owned(),
            from: from.to_raw(),
            context: context.cloned(),
        });
    }

    /// The streams that went backwards, each once.
    pub fn regressed_streams(&self) -> Vec<String> {
        names(self.regressions.iter().map(|r| r.stream.as_str()))
    }

    /// The streams that lost a bookmark, each once.
    pub fn lost_streams(&self) -> Vec<String> {
        names(self.losses.iter().map(|l| l.stream.as_str()))
    }
}

/// Names in order, each once (the lists are sorted by stream).
fn names<'a>(streams: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut names: Vec<String> = streams.map(str::to_owned).collect();
    names.dedup();
    names
}

/// A bookmark's partitions; arrays are kept as text (see `json`), so they
/// are opened here.
fn partitions(bookmark: &JsonObject) -> Option<Vec<Json>> {
    bookmark.get("partitions").and_then(Json::items)
}

/// A bookmark's `replication_key_value` as written; a null one is none.
fn value(bookmark: &JsonObject) -> Option<&Text> {
    match bookmark.get("replication_key_value")? {
        Json::Raw(text) if text.get() != "null" => Some(text),
        _ => None,
    }
}

/// Whether a bookmark has a value of its own or in any partition.
fn has_bookmark(bookmark: &JsonObject) -> bool {
    value(bookmark).is_some()
        || partitions(bookmark).is_some_and(|all| {
            all.iter()
                .any(|p| matches!(p, Json::Object(p) if value(p).is_some()))
        })
}
