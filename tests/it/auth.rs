//! Bearer tokens and roles: read for dashboards, write for workers, admin for operators.

use reqwest::{Method, StatusCode};
use statehouse::auth::Tokens;

use crate::helpers::{TestApp, spawn_app_with};

const READ: &str = "read-token-0123456789";
const WRITE: &str = "write-token-0123456789";
const ADMIN: &str = "admin-token-0123456789";

async fn app_with_tokens(protect_metrics: bool) -> TestApp {
    spawn_app_with(|config| {
        let mut tokens = Tokens::default();
        tokens
            .add(
                "test",
                &format!("read {READ}, write {WRITE}, admin {ADMIN}"),
                ',',
            )
            .unwrap();
        config.tokens = tokens;
        config.protect_metrics = protect_metrics;
    })
    .await
}

#[tokio::test]
async fn each_role_can_do_its_part_and_no_more() {
    let app = app_with_tokens(false).await;
    let doc = Some(r#"{"completed": {"v": 1}}"#);
    let lock = Some(r#"{"owner": "w"}"#);
    // (method, path, body, least role that may call it)
    let cases: [(Method, &str, Option<&str>, &str); 8] = [
        (Method::GET, "/v1/states", None, READ),
        (Method::GET, "/v1/locks", None, READ),
        (Method::PUT, "/v1/states/a", doc, WRITE),
        (Method::PATCH, "/v1/states/a", doc, WRITE),
        (Method::POST, "/v1/locks/b", lock, WRITE),
        (Method::DELETE, "/v1/locks/b", None, ADMIN),
        (Method::DELETE, "/v1/states?pattern=zzz*", None, ADMIN),
        (Method::DELETE, "/v1/states/a", None, WRITE),
    ];
    let rank = |token: &str| {
        [READ, WRITE, ADMIN]
            .iter()
            .position(|t| *t == token)
            .unwrap()
    };
    for (method, path, body, least) in cases {
        app.call(method.clone(), path, body, None)
            .await
            .expect_because(StatusCode::UNAUTHORIZED, format!("{method} {path}"));
        app.call(method.clone(), path, body, Some("not-a-token-at-all-000"))
            .await
            .expect(StatusCode::UNAUTHORIZED);
        for token in [READ, WRITE, ADMIN] {
            let status = app
                .call(method.clone(), path, body, Some(token))
                .await
                .status;
            if rank(token) < rank(least) {
                assert_eq!(
                    status,
                    StatusCode::FORBIDDEN,
                    "{method} {path} with {token}"
                );
            } else {
                assert_ne!(
                    status,
                    StatusCode::FORBIDDEN,
                    "{method} {path} with {token}"
                );
                assert_ne!(
                    status,
                    StatusCode::UNAUTHORIZED,
                    "{method} {path} with {token}"
                );
            }
        }
    }
}

#[tokio::test]
async fn refusals_are_problems_that_say_how_to_authenticate() {
    let app = app_with_tokens(false).await;
    let missing = app.get("/v1/states").await;
    assert_eq!(missing.problem_type(), "unauthorized");
    assert_eq!(
        missing.header("www-authenticate"),
        Some("Bearer realm=\"statehouse\"")
    );
    let weak = app
        .call(Method::PUT, "/v1/states/x", Some("{}"), READ)
        .await;
    assert_eq!(weak.problem_type(), "forbidden");
    assert_eq!(
        weak.json()["detail"],
        "this needs a write token; yours is a read token"
    );
    let admin_only = app.call(Method::DELETE, "/v1/locks/x", None, WRITE).await;
    assert_eq!(
        admin_only.json()["detail"],
        "this needs an admin token; yours is a write token"
    );
    assert_eq!(
        app.table_snapshot().await,
        Vec::new(),
        "refused writes wrote nothing"
    );
}

#[tokio::test]
async fn health_stays_open_and_metrics_can_be_protected() {
    let open = app_with_tokens(false).await;
    let guarded = app_with_tokens(true).await;
    let cases = [
        (&open, "/healthz", None, StatusCode::OK),
        (&open, "/readyz", None, StatusCode::OK),
        (&open, "/metrics", None, StatusCode::OK),
        (&guarded, "/healthz", None, StatusCode::OK),
        (&guarded, "/metrics", None, StatusCode::UNAUTHORIZED),
        (&guarded, "/metrics", Some(READ), StatusCode::OK),
    ];
    for (app, path, token, status) in cases {
        app.call(Method::GET, path, None, token)
            .await
            .expect(status);
    }
}

#[tokio::test]
async fn a_lease_taken_with_a_write_token_works_end_to_end() {
    let app = app_with_tokens(false).await;
    let auth = format!("Bearer {WRITE}");
    let lease = app
        .call(
            Method::POST,
            "/v1/locks/job",
            Some(r#"{"owner": "w"}"#),
            WRITE,
        )
        .await
        .json();
    let lease_id = lease["lease_id"].as_str().unwrap();
    let write = app
        .request(
            Method::PUT,
            "/v1/states/job",
            Some(r#"{"completed": {"n": 1}}"#),
            &[("authorization", &auth), ("lease-id", lease_id)],
        )
        .await;
    write.expect(StatusCode::CREATED);
    app.call(
        Method::DELETE,
        &format!("/v1/locks/job/{lease_id}"),
        None,
        WRITE,
    )
    .await
    .expect(StatusCode::NO_CONTENT);
}

#[tokio::test]
async fn the_bearer_scheme_is_case_insensitive_and_blanks_may_precede_the_token() {
    let app = app_with_tokens(false).await;
    for scheme in ["Bearer", "bearer", "BEARER", "bEaReR"] {
        for blanks in [" ", "   ", "\t", " \t "] {
            let value = format!("{scheme}{blanks}{WRITE}");
            let reply = app
                .request(
                    Method::PUT,
                    "/v1/states/schemes",
                    Some(r#"{"completed": {"v": 1}}"#),
                    &[("authorization", &value)],
                )
                .await;
            assert!(reply.status.is_success(), "{value:?}: {}", reply.text);
        }
    }
    for value in [
        format!("Bearer{WRITE}"),
        format!("Basic {WRITE}"),
        format!("Bearer: {WRITE}"),
        "Bearer ".to_owned(),
    ] {
        let reply = app
            .request(
                Method::GET,
                "/v1/states",
                None,
                &[("authorization", &value)],
            )
            .await;
        reply.expect_because(StatusCode::UNAUTHORIZED, format!("{value:?}"));
    }
}

#[tokio::test]
async fn two_authorization_headers_are_refused_and_write_nothing() {
    let app = app_with_tokens(false).await;
    let write = format!("Bearer {WRITE}");
    let read = format!("Bearer {READ}");
    let unknown = "Bearer not-a-token-at-all-000".to_owned();
    for pair in [
        [&write, &write],
        [&read, &write],
        [&write, &unknown],
        [&unknown, &write],
    ] {
        let reply = app
            .request(
                Method::PUT,
                "/v1/states/twice",
                Some(r#"{"completed": {"v": 1}}"#),
                &[("authorization", pair[0]), ("authorization", pair[1])],
            )
            .await;
        reply.expect_because(StatusCode::BAD_REQUEST, format!("{pair:?}"));
        assert_eq!(reply.problem_type(), "invalid-header");
    }
    assert_eq!(app.table_snapshot().await, Vec::new());
    // Every operation that takes a token, even one with no other 400 (as openapi.yaml says).
    let locks = app
        .request(
            Method::GET,
            "/v1/locks",
            None,
            &[("authorization", &read), ("authorization", &read)],
        )
        .await;
    locks.expect(StatusCode::BAD_REQUEST);
    assert_eq!(locks.problem_type(), "invalid-header");
    // Open endpoints take no token, so they do not look at it.
    let health = app
        .request(
            Method::GET,
            "/healthz",
            None,
            &[("authorization", &write), ("authorization", &read)],
        )
        .await;
    health.expect(StatusCode::OK);
}

#[tokio::test]
async fn history_names_each_change_by_its_token_and_a_read_token_cannot_roll_back() {
    const NAMED: &str = "named-token-0123456789";
    let app = spawn_app_with(|config| {
        let mut tokens = Tokens::default();
        tokens
            .add(
                "test",
                &format!("write {NAMED} etl-worker-7\nwrite {WRITE}\nread {READ}"),
                '\n',
            )
            .unwrap();
        config.tokens = tokens;
    })
    .await;
    let doc = Some(r#"{"completed": {"v": 1}}"#);
    app.call(Method::PUT, "/v1/states/named", doc, Some(NAMED))
        .await
        .expect(StatusCode::CREATED);
    app.call(Method::PUT, "/v1/states/named", doc, Some(WRITE))
        .await
        .expect(StatusCode::OK);
    let listing = app
        .call(Method::GET, "/v1/states/named/history", None, READ)
        .await
        .json();
    let versions = listing["versions"].as_array().unwrap();
    assert_eq!(versions[1]["actor"], "etl-worker-7");
    let unnamed = versions[0]["actor"].as_str().unwrap();
    assert!(
        unnamed.starts_with("write:") && unnamed.len() == "write:".len() + 8,
        "role and a short digest: {unnamed}"
    );
    assert!(!unnamed.contains(WRITE), "never the token itself");
    let body = serde_json::json!({"version": versions[1]["version"]}).to_string();
    app.call(
        Method::POST,
        "/v1/states/named/rollback",
        Some(&body),
        Some(READ),
    )
    .await
    .expect(StatusCode::FORBIDDEN);
    app.call(
        Method::POST,
        "/v1/states/named/rollback",
        Some(&body),
        Some(NAMED),
    )
    .await
    .expect(StatusCode::OK);
}
