//! The runner's HTTP client for the gateway's lease APIs (locks and pools):
//! reqwest over HTTP or HTTPS (see `crate::client`), pooled connections
//! reused for every renewal.

use std::time::Duration;

use reqwest::header::CONTENT_TYPE;
use reqwest::{Method, StatusCode};
use serde::Deserialize;
use tokio::time::Instant;

use super::problem::{Answer, Busy};
use super::target::Target;
use crate::client::{Bearer, Connection, GatewayUrl, error_chain, read_body, retry_after};
use crate::traces;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Below the gateway's default `--idle-timeout` (75 s), so a renewal does
/// not pick a connection the gateway is closing.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// An acquire may wait its `wait_seconds`, plus a claim settle (1 s by
/// default) and a few ClickHouse round trips.
const ACQUIRE_MARGIN: Duration = Duration::from_secs(15);
/// A run's record is asked once and never holds the command up longer.
const RUN_DEADLINE: Duration = Duration::from_secs(10);
/// Lease answers are small; a larger one is not the gateway's.
const MAX_ANSWER_BYTES: usize = 1 << 20;

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
    /// The lock-delay granted, in whole seconds: the one asked for, or the
    /// gateway's `--max-lock-delay` when that is less (none from a gateway
    /// that does not say).
    pub lock_delay_seconds: Option<u64>,
}

pub enum Acquired {
    Granted(Lease),
    /// No lease within the wait.
    Busy(Busy),
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
    lock_delay_seconds: Option<u64>,
}

/// A lock-delay in the gateway's whole seconds, rounded up: the delay is a
/// floor for the next run.
pub fn whole_seconds(delay: Duration) -> u64 {
    delay.as_secs() + u64::from(delay.subsec_nanos() > 0)
}

#[derive(Clone)]
pub struct Gateway {
    client: reqwest::Client,
    base: GatewayUrl,
    /// Read again for every call: renewals present a rotated token.
    token: Bearer,
}

impl Gateway {
    /// A client for the gateway `connection` names; an error says why its
    /// TLS files cannot be used.
    pub fn new(connection: &Connection) -> Result<Self, String> {
        let client = crate::client::builder(&connection.tls)?
            .http1_only()
            .tcp_nodelay(true)
            .connect_timeout(CONNECT_TIMEOUT)
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .user_agent(concat!("statehouse-lock/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| format!("cannot set up the HTTP client: {}", error_chain(&e)))?;
        Ok(Self {
            client,
            base: connection.base.clone(),
            token: connection.token.clone(),
        })
    }

    /// One acquire, waiting up to `wait` in the gateway's queue.
    pub async fn acquire(
        &self,
        target: &Target,
        owner: &str,
        ttl: Duration,
        wait: Duration,
        lock_delay: Duration,
        info: &serde_json::Value,
    ) -> Result<Acquired, GatewayError> {
        let path = target.path();
        let mut body = serde_json::json!({
            "owner": owner,
            "ttl_seconds": ttl.as_secs(),
            "wait_seconds": wait.as_secs_f64(),
            "lock_delay_seconds": whole_seconds(lock_delay),
            "info": info,
        });
        if let Some(serde_json::Value::Object(fields)) = target.acquire_fields() {
            body.as_object_mut().expect("an object").extend(fields);
        }
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
                    lock_delay_seconds: granted.lock_delay_seconds,
                }))
            }
            _ => answer
                .busy()
                .map(Acquired::Busy)
                .ok_or_else(|| self.error(&Method::POST, &path, &answer)),
        }
    }

    /// Renews the lease for another `ttl`.
    pub async fn renew(
        &self,
        target: &Target,
        lease_id: &str,
        ttl: Duration,
    ) -> Result<Verdict, GatewayError> {
        let body = serde_json::json!({ "ttl_seconds": ttl.as_secs() });
        self.lease_call(Method::PUT, target, lease_id, Some(body), StatusCode::OK)
            .await
    }

    pub async fn release(&self, target: &Target, lease_id: &str) -> Result<Verdict, GatewayError> {
        self.lease_call(
            Method::DELETE,
            target,
            lease_id,
            None,
            StatusCode::NO_CONTENT,
        )
        .await
    }

    /// Whether the lease with `fencing_token` still holds `target`, as
    /// `GET` of the lock or the pool shows it (never a lease_id, so the
    /// fencing token tells the lease): the id's authority answers that from
    /// memory, so asking every second costs ClickHouse nothing. `deadline`
    /// bounds the whole call.
    pub async fn holds(
        &self,
        target: &Target,
        fencing_token: u64,
        deadline: Duration,
    ) -> Result<bool, GatewayError> {
        let path = target.path();
        let answer = self.call(Method::GET, &path, None, Some(deadline)).await?;
        /// A lock's holder, or a pool's holders: only the tokens matter.
        #[derive(Deserialize)]
        struct Held {
            fencing_token: Option<u64>,
            #[serde(default)]
            holders: Vec<Token>,
        }
        #[derive(Deserialize)]
        struct Token {
            fencing_token: u64,
        }
        match answer.status {
            StatusCode::OK => {
                let held: Held = serde_json::from_slice(&answer.body).map_err(|e| {
                    self.refused(&Method::GET, &path, &answer, format!("unreadable: {e}"))
                })?;
                Ok(held.fencing_token == Some(fencing_token)
                    || held
                        .holders
                        .iter()
                        .any(|h| h.fencing_token == fencing_token))
            }
            StatusCode::NOT_FOUND => Ok(false),
            _ => Err(self.error(&Method::GET, &path, &answer)),
        }
    }

    /// Records a run under the state_id's lease; answers its run_id.
    pub async fn start_run(
        &self,
        state_id: &str,
        lease_id: &str,
        info: serde_json::Value,
    ) -> Result<String, GatewayError> {
        let body = serde_json::json!({"state_id": state_id, "lease_id": lease_id, "info": info});
        let answer = self
            .call(Method::POST, "/v1/runs", Some(body), Some(RUN_DEADLINE))
            .await?;
        #[derive(Deserialize)]
        struct Started {
            run_id: String,
        }
        match answer.status {
            StatusCode::CREATED => serde_json::from_slice::<Started>(&answer.body)
                .map(|run| run.run_id)
                .map_err(|e| {
                    self.refused(
                        &Method::POST,
                        "/v1/runs",
                        &answer,
                        format!("no run in the answer: {e}"),
                    )
                }),
            _ => Err(self.error(&Method::POST, "/v1/runs", &answer)),
        }
    }

    /// Ends a run: `ending` is `{"exit_code": n}` or `{"signal": n}`.
    pub async fn end_run(
        &self,
        run_id: &str,
        ending: serde_json::Value,
    ) -> Result<(), GatewayError> {
        let path = format!("/v1/runs/{run_id}");
        let answer = self
            .call(Method::PATCH, &path, Some(ending), Some(RUN_DEADLINE))
            .await?;
        match answer.status {
            StatusCode::OK => Ok(()),
            _ => Err(self.error(&Method::PATCH, &path, &answer)),
        }
    }

    async fn lease_call(
        &self,
        method: Method,
        target: &Target,
        lease_id: &str,
        body: Option<serde_json::Value>,
        done: StatusCode,
    ) -> Result<Verdict, GatewayError> {
        let path = target.lease_path(lease_id);
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
        request = self.token.authorize(request);
        // The gateway's span joins the runner's (acquire, release, ...).
        let mut traced = reqwest::header::HeaderMap::new();
        traces::inject(&mut traced);
        request = request.headers(traced);
        if let Some(json) = body {
            request = request
                .header(CONTENT_TYPE, "application/json")
                .body(json.to_string());
        }
        let exchange = async {
            let response = request
                .send()
                .await
                .map_err(|e| unreachable(error_chain(&e)))?;
            let status = response.status();
            let retry_after = retry_after(response.headers());
            let body = read_body(response, MAX_ANSWER_BYTES)
                .await
                .map_err(unreachable)?;
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
