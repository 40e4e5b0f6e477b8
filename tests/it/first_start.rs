//! A first start as a new user makes it: a ClickHouse without the URI's
//! database, a wrong password, a user without grants, a URL that points at
//! something else. What retrying cannot fix ends the start at once, with one
//! line that names the cause and the setting to change.

use reqwest::StatusCode;
use serde_json::json;
use statehouse::config::parse_clickhouse_url;

use crate::helpers::{
    answering, auth_clickhouse_url, clickhouse_target, failed_start, raw_sql_at,
    readonly_clickhouse_url, spawn_gateway_process, unique_schema,
};

/// `clickhouse://user:password@host:port/<database>` for the target of `url`.
fn with_database(url: &str, database: &str) -> String {
    let target = parse_clickhouse_url(url).unwrap();
    format!(
        "clickhouse://{}:{}@{}:{}/{database}",
        target.user, target.password, target.host, target.port
    )
}

async fn databases(url: &str) -> Vec<String> {
    raw_sql_at(url, "SELECT name FROM system.databases ORDER BY name")
        .await
        .lines()
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn the_quickstart_uri_creates_its_missing_database_and_serves() {
    // The ClickHouse plugin's quickstart URI, on a ClickHouse without `meltano`.
    let admin = auth_clickhouse_url();
    raw_sql_at(&admin, "DROP DATABASE IF EXISTS meltano SYNC").await;
    assert!(!databases(&admin).await.contains(&"meltano".to_owned()));
    let quickstart = with_database(&admin, "meltano");
    assert!(quickstart.starts_with("clickhouse://default:password@"));

    let gateway = spawn_gateway_process(&quickstart, &[]).await;
    let api = gateway.api();
    let put = api
        .put_state(
            "dev:tap-github-to-target-jsonl",
            &json!({"completed": {"n": 1}}),
        )
        .await;
    put.expect(StatusCode::CREATED);
    let tables = raw_sql_at(
        &admin,
        "SELECT name FROM system.tables WHERE database = 'meltano' ORDER BY name",
    )
    .await;
    assert_eq!(
        tables,
        "state\nstate_changes\nstate_changes_deletes\nstate_changes_writes\nstate_gateways\nstate_history\nstate_history_writes\nstate_lease\n\
         state_lease_history\nstate_lease_history_writes\nstate_members\nstate_pool_lease\nstate_runs\n"
    );
}

#[tokio::test]
async fn a_new_database_named_in_the_environment_is_created_and_serves() {
    let main = crate::helpers::clickhouse_url();
    let (database, schema) = (unique_schema(), unique_schema());
    let url = with_database(&main, &database);

    let gateway = spawn_gateway_process(&url, &["--schema", &schema]).await;
    let api = gateway.api();
    let ready = api.get("/readyz").await;
    ready.expect(StatusCode::OK);
    // In whole microseconds: at most 3 decimals, not a float's 15.
    let latency = ready.json()["components"]["clickhouse"]["latency_ms"]
        .as_f64()
        .unwrap();
    assert_eq!(
        (latency * 1000.0).round() / 1000.0,
        latency,
        "{}",
        ready.text
    );
    let put = api
        .put_state("fresh", &json!({"completed": {"n": 1}}))
        .await;
    put.expect(StatusCode::CREATED);
    assert_eq!(api.get_state("fresh").await.json()["completed"]["n"], 1);
    let present = databases(&main).await;
    assert!(
        present.contains(&database),
        "the URI's database: {present:?}"
    );
    assert!(present.contains(&schema), "the schema: {present:?}");
}

#[tokio::test]
async fn a_wrong_user_or_password_ends_the_start_naming_the_password_setting() {
    let target = parse_clickhouse_url(&auth_clickhouse_url()).unwrap();
    let base = format!("{}:{}/default", target.host, target.port);
    for url in [
        format!("clickhouse://{}:not-the-password@{base}", target.user),
        format!("clickhouse://{}@{base}", target.user),
        format!("clickhouse://nobody:{}@{base}", target.password),
    ] {
        let line = failed_start(&url, &["--schema", &unique_schema()]).await;
        assert!(line.contains("wrong user or password"), "{line}");
        assert!(
            line.contains("AUTHENTICATION_FAILED"),
            "ClickHouse's words: {line}"
        );
        assert!(line.contains("--clickhouse-password"), "{line}");
        assert!(line.contains("STATEHOUSE_CLICKHOUSE_PASSWORD"), "{line}");
        assert!(
            !line.contains("not-the-password"),
            "no password in it: {line}"
        );
    }
}

#[tokio::test]
async fn a_user_without_grants_ends_the_start_naming_the_grant() {
    let schema = unique_schema();
    let line = failed_start(&readonly_clickhouse_url(), &["--schema", &schema]).await;
    assert!(line.contains("may not create"), "{line}");
    assert!(
        line.contains(&format!("CREATE DATABASE ON {schema}.*")),
        "the grant ClickHouse names: {line}"
    );
    assert!(line.contains("ACCESS_DENIED"), "{line}");
    assert!(line.contains("--schema"), "{line}");
    let missing_uri_database = with_database(&readonly_clickhouse_url(), &unique_schema());
    let line = failed_start(&missing_uri_database, &["--schema", &schema]).await;
    assert!(line.contains("CREATE DATABASE ON it_"), "{line}");
}

#[tokio::test]
async fn a_user_without_create_grants_starts_on_databases_an_administrator_made() {
    let schema = unique_schema();
    let admin = auth_clickhouse_url();
    let prepared = spawn_gateway_process(&admin, &["--schema", &schema]).await;
    drop(prepared);

    let reader = spawn_gateway_process(&readonly_clickhouse_url(), &["--schema", &schema]).await;
    let api = reader.api();
    api.get("/readyz").await.expect(StatusCode::OK);
    api.get_state("none").await.expect(StatusCode::NOT_FOUND);
}

const WEB_SERVER_404: &[u8] = b"HTTP/1.1 404 Not Found\r\nServer: nginx\r\nContent-Type: text/html\r\nContent-Length: 73\r\nConnection: close\r\n\r\n<html><head><title>404 Not Found</title></head><body>nothing</body></html>";
const WEB_SERVER_200: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 35\r\nConnection: close\r\n\r\n<html><body>Welcome!</body></html>\n";
const NOT_HTTP: &[u8] = b"-ERR unknown command 'GET'\r\n";

#[tokio::test]
async fn an_endpoint_that_is_not_clickhouse_ends_the_start_naming_the_url_setting() {
    let target = clickhouse_target();
    let tls_to_plain_http = format!(
        "clickhouses://{}@{}:{}/default",
        target.user, target.host, target.port
    );
    for (url, shows) in [
        (
            format!("clickhouse://{}/default", answering(WEB_SERVER_404)),
            "HTTP 404 Not Found: <html>",
        ),
        (
            format!("clickhouse://{}/default", answering(WEB_SERVER_200)),
            "HTTP 200 OK: <html><body>Welcome!",
        ),
        (
            format!("clickhouse://{}/default", answering(NOT_HTTP)),
            "invalid HTTP",
        ),
        (tls_to_plain_http, "corrupt message"),
    ] {
        let line = failed_start(&url, &[]).await;
        assert!(
            line.contains("does not speak ClickHouse's HTTP interface"),
            "{url}: {line}"
        );
        assert!(line.contains(shows), "{url}: {line}");
        assert!(line.contains("--clickhouse-url"), "{line}");
        assert!(line.contains("STATEHOUSE_CLICKHOUSE_URL"), "{line}");
    }
}
