//! The runner's HTTP client for the gateway's lock API: reqwest over HTTP or
//! HTTPS (see `crate::client`), one pooled connection reused for every renewal.

use std::time::Duration;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use reqwest::header::{CONTENT_TYPE, RETRY_AFTER};
use reqwest::{Method, StatusCode};
use serde::Deserialize;
use tokio::time::Instant;
use url::Url;

use crate::client::{TlsFiles, error_chain};

/// The body of an answer, as read.
type Bytes = Vec<u8>;

/// A path segment keeps only RFC 3986's unreserved characters as they are.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Below the gateway's default `--idle-timeout` (75 s), so a renewal does
/// not pick a connection the gateway is closing.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// An acquire may wait its `wait_seconds`, plus a claim settle (1 s by
/// default) and a few ClickHouse round trips.
const ACQUIRE_MARGIN: Duration = Duration::from_secs(15);
/// Lock answers are small; a larger one is not the gateway's.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// The gateway's base URL: `http[s]://host[:port][/path]`, without a trailing slash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatewayUrl(String);

impl GatewayUrl {
    pub fn parse(raw: &str) -> Result<Self, String> {
        let url = Url::parse(raw).map_err(|e| format!("{raw:?} is not a URL: {e}"))?;
        match url.scheme() {
            "http" | "https" => {}
            other => {
                return Err(format!(
                    "unsupported scheme {other:?}: use http://host:port or https://host:port"
                ));
            }
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(format!("{raw:?} names no host"));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err("the URL must not carry credentials: use --token".into());
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err("the URL must be a base URL, without a query".into());
        }
        Ok(Self(url.as_str().trim_end_matches('/').to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A lease the gateway granted.
#[derive(Clone, Debug)]
pub struct Lease {
    pub lease_id: String,
    pub fencing_token: u64,
    /// When the acquire that got it was sent: the gateway granted it no
    /// earlier, so counting its TTL from here never outlives the gateway's.
    pub sent: Instant,
    /// Whether that acquire waited in line: then the grant may have come
    /// any time between `sent` and its answer.
    pub waited: bool,
}

/// Who holds a lock, as the gateway names them.
#[derive(Clone, Debug, Deserialize)]
pub struct Holder {
    pub owner: String,
    pub acquired_at: String,
    pub expires_at: String,
    /// What the holder said of itself; a gateway before `info` sends none.
    #[serde(default)]
    pub info: serde_json::Map<String, serde_json::Value>,
}

impl Holder {
    /// The command the holder runs, when its info names one (as `statehouse lock`'s does).
    pub fn command(&self) -> Option<&str> {
        self.info.get("command").and_then(serde_json::Value::as_str)
    }
}

pub enum Acquired {
    Granted(Lease),
    /// Held by another for the whole wait; the holder, when the gateway could name it.
    Held(Option<Holder>),
    /// In the lock-delay after a lost lease, past the wait: no lease is
    /// granted before `free_at` (RFC 3339, as the gateway wrote it).
    Delayed {
        free_at: String,
    },
}

/// A 409 to an acquire that means busy: held by another, or in its lock-delay.
fn busy(answer: &Answer) -> Option<Acquired> {
    if answer.status != StatusCode::CONFLICT {
        return None;
    }
    let problem = answer.problem();
    if problem.is("lock-held") {
        Some(Acquired::Held(problem.holder))
    } else if problem.is("lock-delay") {
        Some(Acquired::Delayed {
            free_at: problem
                .free_at
                .unwrap_or_else(|| "a time the gateway did not name".into()),
        })
    } else {
        None
    }
}

/// The gateway's verdict on a renewal or a release.
pub enum Verdict {
    Done,
    /// The lease is not the current one (force-unlocked, expired or released).
    NotCurrent(String),
}

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("cannot reach the gateway at {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("the gateway at {url} answered {request} with {status} ({detail})")]
    Refused {
        url: String,
        request: String,
        status: u16,
        detail: String,
    },
    /// A 503 that did nothing and says when to come back.
    #[error("the gateway at {url} is unavailable ({detail})")]
    Busy {
        url: String,
        detail: String,
        retry_after: Duration,
    },
}

#[derive(Deserialize)]
struct Granted {
    lease_id: String,
    fencing_token: u64,
}

#[derive(Deserialize, Default)]
struct Problem {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(default)]
    title: String,
    #[serde(default)]
    detail: String,
    holder: Option<Holder>,
    /// When a lock-delay ends (`lock-delay` problems).
    free_at: Option<String>,
}

impl Problem {
    fn is(&self, slug: &str) -> bool {
        self.kind
            .strip_prefix("urn:statehouse:problem:")
            .is_some_and(|kind| kind == slug)
    }

    fn summary(&self) -> String {
        match (self.title.is_empty(), self.detail.is_empty()) {
            (false, false) => format!("{}: {}", self.title, self.detail),
            (false, true) => self.title.clone(),
            (true, false) => self.detail.clone(),
            (true, true) => "no detail".into(),
        }
    }
}

struct Answer {
    status: StatusCode,
    retry_after: Option<Duration>,
    body: Bytes,
}

impl Answer {
    fn problem(&self) -> Problem {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| Problem {
            detail: String::from_utf8_lossy(&self.body[..self.body.len().min(200)]).into_owned(),
            ..Problem::default()
        })
    }
}

#[derive(Clone)]
pub struct Gateway {
    client: reqwest::Client,
    base: GatewayUrl,
    token: Option<String>,
}

impl Gateway {
    /// A client for the gateway at `base`, with the TLS that `tls` names;
    /// an error says why the files cannot be used.
    pub fn new(base: GatewayUrl, token: Option<String>, tls: &TlsFiles) -> Result<Self, String> {
        let client = crate::client::builder(tls)?
            .http1_only()
            .tcp_nodelay(true)
            .connect_timeout(CONNECT_TIMEOUT)
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .user_agent(concat!("statehouse-lock/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| format!("cannot set up the HTTP client: {}", error_chain(&e)))?;
        Ok(Self {
            client,
            base,
            token: token.filter(|t| !t.is_empty()),
        })
    }

    /// One acquire, waiting up to `wait` in the gateway's queue.
    pub async fn acquire(
        &self,
        id: &str,
        owner: &str,
        ttl: Duration,
        wait: Duration,
        lock_delay: Duration,
        info: &serde_json::Value,
    ) -> Result<Acquired, GatewayError> {
        let path = format!("/v1/locks/{}", segment(id));
        let body = serde_json::json!({
            "owner": owner,
            "ttl_seconds": ttl.as_secs(),
            "wait_seconds": wait.as_secs_f64(),
            // Whole seconds, rounded up: the delay is a floor for the next run.
            "lock_delay_seconds": lock_delay.as_secs() + u64::from(lock_delay.subsec_nanos() > 0),
            "info": info,
        });
        let sent = Instant::now();
        let answer = self
            .call(Method::POST, &path, Some(body), Some(wait + ACQUIRE_MARGIN))
            .await?;
        match answer.status {
            StatusCode::CREATED => {
                let granted: Granted = serde_json::from_slice(&answer.body).map_err(|e| {
                    self.refused(
                        &Method::POST,
                        &path,
                        &answer,
                        format!("unreadable lease: {e}"),
                    )
                })?;
                Ok(Acquired::Granted(Lease {
                    lease_id: granted.lease_id,
                    fencing_token: granted.fencing_token,
                    sent,
                    waited: !wait.is_zero(),
                }))
            }
            _ => busy(&answer).ok_or_else(|| self.error(&Method::POST, &path, &answer)),
        }
    }

    /// Renews the lease for another `ttl`.
    pub async fn renew(
        &self,
        id: &str,
        lease_id: &str,
        ttl: Duration,
    ) -> Result<Verdict, GatewayError> {
        let body = serde_json::json!({ "ttl_seconds": ttl.as_secs() });
        self.lease_call(Method::PUT, id, lease_id, Some(body), StatusCode::OK)
            .await
    }

    pub async fn release(&self, id: &str, lease_id: &str) -> Result<Verdict, GatewayError> {
        self.lease_call(Method::DELETE, id, lease_id, None, StatusCode::NO_CONTENT)
            .await
    }

    async fn lease_call(
        &self,
        method: Method,
        id: &str,
        lease_id: &str,
        body: Option<serde_json::Value>,
        done: StatusCode,
    ) -> Result<Verdict, GatewayError> {
        let path = format!("/v1/locks/{}/{}", segment(id), segment(lease_id));
        // The caller bounds the whole call by the lease's life.
        let answer = self.call(method.clone(), &path, body, None).await?;
        if answer.status == done {
            return Ok(Verdict::Done);
        }
        let problem = answer.problem();
        // `lease-held-elsewhere`: this gateway cannot reach the lease's
        // authority, which still holds it; no verdict on the lease.
        if answer.status == StatusCode::CONFLICT && !problem.is("lease-held-elsewhere") {
            return Ok(Verdict::NotCurrent(problem.summary()));
        }
        Err(self.error(&method, &path, &answer))
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
        deadline: Option<Duration>,
    ) -> Result<Answer, GatewayError> {
        let unreachable = |reason: String| GatewayError::Unreachable {
            url: self.base.as_str().to_owned(),
            reason,
        };
        let mut request = self
            .client
            .request(method, format!("{}{path}", self.base.as_str()));
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        if let Some(json) = body {
            request = request
                .header(CONTENT_TYPE, "application/json")
                .body(json.to_string());
        }
        let exchange =
            async {
                let mut response = request
                    .send()
                    .await
                    .map_err(|e| unreachable(error_chain(&e)))?;
                let status = response.status();
                let retry_after = response
                    .headers()
                    .get(RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map(Duration::from_secs);
                let mut body = Bytes::new();
                while let Some(chunk) = response.chunk().await.map_err(|e| {
                    unreachable(format!("the answer broke off: {}", error_chain(&e)))
                })? {
                    if body.len() + chunk.len() > MAX_ANSWER_BYTES {
                        return Err(unreachable(format!(
                            "the answer is over {MAX_ANSWER_BYTES} bytes"
                        )));
                    }
                    body.extend_from_slice(&chunk);
                }
                Ok(Answer {
                    status,
                    retry_after,
                    body,
                })
            };
        let Some(deadline) = deadline else {
            return exchange.await;
        };
        tokio::time::timeout(deadline, exchange)
            .await
            .unwrap_or_else(|_| {
                Err(unreachable(format!(
                    "no answer within {}",
                    humantime::format_duration(deadline)
                )))
            })
    }

    fn error(&self, method: &Method, path: &str, answer: &Answer) -> GatewayError {
        let problem = answer.problem();
        let retriable = problem.is("overloaded") || problem.is("authority-unreachable");
        match answer.retry_after {
            Some(retry_after) if answer.status == StatusCode::SERVICE_UNAVAILABLE && retriable => {
                GatewayError::Busy {
                    url: self.base.as_str().to_owned(),
                    detail: problem.summary(),
                    retry_after: retry_after.max(Duration::from_millis(100)),
                }
            }
            _ => self.refused(method, path, answer, problem.summary()),
        }
    }

    fn refused(
        &self,
        method: &Method,
        path: &str,
        answer: &Answer,
        detail: String,
    ) -> GatewayError {
        GatewayError::Refused {
            url: self.base.as_str().to_owned(),
            request: format!("{method} {path}"),
            status: answer.status.as_u16(),
            detail,
        }
    }
}

fn segment(raw: &str) -> String {
    utf8_percent_encode(raw, SEGMENT).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_ids_are_one_path_segment() {
        assert_eq!(
            segment("dev:tap-x-to-target_y.v2~"),
            "dev%3Atap-x-to-target_y.v2~"
        );
        assert_eq!(segment("a/b c?d%"), "a%2Fb%20c%3Fd%25");
        assert_eq!(segment("é"), "%C3%A9");
    }

    #[test]
    fn base_urls_keep_their_path_without_a_trailing_slash() {
        let parse = |raw| GatewayUrl::parse(raw).map(|u| u.as_str().to_owned());
        assert_eq!(parse("http://gw:8080").unwrap(), "http://gw:8080");
        assert_eq!(parse("http://gw:8080/").unwrap(), "http://gw:8080");
        assert_eq!(
            parse("http://gw/statehouse/").unwrap(),
            "http://gw/statehouse"
        );
        assert_eq!(parse("https://gw:8443/").unwrap(), "https://gw:8443");
        assert!(
            parse("ftp://gw")
                .unwrap_err()
                .contains("unsupported scheme")
        );
    }

    #[test]
    fn problems_are_read_by_their_type() {
        let answer = Answer {
            status: StatusCode::CONFLICT,
            retry_after: None,
            body: Bytes::from(
                br#"{"type":"urn:statehouse:problem:lock-held","title":"Lock held by another owner","status":409,"detail":"x","holder":{"state_id":"j","owner":"cron@a:1","fencing_token":3,"acquired_at":"2026-01-01T00:00:00.000Z","expires_at":"2026-01-01T00:00:30.000Z","gateway_id":"g"}}"#,
            ),
        };
        let problem = answer.problem();
        assert!(problem.is("lock-held") && !problem.is("lock"));
        let holder = problem.holder.unwrap();
        assert_eq!(holder.owner, "cron@a:1");
        assert_eq!(holder.command(), None);
        let with_info: Holder = serde_json::from_str(
            r#"{"owner":"o","acquired_at":"a","expires_at":"b","info":{"command":"meltano run t"}}"#,
        )
        .unwrap();
        assert_eq!(with_info.command(), Some("meltano run t"));
        let garbage = Answer {
            status: StatusCode::BAD_GATEWAY,
            retry_after: None,
            body: Bytes::from(b"<html>bad gateway</html>"),
        };
        assert_eq!(garbage.problem().summary(), "<html>bad gateway</html>");
    }

    #[test]
    fn a_lock_delay_is_busy_until_its_free_at() {
        let answer = |status, body: &str| Answer {
            status,
            retry_after: None,
            body: Bytes::from(body.as_bytes()),
        };
        let delayed = answer(
            StatusCode::CONFLICT,
            r#"{"type":"urn:statehouse:problem:lock-delay","title":"In lock-delay","status":409,"detail":"the last lease was lost","free_at":"2026-12-05T01:00:15.000Z"}"#,
        );
        match busy(&delayed) {
            Some(Acquired::Delayed { free_at }) => assert_eq!(free_at, "2026-12-05T01:00:15.000Z"),
            _ => panic!("a lock-delay is busy"),
        }
        let unnamed = answer(
            StatusCode::CONFLICT,
            r#"{"type":"urn:statehouse:problem:lock-delay","status":409}"#,
        );
        assert!(
            matches!(busy(&unnamed), Some(Acquired::Delayed { free_at }) if free_at.contains("did not name"))
        );
        let held = answer(
            StatusCode::CONFLICT,
            r#"{"type":"urn:statehouse:problem:lock-held","status":409,"holder":{"owner":"cron","acquired_at":"a","expires_at":"b"}}"#,
        );
        assert!(matches!(busy(&held), Some(Acquired::Held(Some(h))) if h.owner == "cron"));
        // Another conflict, or the same type with another status, is not busy.
        let other = answer(
            StatusCode::CONFLICT,
            r#"{"type":"urn:statehouse:problem:lease-held-elsewhere","status":409}"#,
        );
        assert!(busy(&other).is_none());
        let unavailable = answer(
            StatusCode::SERVICE_UNAVAILABLE,
            r#"{"type":"urn:statehouse:problem:lock-delay","status":503}"#,
        );
        assert!(busy(&unavailable).is_none());
    }
}
