//! What a bench counts of a gateway's work: its ClickHouse statements.

use std::collections::HashMap;

/// The ClickHouse statements a gateway has sent so far, by operation (the
/// `statehouse_clickhouse_query_duration_seconds_count` of its /metrics).
pub async fn by_operation(http: &reqwest::Client, base: &str) -> HashMap<String, f64> {
    let text = http
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter_map(|line| {
            let rest = line
                .strip_prefix("statehouse_clickhouse_query_duration_seconds_count{operation=\"")?;
            let (operation, count) = rest.split_once("\"} ")?;
            Some((operation.to_owned(), count.trim().parse().ok()?))
        })
        .collect()
}
