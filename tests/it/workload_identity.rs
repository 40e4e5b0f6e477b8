//! Workload identity (issue 56): JWTs of a configured issuer, verified
//! against the key set a local server publishes (keys made in the test),
//! granted what their bindings say, refused with their problem types.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use statehouse::auth::jwt::JwtAuth;
use statehouse::auth::jwt::keys::KeyTiming;

use crate::api::Api;
use crate::helpers::{
    TestApp, clickhouse_url, metric, spawn_app_with, spawn_gateway_process, unique_schema,
};
use crate::jwks_server::{JwksServer, Key, key_set, now, scratch_dir};

pub const ISSUER: &str = "https://ci.example";
pub const AUDIENCE: &str = "statehouse";
const DOC: &str = r#"{"completed": {"n": 1}}"#;

/// The issuers file of one issuer whose keys are at `keys` (a jwks_url or
/// a jwks_file), with a leeway of 30 s.
fn issuers_file(dir: &Path, keys: (&str, &str), bindings: Value) -> std::path::PathBuf {
    issuers_file_with_leeway(dir, keys, bindings, 30)
}

pub fn issuers_file_with_leeway(
    dir: &Path,
    keys: (&str, &str),
    bindings: Value,
    leeway: u64,
) -> std::path::PathBuf {
    let path = dir.join("issuers.json");
    let issuers = json!([{
        "issuer": ISSUER,
        keys.0: keys.1,
        "audience": AUDIENCE,
        "leeway_seconds": leeway,
        "bindings": bindings,
    }]);
    std::fs::write(&path, issuers.to_string()).unwrap();
    path
}

/// Writers of a repository under `gh:<repository>/`, a team's under
/// `team:<team>/`, and readers.
pub fn bindings() -> Value {
    json!([
        {"claims": {"repository": "org/*"}, "role": "write",
         "scope": ["gh:${repository}/*"], "name": "github:${repository}"},
        {"claims": {"team": "*"}, "role": "write",
         "scope": ["team:${team}/*"], "name": "team:${team}"},
        {"claims": {"sub": "reader"}, "role": "read", "name": "reader"},
    ])
}

pub fn claims(extra: Value) -> Value {
    let mut claims = json!({"iss": ISSUER, "aud": AUDIENCE, "exp": now() + 300, "iat": now()});
    for (name, value) in extra.as_object().unwrap() {
        if value.is_null() {
            claims.as_object_mut().unwrap().remove(name);
        } else {
            claims[name] = value.clone();
        }
    }
    claims
}

pub async fn gateway(issuers: std::path::PathBuf, timing: KeyTiming) -> TestApp {
    spawn_app_with(move |config| {
        config.jwt = Some(Arc::new(JwtAuth::load(issuers, timing).unwrap()));
    })
    .await
}

pub fn quick() -> KeyTiming {
    KeyTiming {
        min_gap: Duration::from_millis(500),
        ..KeyTiming::default()
    }
}

/// Waits until `token`'s write of `id` gets `expected`, for at most 10 s.
pub async fn until_put(api: &Api, id: &str, token: &str, expected: StatusCode) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reply = api.call(Method::PUT, &put_path(id), Some(DOC), token).await;
        if reply.status == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "still {} ({})",
            reply.status,
            reply.text
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn put_path(id: &str) -> String {
    format!("/v1/states/{}", crate::api::encode_id(id))
}

#[tokio::test]
async fn tokens_write_in_their_bindings_scope_and_history_names_the_binding() {
    let dir = scratch_dir("jwt");
    let (rsa, ec) = (Key::rsa(&dir, "rsa-1"), Key::ec(&dir, "ec-1"));
    let jwks = JwksServer::start(key_set(&[&rsa, &ec])).await;
    let app = gateway(
        issuers_file(&dir, ("jwks_url", &jwks.url), bindings()),
        quick(),
    )
    .await;
    let etl = rsa.sign(&claims(json!({"repository": "org/etl"})));
    until_put(&app, "gh:org/etl/tap", &etl, StatusCode::CREATED).await;
    let outside = app
        .call(
            Method::PUT,
            &put_path("gh:org/other/tap"),
            Some(DOC),
            etl.as_str(),
        )
        .await;
    outside.expect(StatusCode::FORBIDDEN);
    assert_eq!(outside.problem_type(), "out-of-scope");
    let history = app
        .call(
            Method::GET,
            &format!("{}/history", put_path("gh:org/etl/tap")),
            None,
            etl.as_str(),
        )
        .await
        .json();
    assert_eq!(history["versions"][0]["actor"], "github:org/etl");
    let whoami = app
        .call(Method::GET, "/v1/whoami", None, etl.as_str())
        .await
        .json();
    assert_eq!(whoami["name"], "github:org/etl");
    assert_eq!(whoami["role"], "write");

    let es = ec.sign(&claims(json!({"repository": "org/ec"})));
    app.call(
        Method::PUT,
        &put_path("gh:org/ec/tap"),
        Some(DOC),
        es.as_str(),
    )
    .await
    .expect(StatusCode::CREATED);

    // A claim's glob characters are only themselves in the scope.
    for (claim, token, inside, outside) in [
        ("repository", "org/*", "gh:org/*/x", "gh:org/etl/y"),
        ("team", "*", "team:*/x", "team:a/x"),
    ] {
        let wild = rsa.sign(&claims(json!({claim: token})));
        app.call(Method::PUT, &put_path(inside), Some(DOC), wild.as_str())
            .await
            .expect_because(StatusCode::CREATED, format!("{claim}={token}: {inside}"));
        app.call(Method::PUT, &put_path(outside), Some(DOC), wild.as_str())
            .await
            .expect_because(StatusCode::FORBIDDEN, format!("{claim}={token}: {outside}"));
        let listing = app
            .call(Method::GET, "/v1/states", None, wild.as_str())
            .await
            .json();
        let ids: Vec<&str> = listing["states"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["state_id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, [inside], "{claim}={token} lists only its own");
    }
    let reader = rsa.sign(&claims(json!({"sub": "reader"})));
    app.call(
        Method::PUT,
        &put_path("gh:org/etl/tap"),
        Some(DOC),
        reader.as_str(),
    )
    .await
    .expect(StatusCode::FORBIDDEN);
    app.call(
        Method::GET,
        &put_path("gh:org/etl/tap"),
        None,
        reader.as_str(),
    )
    .await
    .expect(StatusCode::OK);
}

#[tokio::test]
async fn refused_tokens_get_their_problem_types_and_are_counted() {
    let dir = scratch_dir("jwt");
    let (rsa, other) = (Key::rsa(&dir, "rsa-1"), Key::rsa(&dir, "rsa-2"));
    let jwks = JwksServer::start(key_set(&[&rsa])).await;
    let app = gateway(
        issuers_file(&dir, ("jwks_url", &jwks.url), bindings()),
        quick(),
    )
    .await;
    let good = |extra: Value| {
        let mut with_repo = json!({"repository": "org/etl"});
        for (k, v) in extra.as_object().unwrap() {
            with_repo[k] = v.clone();
        }
        claims(with_repo)
    };
    until_put(
        &app,
        "gh:org/etl/a",
        &rsa.sign(&good(json!({}))),
        StatusCode::CREATED,
    )
    .await;
    let header = |alg: &str| {
        use base64::Engine;
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(json!({"alg": alg, "typ": "JWT", "kid": "rsa-1"}).to_string())
    };
    let payload = {
        use base64::Engine;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(good(json!({})).to_string())
    };
    let hmac_forgery = jsonwebtoken::encode(
        &jsonwebtoken::Header {
            kid: Some("rsa-1".to_owned()),
            ..jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256)
        },
        &good(json!({})),
        &jsonwebtoken::EncodingKey::from_secret(&rsa.public_pem),
    )
    .unwrap();
    let cases: Vec<(&str, String, StatusCode, &str)> = vec![
        (
            "wrong audience",
            rsa.sign(&good(json!({"aud": "vault"}))),
            StatusCode::UNAUTHORIZED,
            "wrong-audience",
        ),
        (
            "no aud",
            rsa.sign(&good(json!({"aud": null}))),
            StatusCode::UNAUTHORIZED,
            "wrong-audience",
        ),
        (
            "expired past the leeway",
            rsa.sign(&good(json!({"exp": now() - 60}))),
            StatusCode::UNAUTHORIZED,
            "token-expired",
        ),
        (
            "nbf ahead",
            rsa.sign(&good(json!({"nbf": now() + 120}))),
            StatusCode::UNAUTHORIZED,
            "token-invalid",
        ),
        (
            "no exp",
            rsa.sign(&good(json!({"exp": null}))),
            StatusCode::UNAUTHORIZED,
            "token-invalid",
        ),
        (
            "alg none",
            format!("{}.{payload}.", header("none")),
            StatusCode::UNAUTHORIZED,
            "token-invalid",
        ),
        (
            "HS256 with the public key",
            hmac_forgery,
            StatusCode::UNAUTHORIZED,
            "token-invalid",
        ),
        (
            "another key under the kid",
            other.sign_as("rsa-1", &good(json!({}))),
            StatusCode::UNAUTHORIZED,
            "token-invalid",
        ),
        (
            "unknown issuer",
            rsa.sign(&good(json!({"iss": "https://elsewhere"}))),
            StatusCode::UNAUTHORIZED,
            "unknown-issuer",
        ),
        (
            "no binding",
            rsa.sign(&claims(json!({"repository": "evil/etl"}))),
            StatusCode::FORBIDDEN,
            "no-binding",
        ),
    ];
    for (what, token, status, kind) in &cases {
        let reply = app
            .call(
                Method::PUT,
                &put_path("gh:org/etl/b"),
                Some(DOC),
                token.as_str(),
            )
            .await;
        reply.expect_because(*status, what);
        assert_eq!(reply.problem_type(), *kind, "{what}");
        assert!(
            !reply.text.contains(token.as_str()),
            "{what}: the token is echoed"
        );
        for part in token.split('.').filter(|part| part.len() > 8) {
            assert!(
                !reply.text.contains(part),
                "{what}: a part of the token is echoed"
            );
        }
        if *status == StatusCode::UNAUTHORIZED {
            assert!(reply.header("www-authenticate").is_some(), "{what}");
        }
    }
    // Within the leeway (30 s) an expired token still passes.
    app.call(
        Method::PUT,
        &put_path("gh:org/etl/c"),
        Some(DOC),
        rsa.sign(&good(json!({"exp": now() - 10}))).as_str(),
    )
    .await
    .expect(StatusCode::CREATED);
    let metrics = app.get("/metrics").await.text;
    for (reason, count) in [
        ("audience", 2.0),
        ("expired", 1.0),
        ("invalid", 5.0),
        ("issuer", 1.0),
        ("binding", 1.0),
    ] {
        let sample = format!("statehouse_auth_denied_total{{reason=\"{reason}\"}}");
        assert_eq!(metric(&metrics, &sample), Some(count), "{reason}");
    }
}

#[tokio::test]
async fn unknown_kids_fetch_the_key_set_at_most_once_per_gap() {
    let dir = scratch_dir("jwt");
    let rsa = Key::rsa(&dir, "rsa-1");
    let jwks = JwksServer::start(key_set(&[&rsa])).await;
    // The gap as deployed: 30 s.
    let app = gateway(
        issuers_file(&dir, ("jwks_url", &jwks.url), bindings()),
        KeyTiming::default(),
    )
    .await;
    let good = rsa.sign(&claims(json!({"repository": "org/etl"})));
    until_put(&app, "gh:org/etl/a", &good, StatusCode::CREATED).await;
    let before = jwks.fetches();
    for _ in 0..100 {
        let kid = uuid::Uuid::new_v4().to_string();
        let token = rsa.sign_as(&kid, &claims(json!({"repository": "org/etl"})));
        let reply = app
            .call(
                Method::PUT,
                &put_path("gh:org/etl/a"),
                Some(DOC),
                token.as_str(),
            )
            .await;
        reply.expect(StatusCode::UNAUTHORIZED);
        assert_eq!(reply.problem_type(), "token-invalid");
    }
    assert!(
        jwks.fetches() - before <= 1,
        "{} fetches for 100 unknown kids",
        jwks.fetches() - before
    );
}

#[tokio::test]
async fn an_issuer_down_at_start_gets_503_until_its_keys_come_then_rotation_is_followed() {
    let dir = scratch_dir("jwt");
    let (first, second) = (Key::rsa(&dir, "rsa-1"), Key::ec(&dir, "ec-2"));
    let jwks = JwksServer::start(key_set(&[&first])).await;
    jwks.set_up(false);
    let app = gateway(
        issuers_file(&dir, ("jwks_url", &jwks.url), bindings()),
        quick(),
    )
    .await;
    app.get("/readyz").await.expect(StatusCode::OK);
    let token = first.sign(&claims(json!({"repository": "org/etl"})));
    let reply = app
        .call(
            Method::PUT,
            &put_path("gh:org/etl/a"),
            Some(DOC),
            token.as_str(),
        )
        .await;
    reply.expect(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.problem_type(), "issuer-unavailable");
    let retry: u64 = reply.header("retry-after").unwrap().parse().unwrap();
    assert!(retry >= 1);
    jwks.set_up(true);
    until_put(&app, "gh:org/etl/a", &token, StatusCode::CREATED).await;

    // Rotation: a new kid is fetched for.
    jwks.serve(key_set(&[&first, &second]));
    let rotated = second.sign(&claims(json!({"repository": "org/etl"})));
    until_put(&app, "gh:org/etl/a", &rotated, StatusCode::OK).await;

    // A set over 64 KiB is refused and the last good one kept.
    let fetches = jwks.fetches();
    let mut oversized: Value = serde_json::from_str(&key_set(&[&first])).unwrap();
    oversized["padding"] = json!("x".repeat(70 * 1024));
    jwks.serve(oversized.to_string());
    let unknown = first.sign_as("rsa-9", &claims(json!({"repository": "org/etl"})));
    let deadline = Instant::now() + Duration::from_secs(10);
    while jwks.fetches() == fetches {
        assert!(Instant::now() < deadline, "no fetch for an unknown kid");
        app.call(
            Method::PUT,
            &put_path("gh:org/etl/a"),
            Some(DOC),
            unknown.as_str(),
        )
        .await
        .expect(StatusCode::UNAUTHORIZED);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    app.call(
        Method::PUT,
        &put_path("gh:org/etl/a"),
        Some(DOC),
        rotated.as_str(),
    )
    .await
    .expect(StatusCode::OK);
}

#[tokio::test]
async fn file_tokens_work_beside_jwts_sighup_applies_a_changed_binding_and_no_token_is_logged() {
    let dir = scratch_dir("jwt");
    let rsa = Key::rsa(&dir, "rsa-1");
    let jwks_file = dir.join("jwks.json");
    std::fs::write(&jwks_file, key_set(&[&rsa])).unwrap();
    let binding =
        |name: &str| json!([{"claims": {"sub": "deploy:*"}, "role": "write", "name": name}]);
    let issuers = issuers_file(
        &dir,
        ("jwks_file", jwks_file.to_str().unwrap()),
        binding("first"),
    );
    const FILE_TOKEN: &str = "file-token-0123456789";
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, format!("write {FILE_TOKEN} from-file\n")).unwrap();
    let process = spawn_gateway_process(
        &clickhouse_url(),
        &[
            "--schema",
            &unique_schema(),
            "--tokens-file",
            tokens.to_str().unwrap(),
            "--jwt-issuers",
            issuers.to_str().unwrap(),
        ],
    )
    .await;
    let api = process.api();
    let token = rsa.sign(&claims(json!({"sub": "deploy:nightly"})));
    let name = |api: Api, token: String| async move {
        let reply = api
            .call(Method::GET, "/v1/whoami", None, token.as_str())
            .await;
        reply.expect(StatusCode::OK);
        reply.json()["name"].as_str().unwrap().to_owned()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reply = api
            .call(Method::GET, "/v1/whoami", None, token.as_str())
            .await;
        if reply.status == StatusCode::OK {
            break;
        }
        assert!(Instant::now() < deadline, "{}", reply.text);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(name(api.clone(), token.clone()).await, "first");
    assert_eq!(name(api.clone(), FILE_TOKEN.to_owned()).await, "from-file");

    issuers_file(
        &dir,
        ("jwks_file", jwks_file.to_str().unwrap()),
        binding("second"),
    );
    hang_up(&process);
    let deadline = Instant::now() + Duration::from_secs(10);
    while name(api.clone(), token.clone()).await != "second" {
        assert!(
            Instant::now() < deadline,
            "SIGHUP did not apply the binding"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    std::fs::write(&issuers, "[{\"issuer\": ").unwrap();
    hang_up(&process);
    // Refused tokens, each of which must stay out of the log.
    let refused = [
        rsa.sign(&claims(json!({"sub": "deploy:x", "aud": "other"}))),
        rsa.sign(&claims(json!({"sub": "deploy:x", "exp": now() - 600}))),
        rsa.sign(&claims(json!({"sub": "someone"}))),
    ];
    for bad in &refused {
        let reply = api
            .call(Method::GET, "/v1/whoami", None, bad.as_str())
            .await;
        assert!(reply.status.is_client_error(), "{}", reply.text);
    }
    assert_eq!(
        name(api.clone(), token.clone()).await,
        "second",
        "a broken file keeps the old"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    let logs = loop {
        let metrics = api.get("/metrics").await.text;
        if metric(&metrics, "statehouse_auth_denied_total{reason=\"binding\"}") == Some(1.0) {
            break process.kill_and_collect_logs().await;
        }
        assert!(Instant::now() < deadline, "denials not counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let text: Vec<String> = logs
        .iter()
        .map(|l| String::from_utf8_lossy(l).into_owned())
        .collect();
    assert!(
        text.iter()
            .any(|line| line.contains("issuers not reloaded")),
        "the broken file is reported"
    );
    for secret in refused
        .iter()
        .chain([&token])
        .map(String::as_str)
        .chain([FILE_TOKEN])
    {
        for line in &text {
            assert!(!line.contains(secret), "a token in the log: {line}");
            let signature = secret.rsplit('.').next().unwrap();
            assert!(
                signature.len() < 8 || !line.contains(signature),
                "a signature in the log: {line}"
            );
        }
    }
}

fn hang_up(process: &crate::helpers::GatewayProcess) {
    let pid = process.child.id().expect("running").to_string();
    let status = std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap();
    assert!(status.success());
}
