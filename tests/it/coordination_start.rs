//! Starts in keeper mode: a ClickHouse that cannot run KeeperMap ends the
//! start naming the server setting, and gateways of two modes never serve
//! the same tables at once.

use crate::helpers::{
    auth_clickhouse_url, clickhouse_url, failed_start, spawn_gateway_process, unique_schema,
};

#[tokio::test]
async fn keeper_mode_on_a_clickhouse_without_keeper_map_ends_the_start_naming_the_setting() {
    let schema = unique_schema();
    let line = failed_start(
        &auth_clickhouse_url(),
        &["--schema", &schema, "--coordination", "keeper"],
    )
    .await;
    assert!(
        line.contains("the server setting keeper_map_path_prefix is missing"),
        "{line}"
    );
    assert!(line.contains("--coordination table"), "{line}");
}

#[tokio::test]
async fn table_mode_on_the_same_clickhouse_starts() {
    let schema = unique_schema();
    let gateway = spawn_gateway_process(&auth_clickhouse_url(), &["--schema", &schema]).await;
    gateway.terminate().await;
}

#[tokio::test]
async fn a_gateway_of_the_other_mode_starts_only_once_every_gateway_of_the_first_has_stopped() {
    let schema = unique_schema();
    let url = clickhouse_url();
    let table = ["--schema", schema.as_str(), "--coordination", "table"];
    let keeper = ["--schema", schema.as_str(), "--coordination", "keeper"];
    let first = spawn_gateway_process(&url, &table).await;
    let second = spawn_gateway_process(&url, &table).await;

    let line = failed_start(&url, &keeper).await;
    assert!(
        line.contains("2 gateway(s) with --coordination table serve them now"),
        "{line}"
    );
    assert!(
        line.contains("start this one with --coordination table"),
        "{line}"
    );

    first.terminate().await;
    let line = failed_start(&url, &keeper).await;
    assert!(
        line.contains("1 gateway(s) with --coordination table"),
        "{line}"
    );

    second.terminate().await;
    let keeper_gateway = spawn_gateway_process(&url, &keeper).await;
    let line = failed_start(&url, &table).await;
    assert!(
        line.contains("1 gateway(s) with --coordination keeper serve them now"),
        "{line}"
    );
    keeper_gateway.terminate().await;
    spawn_gateway_process(&url, &table).await.terminate().await;
}
