//! TLS to ClickHouse: the local ClickHouse serves HTTPS with a test CA's
//! certificate (scripts/test makes them), and rustls is the one TLS stack.

use reqwest::StatusCode;
use serde_json::json;
use statehouse::config::Config;

use crate::helpers::{failed_start, spawn_configured, unique_schema};

fn tls_env() -> (String, String) {
    let url = std::env::var("STATEHOUSE_TEST_CLICKHOUSE_TLS_URL")
        .expect("STATEHOUSE_TEST_CLICKHOUSE_TLS_URL is set by scripts/test");
    let ca = std::env::var("STATEHOUSE_TEST_CLICKHOUSE_CA")
        .expect("STATEHOUSE_TEST_CLICKHOUSE_CA is set by scripts/test");
    (url, ca)
}

fn tls_config(url: &str, extra: &[&str]) -> Config {
    let schema = unique_schema();
    let mut args = vec![
        "--clickhouse-url",
        url,
        "--listen",
        "127.0.0.1:0",
        "--schema",
        &schema,
        // Time to start on a loaded machine (2 s was not); a gateway that
        // cannot trust the server fails at once whatever this is.
        "--startup-timeout",
        "60s",
    ];
    args.extend_from_slice(extra);
    Config::from_serve_args(&args).expect("valid configuration")
}

#[tokio::test]
async fn states_travel_over_tls_to_a_clickhouse_with_a_private_ca() {
    let (url, ca) = tls_env();
    assert!(url.starts_with("clickhouses://"));
    let config = tls_config(&url, &["--clickhouse-ca-file", &ca]);
    assert_eq!(
        config.clickhouse.endpoint().split(':').next(),
        Some("https")
    );
    let app = spawn_configured(config).await;
    let put = app
        .put_state("over-tls", &json!({"completed": {"secure": true}}))
        .await;
    put.expect(StatusCode::CREATED);
    assert_eq!(
        app.get_state("over-tls").await.json()["completed"]["secure"],
        true
    );
    app.get("/readyz").await.expect(StatusCode::OK);
}

#[tokio::test]
async fn an_untrusted_certificate_ends_the_start_naming_the_ca_setting() {
    let (url, _) = tls_env();
    let line = failed_start(&url, &["--schema", &unique_schema()]).await;
    assert!(line.contains("not trust"), "{line}");
    assert!(
        line.contains("UnknownIssuer"),
        "the TLS error itself: {line}"
    );
    assert!(line.contains("--clickhouse-ca-file"), "{line}");
    assert!(line.contains("STATEHOUSE_CLICKHOUSE_CA_FILE"), "{line}");
}

#[test]
fn rustls_is_the_only_tls_stack() {
    let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.lock")).unwrap();
    let packages: Vec<&str> = lock
        .lines()
        .filter_map(|l| l.strip_prefix("name = \"")?.strip_suffix('"'))
        .collect();
    for other in [
        "openssl",
        "openssl-sys",
        "native-tls",
        "hyper-tls",
        "aws-lc-rs",
        "aws-lc-sys",
    ] {
        assert!(!packages.contains(&other), "{other} is in Cargo.lock");
    }
    assert_eq!(
        packages.iter().filter(|p| **p == "rustls").count(),
        1,
        "one rustls version"
    );
}
