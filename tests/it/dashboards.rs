//! What dashboards read: the page at `/`, and the Grafana dashboard over
//! `/metrics` in deploy/grafana, whose every metric the gateway exports.

use reqwest::StatusCode;
use serde_json::Value;

use crate::helpers::spawn_app;

/// The `src="..."` and `href="..."` values of `html`.
fn references(html: &str) -> Vec<String> {
    let mut found = Vec::new();
    for attribute in ["src=\"", "href=\""] {
        let mut rest = html;
        while let Some(at) = rest.find(attribute) {
            let value = &rest[at + attribute.len()..];
            let end = value.find('"').unwrap();
            found.push(value[..end].to_owned());
            rest = &value[end..];
        }
    }
    found
}

#[tokio::test]
async fn the_page_and_its_files_are_served_from_the_binary_under_a_strict_policy() {
    let app = spawn_app().await;
    let page = app.get("/").await;
    page.expect(StatusCode::OK);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    let policy = page.header("content-security-policy").unwrap();
    assert!(policy.contains("default-src 'none'") && policy.contains("script-src 'self'"));
    for directive in policy.split(';') {
        let sources = directive.split_whitespace().skip(1);
        for source in sources {
            assert!(
                source.starts_with('\'') && !source.contains("unsafe"),
                "{directive}: only keywords, none unsafe: {source}"
            );
        }
    }
    // No inline script or style of any kind: every script is a file.
    assert!(!page.text.contains("<style"), "{}", page.text);
    assert!(!page.text.contains("style="), "{}", page.text);
    for script in page.text.split("<script").skip(1) {
        let tag = &script[..script.find('>').unwrap()];
        assert!(
            tag.contains(" src=\"/assets/"),
            "an inline script: <script{tag}>"
        );
        assert!(script[script.find('>').unwrap() + 1..].starts_with("</script>"));
    }

    let mut code = String::new();
    for reference in references(&page.text) {
        if reference.starts_with('#') {
            continue;
        }
        assert!(
            reference.starts_with("/assets/"),
            "from this origin: {reference}"
        );
        let file = app.get(&reference).await;
        file.expect_because(StatusCode::OK, &reference);
        let kind = file.header("content-type").unwrap();
        assert!(
            kind.starts_with("text/javascript") || kind.starts_with("text/css"),
            "{reference}: {kind}"
        );
        assert_eq!(file.header("x-content-type-options"), Some("nosniff"));
        code.push_str(&file.text);
    }
    // The modules the entry imports are files beside it.
    for module in [
        "common.js",
        "state.js",
        "chart.js",
        "regressions.js",
        "pools.js",
    ] {
        let file = app.get(&format!("/assets/{module}")).await;
        file.expect_because(StatusCode::OK, module);
        assert!(!file.text.contains("http://") && !file.text.contains("https://"));
        code.push_str(&file.text);
    }
    for path in [
        "/v1/states",
        "/v1/bookmarks",
        "/v1/locks",
        "/v1/pools",
        "/v1/regressions",
        "/v1/whoami",
        "/history",
        "/rollback",
        "/bookmarks/",
    ] {
        assert!(code.contains(path), "the page uses {path}");
    }
    let missing = app.get("/assets/nothing.js").await;
    missing.expect(StatusCode::NOT_FOUND);
    assert_eq!(missing.problem_type(), "not-found");
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
