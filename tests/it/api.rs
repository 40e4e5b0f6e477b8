//! The HTTP client the tests call a gateway with: every answer is checked
//! against openapi.yaml, and the requests the tests send again and again
//! (states, locks, pools, with or without a bearer token) have a method each.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::contract;

/// An HTTP client for one gateway; every answer is checked against openapi.yaml.
#[derive(Clone)]
pub struct Api {
    pub base: String,
    pub client: reqwest::Client,
}

/// A response, already checked against the OpenAPI contract.
#[derive(Debug)]
pub struct Reply {
    /// The request it answers, as `METHOD path`: a failed check names it.
    pub request: String,
    pub status: StatusCode,
    pub headers: reqwest::header::HeaderMap,
    pub text: String,
}

impl Reply {
    /// Asserts the status; on a mismatch the panic shows the request, the
    /// status and the body, and points at the caller.
    #[track_caller]
    pub fn expect(&self, status: StatusCode) -> &Self {
        assert!(
            self.status == status,
            "{}: expected {status}, got {}: {}",
            self.request,
            self.status,
            self.text
        );
        self
    }

    /// As [`Reply::expect`], with what the test means by it in the panic.
    #[track_caller]
    pub fn expect_because(&self, status: StatusCode, why: impl std::fmt::Display) -> &Self {
        assert!(
            self.status == status,
            "{why}: {}: expected {status}, got {}: {}",
            self.request,
            self.status,
            self.text
        );
        self
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn problem_type(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{}",
            self.text
        );
        let body = self.json();
        assert_eq!(
            body["status"],
            self.status.as_u16(),
            "problem status mirrors HTTP status"
        );
        assert!(body["detail"].as_str().is_some_and(|d| !d.is_empty()));
        body["type"]
            .as_str()
            .and_then(|t| t.strip_prefix("urn:statehouse:problem:"))
            .expect("problem type")
            .to_owned()
    }
}

/// Percent-encodes a state id for a path segment.
pub fn encode_id(id: &str) -> String {
    id.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn state_path(id: &str) -> String {
    format!("/v1/states/{}", encode_id(id))
}

fn lock_path(id: &str) -> String {
    format!("/v1/locks/{}", encode_id(id))
}

/// The path of pool `name`.
pub fn pool_path(name: &str) -> String {
    format!("/v1/pools/{}", encode_id(name))
}

/// A pool acquire body with the fields every test sets.
pub fn ask(owner: &str, limit: u64, ttl: u64, wait: f64) -> Value {
    json!({"owner": owner, "limit": limit, "ttl_seconds": ttl, "wait_seconds": wait})
}

impl Api {
    pub fn new(base: String) -> Self {
        Self {
            base,
            client: reqwest::Client::new(),
        }
    }

    pub async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> Reply {
        let mut request = self
            .client
            .request(method.clone(), format!("{}{}", self.base, path));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        if let Some(body) = body {
            request = request
                .header("content-type", "application/json")
                .body(body.to_owned());
        }
        let response = request
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: the gateway did not answer: {e:?}"));
        let reply = Reply {
            request: format!("{method} {path}"),
            status: response.status(),
            headers: response.headers().clone(),
            text: response.text().await.unwrap(),
        };
        contract::assert_conforms(&method, path, &reply);
        reply
    }

    /// A request as `token`'s bearer (`None`: with no authorization header).
    pub async fn call<'t>(
        &self,
        method: Method,
        path: &str,
        body: Option<&str>,
        token: impl Into<Option<&'t str>>,
    ) -> Reply {
        let bearer = token.into().map(|t| format!("Bearer {t}"));
        let headers: Vec<(&str, &str)> = bearer
            .iter()
            .map(|b| ("authorization", b.as_str()))
            .collect();
        self.request(method, path, body, &headers).await
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.request(Method::GET, path, None, &[]).await
    }

    pub async fn get_state(&self, id: &str) -> Reply {
        self.get(&state_path(id)).await
    }

    pub async fn put_state(&self, id: &str, body: &Value) -> Reply {
        let body = body.to_string();
        self.request(Method::PUT, &state_path(id), Some(&body), &[])
            .await
    }

    pub async fn patch_state(&self, id: &str, body: &Value) -> Reply {
        let body = body.to_string();
        self.request(Method::PATCH, &state_path(id), Some(&body), &[])
            .await
    }

    pub async fn delete_state(&self, id: &str) -> Reply {
        self.request(Method::DELETE, &state_path(id), None, &[])
            .await
    }

    pub async fn acquire(&self, id: &str, body: &Value) -> Reply {
        let body = body.to_string();
        self.request(Method::POST, &lock_path(id), Some(&body), &[])
            .await
    }

    /// Acquires or panics; answers (lease_id, fencing_token).
    /// A lease on `id` and its fencing token; the acquire is asked again
    /// while it is 503, as [`retried`] does: under load ClickHouse may not
    /// answer within the query timeout (stress run Q).
    pub async fn lease(&self, id: &str, owner: &str, ttl: u64, wait: f64) -> (String, u64) {
        let ask = json!({"owner": owner, "ttl_seconds": ttl, "wait_seconds": wait});
        let reply = retried(|| self.acquire(id, &ask)).await;
        let body = reply.expect(StatusCode::CREATED).json();
        (
            body["lease_id"].as_str().unwrap().to_owned(),
            body["fencing_token"].as_u64().unwrap(),
        )
    }

    pub async fn release(&self, id: &str, lease_id: &str) -> Reply {
        let path = format!("{}/{lease_id}", lock_path(id));
        self.request(Method::DELETE, &path, None, &[]).await
    }

    pub async fn renew(&self, id: &str, lease_id: &str, ttl: u64) -> Reply {
        let body = json!({ "ttl_seconds": ttl }).to_string();
        let path = format!("{}/{lease_id}", lock_path(id));
        self.request(Method::PUT, &path, Some(&body), &[]).await
    }

    pub async fn put_state_with_lease(&self, id: &str, body: &Value, lease_id: &str) -> Reply {
        let body = body.to_string();
        let lease = [("lease-id", lease_id)];
        self.request(Method::PUT, &state_path(id), Some(&body), &lease)
            .await
    }

    pub async fn patch_state_with_lease(&self, id: &str, body: &Value, lease_id: &str) -> Reply {
        let body = body.to_string();
        let lease = [("lease-id", lease_id)];
        self.request(Method::PATCH, &state_path(id), Some(&body), &lease)
            .await
    }

    /// POST /v1/pools/{name} with `body` (see [`ask`]).
    pub async fn pool_acquire(&self, name: &str, body: &Value) -> Reply {
        self.request(Method::POST, &pool_path(name), Some(&body.to_string()), &[])
            .await
    }

    pub async fn pool_renew(&self, name: &str, lease_id: &str, ttl: u64) -> Reply {
        let body = json!({ "ttl_seconds": ttl }).to_string();
        let path = format!("{}/{lease_id}", pool_path(name));
        self.request(Method::PUT, &path, Some(&body), &[]).await
    }

    pub async fn pool_release(&self, name: &str, lease_id: &str) -> Reply {
        let path = format!("{}/{lease_id}", pool_path(name));
        self.request(Method::DELETE, &path, None, &[]).await
    }

    /// The admin's end of pool `name`, with `reason`.
    pub async fn pool_end(&self, name: &str, reason: &str) -> Reply {
        let path = format!("{}?reason={}", pool_path(name), encode_id(reason));
        self.request(Method::DELETE, &path, None, &[]).await
    }

    pub async fn pool_view(&self, name: &str) -> Reply {
        self.get(&pool_path(name)).await
    }
}

/// `request`'s answer, asked again a second apart (as `Retry-After` says)
/// while it is 503 (ClickHouse or Keeper slow or away, a claim between
/// gateways, a lapsed claim being re-won): what every client does. Any
/// other answer is the request's. The 60 s give-up only catches a gateway
/// that never recovers: with the Python suites beside a keeper-mode checker
/// (load average 16 on 2 cores) a lapsed claim took over 20 s to re-win.
pub async fn retried<F: Future<Output = Reply>>(request: impl Fn() -> F) -> Reply {
    retried_for(Duration::from_secs(60), request).await
}

/// [`retried`], giving up after `limit`.
pub async fn retried_for<F: Future<Output = Reply>>(
    limit: Duration,
    request: impl Fn() -> F,
) -> Reply {
    let give_up = Instant::now() + limit;
    loop {
        let reply = request().await;
        if reply.status != StatusCode::SERVICE_UNAVAILABLE || Instant::now() >= give_up {
            return reply;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
