//! The change feed as Server-Sent Events (`GET /v1/changes` with `Accept:
//! text/event-stream`): each change an `event: change` whose `data` is its
//! JSON and whose `id` is the cursor after it, so `Last-Event-ID` resumes
//! right after it.
//!
//! Only the gateway's own text goes in `id` and `event` (a hex cursor and a
//! constant): a state_id may hold CR, LF or NUL, which the JSON in `data`
//! escapes and an `id` line could not carry. A stream counts as a watcher
//! for its whole life (see `admission`), ends at once when the gateway
//! stops, and ends when its token expires or a reload takes it away.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde::Serialize;
use tokio::time::Instant;

use super::error::ApiError;
use super::wire::rfc3339_millis;
use crate::auth::jwt::looks_like_jwt;
use crate::auth::live::LiveTokens;
use crate::auth::{Grant, Identified, Role};
use crate::domain::{Scope, StateId};
use crate::states::{Delivered, Feed, Follow, Follower};

/// How often a quiet stream sends a comment: the contract's bound is 15 s,
/// and a proxy's idle timeout is often not much more.
const KEEP_ALIVE: Duration = Duration::from_secs(10);

/// How long a stream waits for changes before it looks at its token and
/// the gateway's stop again.
const TURN: Duration = Duration::from_secs(1);

/// One change as the feed answers it, in JSON and in an event's `data`.
#[derive(Serialize)]
pub(super) struct ChangeOut {
    state_id: StateId,
    /// The ETag `GET` sends now; null when deleted.
    etag: Option<String>,
    deleted: bool,
    /// RFC 3339 with milliseconds.
    updated_at: String,
}

impl From<Delivered> for ChangeOut {
    fn from(change: Delivered) -> Self {
        Self {
            state_id: change.id,
            etag: change.etag.map(|etag| etag.as_str().to_owned()),
            deleted: change.deleted,
            updated_at: rfc3339_millis(change.updated_at_ms),
        }
    }
}

/// What a stream's request was let in with, checked again every turn.
pub(super) struct Credentials {
    /// The tokens in use, replaced by a reload.
    pub tokens: Arc<LiveTokens>,
    /// The bearer token presented; None on a gateway without tokens.
    pub presented: Option<String>,
    /// The scope the stream shows.
    pub scope: Scope,
}

impl Credentials {
    /// Whether the token still lets this stream go on: not expired, not
    /// reloaded away, still a reader with the same scope. A stream let in
    /// without tokens ends once tokens are configured.
    fn still_hold(&self) -> bool {
        let tokens = self.tokens.current();
        let Some(presented) = &self.presented else {
            return !self.tokens.required();
        };
        let holds = |grant: Grant| grant.role >= Role::Read && grant.scope == self.scope;
        match tokens.identify(presented, SystemTime::now()) {
            Identified::Valid(grant) => holds(grant),
            Identified::Expired(_) => false,
            // A JWT is checked with the keys at hand: a stream never makes
            // its issuer's keys be fetched.
            Identified::Unknown => self.tokens.jwt().is_some_and(|jwt| {
                looks_like_jwt(presented) && jwt.identify_cached(presented).is_ok_and(holds)
            }),
        }
    }
}

/// A stream's state between its events.
struct Streaming {
    /// Where it reads.
    feed: Feed,
    /// Its place among the followers, for its whole life.
    follower: Follower,
    /// What it follows; `since` moves on with every answer.
    follow: Follow,
    /// Events read but not yet sent.
    pending: VecDeque<Event>,
    credentials: Credentials,
}

/// The stream of `follow`'s changes; a first call's cursor when it has no
/// `since`.
pub(super) async fn stream(
    feed: &Feed,
    mut follow: Follow,
    credentials: Credentials,
) -> Result<Response, ApiError> {
    if follow.since.is_none() {
        follow.since = Some(feed.first(&follow).await?.cursor);
    }
    let streaming = Streaming {
        feed: feed.clone(),
        follower: feed.follow(),
        follow,
        pending: VecDeque::new(),
        credentials,
    };
    let events = stream::unfold(streaming, |mut streaming| async move {
        let event = streaming.next_event().await?;
        Some((Ok::<_, Infallible>(event), streaming))
    });
    let keep_alive = KeepAlive::new().interval(KEEP_ALIVE);
    Ok(Sse::new(events).keep_alive(keep_alive).into_response())
}

impl Streaming {
    /// The next event, or None when the stream ends.
    async fn next_event(&mut self) -> Option<Event> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(event);
            }
            if self.feed.closing() || !self.credentials.still_hold() {
                return None;
            }
            self.follow.deadline = Instant::now() + TURN;
            match self.feed.next(&self.follower, &self.follow).await {
                Ok(delivery) => {
                    for change in delivery.changes {
                        let id = change.cursor.encode(&self.follow.pattern);
                        match Event::default()
                            .event("change")
                            .id(id)
                            .json_data(ChangeOut::from(change))
                        {
                            Ok(event) => self.pending.push_back(event),
                            Err(err) => {
                                tracing::error!(error = %err, "feed: a change could not be written as an event")
                            }
                        }
                    }
                    self.follow.since = Some(delivery.cursor);
                }
                Err(err) => {
                    tracing::warn!(error = %err, "feed: a stream's read failed; trying again in a second");
                    tokio::time::sleep(TURN).await;
                }
            }
        }
    }
}
