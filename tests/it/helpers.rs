//! Shared test plumbing: a gateway per test on its own ClickHouse database,
//! raw SQL against the local ClickHouse, and an HTTP client that checks every
//! response against openapi.yaml.

use std::sync::OnceLock;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::Value;
use statehouse::App;
use statehouse::config::{ClickHouseTarget, Config, parse_clickhouse_url};
use tokio::sync::oneshot;

use crate::contract;

/// The ClickHouse the tests use; `scripts/test` starts the local one and sets this.
pub fn clickhouse_url() -> String {
    std::env::var("STATEHOUSE_TEST_CLICKHOUSE_URL")
        .unwrap_or_else(|_| "clickhouse://default@127.0.0.1:8123/default".to_owned())
}

pub fn clickhouse_target() -> ClickHouseTarget {
    parse_clickhouse_url(&clickhouse_url())
        .expect("STATEHOUSE_TEST_CLICKHOUSE_URL must be a valid URI")
}

/// A database name no other test uses.
pub fn unique_schema() -> String {
    format!("it_{}", uuid::Uuid::new_v4().simple())
}

/// The defaults `statehouse serve` has, on port 0 and a database of its own;
/// a short claim settle keeps lock tests quick (the mechanism is the same).
pub fn test_config(schema: &str) -> Config {
    let url = clickhouse_url();
    let mut config = Config::from_serve_args(&[
        "--clickhouse-url",
        &url,
        "--listen",
        "127.0.0.1:0",
        "--schema",
        schema,
        "--claim-settle",
        "200ms",
        "--shutdown-timeout",
        "5s",
    ])
    .expect("test configuration is valid");
    config.query_timeout = Duration::from_secs(10);
    config
}

pub struct TestApp {
    pub base: String,
    pub schema: String,
    pub client: reqwest::Client,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A response, already checked against the OpenAPI contract.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: reqwest::header::HeaderMap,
    pub text: String,
}

impl Reply {
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

pub async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

pub async fn spawn_app_with(adjust: impl FnOnce(&mut Config)) -> TestApp {
    let schema = unique_schema();
    let mut config = test_config(&schema);
    adjust(&mut config);
    spawn_configured(config).await
}

pub async fn spawn_configured(config: Config) -> TestApp {
    // Captured per test, shown only when that test fails.
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .try_init();
    let app = App::build(&config)
        .await
        .expect("gateway starts against the test ClickHouse");
    let base = format!("http://{}", app.local_addr());
    let (stop, stopped) = oneshot::channel();
    tokio::spawn(app.serve(async move {
        let _ = stopped.await;
    }));
    TestApp {
        base,
        schema: config.schema.as_str().to_owned(),
        client: reqwest::Client::new(),
        stop: Some(stop),
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

impl TestApp {
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
        let response = request.send().await.expect("gateway answers");
        let reply = Reply {
            status: response.status(),
            headers: response.headers().clone(),
            text: response.text().await.unwrap(),
        };
        contract::assert_conforms(&method, path, &reply);
        reply
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.request(Method::GET, path, None, &[]).await
    }

    pub async fn get_state(&self, id: &str) -> Reply {
        self.get(&format!("/v1/states/{}", encode_id(id))).await
    }

    pub async fn put_state(&self, id: &str, body: &Value) -> Reply {
        self.request(
            Method::PUT,
            &format!("/v1/states/{}", encode_id(id)),
            Some(&body.to_string()),
            &[],
        )
        .await
    }

    pub async fn patch_state(&self, id: &str, body: &Value) -> Reply {
        self.request(
            Method::PATCH,
            &format!("/v1/states/{}", encode_id(id)),
            Some(&body.to_string()),
            &[],
        )
        .await
    }

    pub async fn delete_state(&self, id: &str) -> Reply {
        self.request(
            Method::DELETE,
            &format!("/v1/states/{}", encode_id(id)),
            None,
            &[],
        )
        .await
    }

    /// Every state id with its content, straight from ClickHouse (FINAL).
    pub async fn table_snapshot(&self) -> Vec<(String, Option<String>, Option<String>)> {
        let rows = raw_sql(&format!(
            "SELECT state_id, completed_state, partial_state FROM `{}`.state FINAL ORDER BY state_id FORMAT JSONCompactEachRow",
            self.schema
        ))
        .await;
        rows.lines()
            .map(|line| {
                let row: Vec<Value> = serde_json::from_str(line).unwrap();
                let text = |v: &Value| v.as_str().map(str::to_owned);
                (text(&row[0]).unwrap(), text(&row[1]), text(&row[2]))
            })
            .collect()
    }
}

/// Sends SQL to the test ClickHouse over its HTTP interface, as any client would.
pub async fn raw_sql(sql: &str) -> String {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    let target = clickhouse_target();
    let response = CLIENT
        .get_or_init(reqwest::Client::new)
        .post(format!("{}/", target.endpoint()))
        .basic_auth(&target.user, Some(&target.password))
        .body(sql.to_owned())
        .send()
        .await
        .expect("ClickHouse answers");
    let status = response.status();
    let text = response.text().await.unwrap();
    assert!(status.is_success(), "ClickHouse refused {sql}: {text}");
    text
}
