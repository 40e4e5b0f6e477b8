//! What dashboards read: the page at `/`, and the Grafana dashboard over
//! `/metrics` in deploy/grafana, whose every metric the gateway exports.

use reqwest::StatusCode;
use serde_json::Value;

use crate::helpers::spawn_app;

#[tokio::test]
async fn the_page_is_served_from_the_binary_and_fetches_nothing_from_elsewhere() {
    let app = spawn_app().await;
    let page = app.get("/").await;
    assert_eq!(page.status, StatusCode::OK);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    let policy = page.header("content-security-policy").unwrap();
    assert!(policy.contains("default-src 'none'") && policy.contains("connect-src 'self'"));
    for outside in ["http://", "https://", "//cdn", "<link", " src="] {
        assert!(!page.text.contains(outside), "the page refers to {outside}");
    }
    for path in [
        "/v1/states",
        "/v1/bookmarks",
        "/v1/locks",
        "/history",
        "/rollback",
    ] {
        assert!(page.text.contains(path), "the page uses {path}");
    }
}

/// Every `statehouse_...` name in the dashboard's queries.
fn queried_metrics(dashboard: &Value) -> Vec<String> {
    let mut names = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let mut rest = expr;
            while let Some(at) = rest.find("statehouse_") {
                let name: String = rest[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[at + name.len()..];
                names.push(name);
            }
        }
    }
    names
}

#[tokio::test]
async fn every_metric_the_grafana_dashboard_queries_is_exported() {
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/grafana/statehouse.json"
    );
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    let names = queried_metrics(&dashboard);
    assert!(names.len() >= 6, "{names:?}");
    let app = spawn_app().await;
    app.put_state("seen", &serde_json::json!({})).await;
    let exposition = app.get("/metrics").await.text;
    for name in names {
        let family = ["_total", "_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .unwrap_or(&name);
        assert!(
            exposition.contains(&format!("# TYPE {family} ")),
            "{name} is not a metric the gateway exports:\n{exposition}"
        );
    }
}
