//! Scoped tokens (issue 31): every operation the router serves, tried by
//! scoped read, write and admin tokens on an id in their scope and on one
//! outside it; listings, a pattern delete and a bulk import with many ids;
//! and a forwarded request held to the scope at the authority.

use std::collections::BTreeSet;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use statehouse::auth::Tokens;
use statehouse::config::Config;

use crate::helpers::{
    Reply, TestApp, encode_id, peer_config, pool_path, spawn_app_with, spawn_configured,
    unique_schema,
};

/// Sees and changes everything: sets the scene and checks it afterwards.
const ROOT: &str = "root-admin-token-0123456789";
const READ_A: &str = "team-a-read-token-0123456789";
const WRITE_A: &str = "team-a-write-token-0123456789";
const ADMIN_A: &str = "team-a-admin-token-0123456789";
const SCOPE: &str = "team-a:*";
const INSIDE: &str = "team-a:tap-to-target";
const OUTSIDE: &str = "team-b:tap-to-target";

fn token_lines(scope: &str) -> String {
    format!(
        "admin {ROOT} root\n\
         read {READ_A} team-a dashboard scope={scope}\n\
         write {WRITE_A} team-a workers scope={scope}\n\
         admin {ADMIN_A} team-a operators scope={scope}\n"
    )
}

fn scoped_tokens(config: &mut Config, scope: &str) {
    let mut tokens = Tokens::default();
    tokens.add("test", &token_lines(scope), '\n').unwrap();
    config.tokens = tokens;
}

fn state_body(n: u64) -> String {
    json!({"completed": {"singer_state": {"bookmarks": {"s": {"replication_key_value": n}}}}})
        .to_string()
}

/// Everything the gateway keeps that a request could change: the states
/// and their history as ClickHouse has them, and the locks and pools an
/// unscoped token sees.
async fn everything(
    app: &TestApp,
) -> (
    Vec<(String, Option<String>, Option<String>)>,
    String,
    Value,
    Value,
) {
    let history = crate::helpers::raw_sql(&format!(
        "SELECT state_id, version, operation FROM `{}`.state_history ORDER BY state_id, version FORMAT TSV",
        app.schema
    ))
    .await;
    let mut locks = app.call(Method::GET, "/v1/locks", None, ROOT).await.json()["locks"].clone();
    if let Some(locks) = locks.as_array_mut() {
        for lock in locks {
            // Renewals move it; who holds which lock is what counts.
            lock["expires_at"] = Value::Null;
        }
    }
    let mut pools = app.call(Method::GET, "/v1/pools", None, ROOT).await.json()["pools"].clone();
    for holder in pools
        .as_array_mut()
        .into_iter()
        .flatten()
        .filter_map(|pool| pool["holders"].as_array_mut())
        .flatten()
    {
        holder["expires_at"] = Value::Null;
    }
    (app.table_snapshot().await, history, locks, pools)
}

/// How a row of the table tries its operation.
enum Try {
    /// The path names a state_id or a pool (named by the state_id rules):
    /// the guard answers for the scope, so any such route, old or new, is
    /// tried the same way.
    NamedId,
    /// A listing: only ids in scope, and a pattern outside matches nothing.
    Listing(&'static str),
    /// Ids in the body: one out of scope refuses the request whole.
    IdsInBody(fn(&str) -> String),
    /// One id in the body, refused as a path's would be.
    IdInBody(fn(&str) -> String),
    /// A run, by its id: one unknown is 404 to every role that may ask.
    Run,
    /// A ticket is settled by its own id: nothing to scope.
    Settle,
    /// What the caller's token may do: it names the token's own scope.
    Caller,
    /// Health, metrics and the page: no token involved.
    Open,
    /// A restore by glob: only ids in scope are planned, named or written.
    Restore,
}

/// One row per operation that names no state_id or pool in its path; an
/// operation the router serves (and the contract test holds against
/// openapi.yaml) without a row here, or a {state_id} or {name}, fails the test.
fn row(method: &Method, template: &str) -> Try {
    if template.contains("{state_id}") || template.contains("{name}") {
        return Try::NamedId;
    }
    match (method.as_str(), template) {
        ("GET", "/v1/states") => Try::Listing("states"),
        ("GET", "/v1/bookmarks") => Try::Listing("bookmarks"),
        ("GET", "/v1/regressions") => Try::Listing("regressions"),
        // A first call delivers nothing; tests/it/feed.rs follows a scoped feed.
        ("GET", "/v1/changes") => Try::Listing("changes"),
        ("GET", "/v1/locks") => Try::Listing("locks"),
        ("GET", "/v1/pools") => Try::Listing("pools"),
        ("DELETE", "/v1/states") => Try::Listing("deleted"),
        ("POST", "/v1/states") => {
            Try::IdsInBody(|id| json!([{"state_id": id, "completed": {"n": 9}}]).to_string())
        }
        ("POST", "/v1/internal/tickets") => {
            Try::IdsInBody(|id| json!({"writes": [{"state_id": id}]}).to_string())
        }
        ("DELETE", "/v1/internal/tickets/{ticket}") => Try::Settle,
        ("GET", "/v1/runs") => Try::Listing("runs"),
        ("GET", "/v1/runs/latest") => Try::Listing("latest"),
        ("POST", "/v1/runs") => Try::IdInBody(|id| {
            json!({"state_id": id, "lease_id": uuid::Uuid::new_v4()}).to_string()
        }),
        ("GET" | "PATCH", "/v1/runs/{run_id}") => Try::Run,
        ("GET", "/v1/whoami") => Try::Caller,
        ("POST", "/v1/restore") => Try::Restore,
        ("GET", "/" | "/assets/{file}" | "/healthz" | "/readyz" | "/metrics") => Try::Open,
        _ => panic!(
            "{method} {template} has no row in tests/it/scope_auth.rs: say how a scoped token may use it"
        ),
    }
}

/// The path of a templated operation on `id`, its other parameters filled in.
fn concrete(template: &str, id: &str, lease: &str) -> String {
    template
        .replace("{state_id}", &encode_id(id))
        .replace("{name}", &encode_id(id))
        .replace("{lease_id}", lease)
        .replace("{stream}", "s")
        .replace("{version}", "2020-01-01T00:00:00.000Z")
}

fn body_for(method: &Method, template: &str) -> Option<String> {
    match (method.as_str(), template) {
        ("PUT" | "PATCH", "/v1/states/{state_id}") => Some(state_body(7)),
        ("POST", "/v1/locks/{state_id}") => {
            Some(json!({"owner": "scoped", "ttl_seconds": 30}).to_string())
        }
        ("POST", "/v1/pools/{name}") => {
            Some(json!({"owner": "scoped", "limit": 1, "ttl_seconds": 30}).to_string())
        }
        ("PUT", "/v1/locks/{state_id}/{lease_id}" | "/v1/pools/{name}/{lease_id}") => {
            Some(json!({"ttl_seconds": 30}).to_string())
        }
        ("POST", "/v1/states/{state_id}/rollback") => {
            Some(json!({"version": "2020-01-01T00:00:00.000Z"}).to_string())
        }
        _ => None,
    }
}

fn ids_listed(reply: &Reply, what: &str) -> BTreeSet<String> {
    reply.expect(StatusCode::OK);
    // A pool is named by `pool`, every other listing's item by `state_id`.
    let key = if what == "pools" { "pool" } else { "state_id" };
    reply.json()[what]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| item[key].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn every_operation_keeps_a_scoped_token_to_its_ids() {
    let app = spawn_app_with(|config| scoped_tokens(config, SCOPE)).await;
    for id in [INSIDE, OUTSIDE] {
        let put = app
            .call(
                Method::PUT,
                &format!("/v1/states/{}", encode_id(id)),
                Some(&state_body(1)),
                ROOT,
            )
            .await;
        put.expect(StatusCode::CREATED);
    }
    // The lock outside is held by someone else, with the lease_id every
    // lock operation on it is then tried with.
    let acquired = app
        .call(
            Method::POST,
            &format!("/v1/locks/{}", encode_id(OUTSIDE)),
            Some(r#"{"owner": "team-b", "ttl_seconds": 600}"#),
            ROOT,
        )
        .await;
    acquired.expect(StatusCode::CREATED);
    let outside_lease = acquired.json()["lease_id"].as_str().unwrap().to_owned();
    // A pool of the same name outside is in use too, so the pool listing has
    // something to leave out and the pool routes something to leave alone.
    let pool = app
        .call(
            Method::POST,
            &pool_path(OUTSIDE),
            Some(r#"{"owner": "team-b", "limit": 1, "ttl_seconds": 600}"#),
            ROOT,
        )
        .await;
    pool.expect(StatusCode::CREATED);
    let before = everything(&app).await;

    let operations = statehouse::http::operation_list();
    assert!(operations.len() > 20, "the router's whole table");
    let mut named = 0;
    for (template, method) in &operations {
        let try_ = row(method, template);
        for token in [READ_A, WRITE_A, ADMIN_A] {
            let what = format!("{method} {template} with {token}");
            match &try_ {
                Try::NamedId => {
                    named += 1;
                    let path = concrete(template, OUTSIDE, &outside_lease);
                    let body = body_for(method, template);
                    let reply = app
                        .call(method.clone(), &path, body.as_deref(), token)
                        .await;
                    reply.expect_because(StatusCode::FORBIDDEN, &what);
                    // A token too weak for the operation is refused for that
                    // first; every other one for the scope.
                    let kind = reply.problem_type();
                    assert!(
                        kind == "out-of-scope" || kind == "forbidden",
                        "{what}: {kind}"
                    );
                    if token == ADMIN_A {
                        assert_eq!(kind, "out-of-scope", "{what}");
                    }
                    // The same id that does not exist: the same answer.
                    let missing = concrete(template, "team-b:never-written", &outside_lease);
                    let reply = app
                        .call(method.clone(), &missing, body.as_deref(), token)
                        .await;
                    assert_eq!(reply.problem_type(), kind, "{what} on a missing id");
                }
                Try::Listing(what_listed) => {
                    if *what_listed == "deleted" {
                        // Tried below, once the rest is done.
                        continue;
                    }
                    let listed = ids_listed(
                        &app.call(method.clone(), template, None, token).await,
                        what_listed,
                    );
                    assert!(!listed.contains(OUTSIDE), "{what}: {listed:?}");
                    let outside = format!("{template}?pattern=team-b:*");
                    let none = if matches!(*what_listed, "locks" | "pools") {
                        // The lock and pool listings take no pattern.
                        BTreeSet::new()
                    } else {
                        ids_listed(
                            &app.call(method.clone(), &outside, None, token).await,
                            what_listed,
                        )
                    };
                    assert!(none.is_empty(), "{what} pattern outside: {none:?}");
                }
                Try::IdInBody(body) => {
                    let reply = app
                        .call(method.clone(), template, Some(&body(OUTSIDE)), token)
                        .await;
                    reply.expect_because(StatusCode::FORBIDDEN, &what);
                    let kind = if token == READ_A {
                        "forbidden"
                    } else {
                        "out-of-scope"
                    };
                    assert_eq!(reply.problem_type(), kind, "{what}");
                }
                Try::Run => {
                    let path = template.replace("{run_id}", &uuid::Uuid::new_v4().to_string());
                    let body = (method == Method::PATCH).then_some(r#"{"exit_code": 0}"#);
                    let reply = app.call(method.clone(), &path, body, token).await;
                    let expected = if token == READ_A && method == Method::PATCH {
                        StatusCode::FORBIDDEN
                    } else {
                        StatusCode::NOT_FOUND
                    };
                    reply.expect_because(expected, &what);
                }
                Try::IdsInBody(body) => {
                    let mixed = app
                        .call(method.clone(), template, Some(&body(OUTSIDE)), token)
                        .await;
                    mixed.expect_because(StatusCode::FORBIDDEN, &what);
                    let kind = mixed.problem_type();
                    if token == READ_A {
                        assert_eq!(kind, "forbidden", "{what}");
                    } else {
                        assert_eq!(kind, "out-of-scope", "{what}");
                        assert!(
                            mixed.json()["detail"].as_str().unwrap().contains(OUTSIDE),
                            "{what}: names the entry"
                        );
                    }
                }
                Try::Settle => {
                    let path = template.replace("{ticket}", &uuid::Uuid::new_v4().to_string());
                    let reply = app.call(method.clone(), &path, None, token).await;
                    let expected = if token == READ_A {
                        StatusCode::FORBIDDEN
                    } else {
                        StatusCode::NO_CONTENT
                    };
                    reply.expect_because(expected, &what);
                }
                Try::Caller => {
                    let reply = app.call(method.clone(), template, None, token).await;
                    reply.expect_because(StatusCode::OK, &what);
                    assert_eq!(reply.json()["scope"], json!([SCOPE]), "{what}");
                }
                Try::Restore => {
                    let at = humantime::format_rfc3339_millis(std::time::SystemTime::now());
                    let body = json!({"pattern": "*", "at": at.to_string()}).to_string();
                    let reply = app.call(method.clone(), template, Some(&body), token).await;
                    if token == READ_A {
                        reply.expect_because(StatusCode::FORBIDDEN, &what);
                    } else {
                        reply.expect_because(StatusCode::OK, &what);
                        let answer = reply.json().to_string();
                        assert!(!answer.contains(OUTSIDE), "{what}: {answer}");
                    }
                }
                Try::Open => {
                    let path = template.replace("{file}", "app.js");
                    let reply = app.request(method.clone(), &path, None, &[]).await;
                    reply.expect_because(StatusCode::OK, &what);
                }
            }
        }
    }
    assert!(named >= 3 * 12, "every operation on a named id was tried");
    assert_eq!(
        everything(&app).await,
        before,
        "nothing outside the scope changed"
    );

    // Inside the scope the same tokens get on with their work: no operation
    // answers out-of-scope, and listings show the id.
    let (inside_lease, _) = {
        let reply = app
            .call(
                Method::POST,
                &format!("/v1/locks/{}", encode_id(INSIDE)),
                Some(r#"{"owner": "team-a", "ttl_seconds": 600}"#),
                WRITE_A,
            )
            .await;
        reply.expect(StatusCode::CREATED);
        (reply.json()["lease_id"].as_str().unwrap().to_owned(), ())
    };
    for (template, method) in &operations {
        if !matches!(row(method, template), Try::NamedId) {
            continue;
        }
        let path = concrete(template, INSIDE, &inside_lease);
        let body = body_for(method, template);
        let bearer = format!("Bearer {ADMIN_A}");
        let reply = app
            .request(
                method.clone(),
                &path,
                body.as_deref(),
                &[("authorization", &bearer), ("lease-id", &inside_lease)],
            )
            .await;
        assert_ne!(
            reply.status,
            StatusCode::UNAUTHORIZED,
            "{method} {template}: {}",
            reply.text
        );
        if reply.status == StatusCode::FORBIDDEN {
            panic!(
                "{method} {template} refused inside the scope: {}",
                reply.text
            );
        }
    }
    for what in ["states", "bookmarks"] {
        let listed = ids_listed(
            &app.call(Method::GET, &format!("/v1/{what}"), None, READ_A)
                .await,
            what,
        );
        assert!(
            listed.iter().all(|id| id.starts_with("team-a:")),
            "{what}: {listed:?}"
        );
    }

    // A pattern delete by the scoped admin takes its own ids only.
    app.call(
        Method::PUT,
        &format!("/v1/states/{}", encode_id("team-a:second")),
        Some(&state_body(1)),
        ROOT,
    )
    .await;
    let deleted = app
        .call(Method::DELETE, "/v1/states?pattern=*", None, ADMIN_A)
        .await;
    deleted.expect(StatusCode::OK);
    let left: BTreeSet<String> = app
        .table_snapshot()
        .await
        .into_iter()
        .map(|(id, ..)| id)
        .collect();
    assert_eq!(
        left,
        BTreeSet::from([OUTSIDE.to_owned()]),
        "only ids in scope deleted"
    );
    let outside_only = app
        .call(Method::DELETE, "/v1/states?pattern=team-b:*", None, ADMIN_A)
        .await;
    assert_eq!(
        outside_only.json()["deleted"],
        0,
        "a pattern outside matches nothing"
    );
}

#[tokio::test]
async fn many_ids_a_mixed_import_a_pattern_delete_and_pages_keep_to_the_scope() {
    let app = spawn_app_with(|config| scoped_tokens(config, "team-a:*,shared:?")).await;
    let mut all = Vec::new();
    for team in ["team-a", "team-b"] {
        for n in 0..5 {
            all.push(json!({"state_id": format!("{team}:{n}"), "completed": {"n": n}}));
        }
    }
    all.push(json!({"state_id": "shared:1", "completed": {"n": 1}}));
    all.push(json!({"state_id": "shared:12", "completed": {"n": 12}}));
    let bulk = Value::Array(all).to_string();
    let mixed = app
        .call(Method::POST, "/v1/states", Some(&bulk), WRITE_A)
        .await;
    mixed.expect(StatusCode::FORBIDDEN);
    assert_eq!(mixed.problem_type(), "out-of-scope");
    assert!(
        mixed.json()["detail"]
            .as_str()
            .unwrap()
            .contains("team-b:0"),
        "{}",
        mixed.text
    );
    assert!(app.table_snapshot().await.is_empty(), "nothing written");
    let imported = app
        .call(Method::POST, "/v1/states", Some(&bulk), ROOT)
        .await;
    imported.expect(StatusCode::OK);

    let expected: BTreeSet<String> = (0..5)
        .map(|n| format!("team-a:{n}"))
        .chain(["shared:1".to_owned()])
        .collect();
    for (path, what) in [
        ("/v1/states?limit=2", "states"),
        ("/v1/states?limit=2&include=documents", "states"),
        ("/v1/bookmarks?limit=2", "bookmarks"),
    ] {
        let mut seen = BTreeSet::new();
        let mut next = path.to_owned();
        for _ in 0..10 {
            let page = app.call(Method::GET, &next, None, READ_A).await;
            seen.extend(ids_listed(&page, what));
            match page.json()["next_cursor"].as_str() {
                Some(cursor) => next = format!("{path}&cursor={cursor}"),
                None => break,
            }
        }
        assert_eq!(seen, expected, "{path}");
    }

    let deleted = app
        .call(Method::DELETE, "/v1/states?pattern=*:?", None, ADMIN_A)
        .await;
    assert_eq!(deleted.json()["deleted"], 6, "{}", deleted.text);
    let left: BTreeSet<String> = app
        .table_snapshot()
        .await
        .into_iter()
        .map(|(id, ..)| id)
        .collect();
    let expected_left: BTreeSet<String> = (0..5)
        .map(|n| format!("team-b:{n}"))
        .chain(["shared:12".to_owned()])
        .collect();
    assert_eq!(left, expected_left);
}

/// Gateway A lets a token name `team-a:*`; gateway B, the authority for the
/// ids here, only `team-a:x*`. What A forwards is held to B's rule for the
/// token, so the scope travels with the Authorization header.
#[tokio::test]
async fn the_authority_holds_a_forwarded_request_to_the_tokens_scope() {
    let schema = unique_schema();
    let mut config_a = peer_config(&schema);
    scoped_tokens(&mut config_a, SCOPE);
    let mut config_b = peer_config(&schema);
    scoped_tokens(&mut config_b, "team-a:x*");
    let a = spawn_configured(config_a).await;
    let b = spawn_configured(config_b).await;
    let mut leases = Vec::new();
    for id in ["team-a:x1", "team-a:y1"] {
        let granted = b
            .call(
                Method::POST,
                &format!("/v1/locks/{id}"),
                Some(r#"{"owner": "w", "ttl_seconds": 600}"#),
                ROOT,
            )
            .await;
        granted.expect(StatusCode::CREATED);
        leases.push(granted.json()["lease_id"].as_str().unwrap().to_owned());
    }
    let bearer = format!("Bearer {WRITE_A}");
    let put = |id: &'static str, lease: String| {
        let a = a.api.clone();
        let bearer = bearer.clone();
        async move {
            a.request(
                Method::PUT,
                &format!("/v1/states/{id}"),
                Some(&state_body(1)),
                &[("authorization", &bearer), ("lease-id", &lease)],
            )
            .await
        }
    };
    let allowed = put("team-a:x1", leases[0].clone()).await;
    allowed.expect(StatusCode::CREATED);
    let refused = put("team-a:y1", leases[1].clone()).await;
    refused.expect(StatusCode::FORBIDDEN);
    assert_eq!(refused.problem_type(), "out-of-scope");
    // A bulk import through A: B admits its entries by a ticket, asked for
    // with the client's token, under B's rule for it.
    let import = |id: &str, lease: &str| {
        json!([{"state_id": id, "lease_id": lease, "completed": {"n": 2}}]).to_string()
    };
    let imported = a
        .call(
            Method::POST,
            "/v1/states",
            Some(&import("team-a:x1", &leases[0])),
            WRITE_A,
        )
        .await;
    imported.expect(StatusCode::OK);
    // A refuses what its own rule refuses; what only B refuses, B refuses
    // to admit (A tells its client to retry: the two disagree only while
    // their tokens files do, mid-reload).
    let refused = a
        .call(
            Method::POST,
            "/v1/states",
            Some(&import("team-b:z1", &leases[1])),
            WRITE_A,
        )
        .await;
    assert_eq!(refused.problem_type(), "out-of-scope", "{}", refused.text);
    let refused = a
        .call(
            Method::POST,
            "/v1/states",
            Some(&import("team-a:y1", &leases[1])),
            WRITE_A,
        )
        .await;
    assert!(!refused.status.is_success(), "{}", refused.text);
    let ticket = json!({"writes": [{"state_id": "team-a:y1", "lease_id": leases[1]}]}).to_string();
    let refused = b
        .call(Method::POST, "/v1/internal/tickets", Some(&ticket), WRITE_A)
        .await;
    assert_eq!(refused.problem_type(), "out-of-scope", "{}", refused.text);
    let ids: Vec<String> = a
        .table_snapshot()
        .await
        .into_iter()
        .map(|(id, ..)| id)
        .collect();
    assert_eq!(ids, ["team-a:x1"]);
}
