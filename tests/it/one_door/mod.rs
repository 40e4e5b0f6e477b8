//! One door for writes (issue 28): every change that carries a lease, by
//! whatever endpoint and through whichever gateway, is either refused or
//! seen by the next holder of the lock; a slow ClickHouse costs time, not
//! writes. The proxy in front of ClickHouse holds INSERTs only, so that the
//! lock traffic around them keeps its pace.

mod lease_end;
mod queued;
mod slow_inserts;

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::Value;

use crate::helpers::{Api, TestApp, raw_sql, two_peers_with};
use crate::proxy::Proxy;

/// The INSERT that writes states (their history rows, which a view copies
/// into the state table): lease and claim rows are not held with it.
pub const STATE_INSERT: &[&str] = &["INSERT INTO", "state_history"];

/// Every INSERT, whatever its table.
pub const ANY_INSERT: &[&str] = &["INSERT INTO"];

/// Two gateways on one database that forward to each other, each reaching
/// ClickHouse through a proxy of its own.
pub struct Pair {
    pub a: TestApp,
    pub proxy_a: Proxy,
    pub b: TestApp,
    pub proxy_b: Proxy,
}

impl Pair {
    pub async fn start(adjust: impl Fn(&mut statehouse::config::Config)) -> Self {
        let (proxy_a, proxy_b) = (Proxy::to_clickhouse().await, Proxy::to_clickhouse().await);
        let (a, b) = two_peers_with(|index, config| {
            [&proxy_a, &proxy_b][index].route(config);
            adjust(config);
        })
        .await;
        Self {
            a,
            proxy_a,
            b,
            proxy_b,
        }
    }

    /// Holds every state INSERT of both gateways for `delay` (or no more).
    pub fn hold_state_inserts(&self, delay: Option<Duration>) {
        for proxy in [&self.proxy_a, &self.proxy_b] {
            proxy.hold_requests_containing(delay.map(|d| (STATE_INSERT, d)));
        }
    }
}

/// The `completed` half of `id` as ClickHouse holds it now, read past every
/// gateway; None when there is no such state.
pub async fn stored(schema: &str, id: &str) -> Option<Value> {
    let row = raw_sql(&format!(
        "SELECT completed_state FROM `{schema}`.state FINAL WHERE state_id = '{id}' FORMAT JSONEachRow"
    ))
    .await;
    let row: Value = serde_json::from_str(row.lines().next()?).unwrap();
    Some(
        row["completed_state"]
            .as_str()
            .map_or(Value::Object(Default::default()), |text| {
                serde_json::from_str(text).unwrap()
            }),
    )
}

/// The `completed` half of `id` as a gateway answers it.
pub async fn served(api: &Api, id: &str) -> Option<Value> {
    let read = api.get_state(id).await;
    match read.status {
        StatusCode::OK => Some(read.json()["completed"].clone()),
        StatusCode::NOT_FOUND => None,
        other => panic!("read of {id} failed: {other} {}", read.text),
    }
}

/// How many versions history has of `id` (deletions included).
pub async fn versions(schema: &str, id: &str) -> u64 {
    raw_sql(&format!(
        "SELECT count() FROM `{schema}`.state_history WHERE state_id = '{id}'"
    ))
    .await
    .trim()
    .parse()
    .unwrap()
}
