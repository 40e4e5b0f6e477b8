//! `statehouse wait`'s one request: `GET /v1/states/{id}?wait=D`, with
//! `If-None-Match` once it knows an ETag, on the client and problem reading
//! that `statehouse lock` uses.

use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::{ETAG, IF_NONE_MATCH};

use crate::client::{Bearer, Connection, error_chain, path_segment, read_body, retry_after};
use crate::run_lease::problem::Answer;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Beyond the wait asked for: the gateway may answer up to a sixteenth of
/// it late (jitter), and the read itself takes a ClickHouse round trip.
const ANSWER_MARGIN: Duration = Duration::from_secs(15);
/// A state is no larger than a body the gateway took (`--body-limit`, 16 MiB
/// by default): this bounds an endless answer, not a state.
const MAX_ANSWER_BYTES: usize = 64 << 20;

/// What one long-poll saw.
#[derive(Debug)]
pub enum Seen {
    /// 200: the state, as it is now, with its ETag.
    State {
        /// The ETag of this version, as `If-None-Match` takes it.
        etag: String,
        /// The answer's body: `{"state_id","completed","partial","updated_at"}`.
        body: Vec<u8>,
    },
    /// 304: still the version of the ETag sent, at the end of the wait.
    Unchanged,
    /// 404: no such state (deleted, or never created by the end of the wait).
    Absent,
}

/// Why a long-poll saw nothing.
#[derive(Debug)]
pub enum Failure {
    /// No answer: no connection, or one that broke off or timed out. Worth
    /// asking again for a while (a gateway restarting), not for ever (a
    /// typo in the URL): why, naming the gateway.
    Unreachable(String),
    /// The gateway answered 503 or 429: asked again after `after` when it
    /// said (`Retry-After`), for as long as it keeps answering so.
    Busy {
        /// The gateway's `Retry-After`, when it sent one.
        after: Option<Duration>,
        /// What it answered, for the line on stderr.
        why: String,
    },
    /// Asking again would get the same (a bad token, a scope, a bad id).
    Refused(String),
}

/// The long-poll of one state on one gateway.
pub struct Poller {
    /// Pooled: each long-poll reuses the last one's connection.
    client: reqwest::Client,
    /// The state's URL, without the query.
    url: String,
    /// The gateway's base URL, as a failure names it.
    gateway: String,
    /// The bearer token, if any, read again for each poll.
    token: Bearer,
}

impl Poller {
    pub fn new(connection: &Connection, state_id: &str) -> Result<Self, String> {
        let client = crate::client::builder(&connection.tls)?
            .tcp_nodelay(true)
            .connect_timeout(CONNECT_TIMEOUT)
            .user_agent(concat!("statehouse-wait/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| format!("cannot set up the HTTP client: {}", error_chain(&e)))?;
        Ok(Self {
            client,
            url: format!(
                "{}/v1/states/{}",
                connection.base.as_str(),
                path_segment(state_id)
            ),
            gateway: connection.base.as_str().to_owned(),
            token: connection.token.clone(),
        })
    }

    /// One long-poll of up to `wait`: with `etag`, it answers when the state
    /// is no longer that version; without, at once for a state that exists,
    /// when it is created for one that does not.
    pub async fn poll(&self, etag: Option<&str>, wait: Duration) -> Result<Seen, Failure> {
        let mut request = self
            .client
            .get(&self.url)
            .query(&[("wait", format!("{}ms", wait.as_millis()))])
            .timeout(wait + ANSWER_MARGIN);
        request = self.token.authorize(request);
        if let Some(etag) = etag {
            request = request.header(IF_NONE_MATCH, etag);
        }
        let response = request.send().await.map_err(|e| {
            Failure::Unreachable(format!(
                "cannot reach the gateway at {}: {}",
                self.gateway,
                error_chain(&e)
            ))
        })?;
        let status = response.status();
        let etag = response
            .headers()
            .get(ETAG)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let answer = Answer {
            status,
            retry_after: retry_after(response.headers()),
            body: read_body(response, MAX_ANSWER_BYTES).await.map_err(|why| {
                Failure::Unreachable(format!("{why} (the gateway at {})", self.gateway))
            })?,
        };
        match (status, etag) {
            (StatusCode::OK, Some(etag)) => Ok(Seen::State {
                etag,
                body: answer.body,
            }),
            (StatusCode::NOT_MODIFIED, _) => Ok(Seen::Unchanged),
            (StatusCode::NOT_FOUND, _) => Ok(Seen::Absent),
            (StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS, _) => {
                Err(Failure::Busy {
                    after: answer.retry_after,
                    why: format!(
                        "the gateway answered {status} ({})",
                        answer.problem().summary()
                    ),
                })
            }
            (StatusCode::OK, None) => Err(Failure::Refused(
                "the gateway answered 200 without an ETag: is it a statehouse?".into(),
            )),
            _ => Err(Failure::Refused(format!(
                "the gateway answered {status} ({})",
                answer.problem().summary()
            ))),
        }
    }
}
