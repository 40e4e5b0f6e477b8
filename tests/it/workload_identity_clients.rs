//! Workload identity (issue 56) for the clients: `statehouse lock` presents
//! its --token-file as a platform rotates it, and the issuers files that the
//! manifests and docs/operations.md write out parse.

use std::path::Path;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;

use crate::jwks_server::{JwksServer, Key, key_set, now, scratch_dir};
use crate::workload_identity::{
    AUDIENCE, bindings, claims, gateway, issuers_file_with_leeway, quick, until_put,
};

/// Replaces `path` at once, as the kubelet swaps a projected token in.
fn replace_file(path: &Path, text: &str) {
    let next = path.with_extension("next");
    std::fs::write(&next, text).unwrap();
    std::fs::rename(&next, path).unwrap();
}

#[tokio::test]
async fn statehouse_lock_presents_the_token_file_as_it_is_rotated() {
    let dir = scratch_dir("jwt");
    let rsa = Key::rsa(&dir, "rsa-1");
    let jwks = JwksServer::start(key_set(&[&rsa])).await;
    let issuers = issuers_file_with_leeway(&dir, ("jwks_url", &jwks.url), bindings(), 0);
    let app = gateway(issuers, quick()).await;
    let token = |lasts: i64| {
        rsa.sign(&claims(
            json!({"repository": "org/etl", "exp": now() + lasts}),
        ))
    };
    until_put(&app, "gh:org/etl/warm", &token(60), StatusCode::CREATED).await;
    let file = dir.join("token");
    // Expires after 3 s, so renewals past it need the next token.
    let (first, next) = (token(3), token(300));
    replace_file(&file, &first);
    let runner = crate::run_lease::lock(
        &app.base,
        &["--token-file", file.to_str().unwrap(), "--ttl", "6s"],
        "gh:org/etl/locked",
        &dir,
        "sleep 12",
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    replace_file(&file, &next);
    let (code, stderr) =
        crate::run_lease::ended(runner, crate::run_lease::STARTS + Duration::from_secs(12)).await;
    assert_eq!(code, Some(0), "{stderr}");
    for token in [&first, &next] {
        assert!(
            !stderr.contains(token.as_str()),
            "a token in the output: {stderr}"
        );
    }
}

#[test]
fn the_kubernetes_issuers_file_and_the_documented_bindings_parse() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let manifest: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(root.join("deploy/kubernetes/base/jwt-issuers.yaml")).unwrap(),
    )
    .unwrap();
    let text = manifest["data"]["issuers.json"].as_str().unwrap();
    let issuers = statehouse::auth::jwt::issuers::parse(text).unwrap();
    assert_eq!(issuers[0].audience, AUDIENCE);
    // Every issuer written out in docs/operations.md, "Workload identity".
    let docs = std::fs::read_to_string(root.join("docs/operations.md")).unwrap();
    let section = docs
        .split("## Workload identity")
        .nth(1)
        .unwrap()
        .split("\n## ")
        .next()
        .unwrap();
    let blocks: Vec<&str> = section
        .split("```json\n")
        .skip(1)
        .map(|block| block.split("```").next().unwrap())
        .collect();
    assert_eq!(blocks.len(), 4, "the example and three platforms");
    for block in blocks {
        let list = if block.trim_start().starts_with('[') {
            block.to_owned()
        } else {
            format!("[{block}]")
        };
        statehouse::auth::jwt::issuers::parse(&list).unwrap_or_else(|e| panic!("{e}: {block}"));
    }
}
