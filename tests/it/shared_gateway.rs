//! A shared gateway that no single client can exhaust (issue 35): each
//! attack of the issue is sent, and another client is still served. The
//! limits are the issue's: 16 lock waiters and 8 requests at once, half of
//! each for one token.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::json;
use statehouse::auth::Tokens;
use statehouse::config::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::helpers::{
    Api, TestApp, metric, peer_config, spawn_app, spawn_configured, unique_schema,
};

const TEAM_A: &str = "team-a-write-token-0123456789";
const TEAM_B: &str = "team-b-write-token-0123456789";
const ADMIN: &str = "operators-admin-token-0123456789";

/// Two teams, each kept to its own ids, and the operators.
fn two_teams(config: &mut Config) {
    let mut tokens = Tokens::default();
    tokens
        .add(
            "test",
            &format!(
                "write {TEAM_A} team-a scope=a:*\nwrite {TEAM_B} team-b scope=b:*\nadmin {ADMIN} operators\n"
            ),
            '\n',
        )
        .unwrap();
    config.tokens = tokens;
    config.concurrency.lock_waiters = 16;
    config.concurrency.requests = 8;
    // Team A's uploads trickle for as long as a test on a loaded machine runs.
    config.client_timeouts.body_read = Duration::from_secs(300);
}

fn acquire_body(owner: &str, wait: f64) -> String {
    json!({"owner": owner, "ttl_seconds": 60, "wait_seconds": wait}).to_string()
}

/// A lease on `id` for `owner` as `token`.
async fn lease_as(api: &Api, id: &str, owner: &str, token: &str) -> String {
    let reply = api
        .call(
            Method::POST,
            &format!("/v1/locks/{id}"),
            Some(&acquire_body(owner, 0.0)),
            token,
        )
        .await;
    reply.expect(StatusCode::CREATED).json()["lease_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// A lease on `id` for `token`.
async fn lease(api: &Api, id: &str, token: &str) -> String {
    lease_as(api, id, "holder", token).await
}

/// Releases `token`'s lease on `id`, which must be current.
async fn release(api: &Api, id: &str, lease_id: &str, token: &str) {
    api.call(
        Method::DELETE,
        &format!("/v1/locks/{id}/{lease_id}"),
        None,
        token,
    )
    .await
    .expect(StatusCode::NO_CONTENT);
}

/// Team B's acquire of a free id of its own, and its read, while team A
/// does its worst: both answered, not shed. How soon is the machine's
/// speed; that team A still holds its share meanwhile is checked by the
/// callers.
async fn team_b_is_served(api: &Api, round: usize) {
    let id = format!("b:free-{round}");
    let lease_id = lease_as(api, &id, "team-b", TEAM_B).await;
    let read = api
        .call(Method::GET, "/v1/states?pattern=b:*", None, TEAM_B)
        .await;
    read.expect(StatusCode::OK);
    release(api, &id, &lease_id, TEAM_B).await;
}

/// How long a test waits for what comes at once (team A's refusals): a
/// bound only a hang reaches.
const HANG: Duration = Duration::from_secs(30);

/// Team A's 16 waiters on its own held id, sent to `entry`; `authority`
/// holds the id. Past team A's share they get 429 with Retry-After at
/// once, the others wait in line (a minute), and team B is served while
/// they do, at both gateways.
async fn team_a_floods_waiters(entry: &TestApp, authority: &TestApp) {
    let held = lease(authority, "a:held", TEAM_A).await;
    let waiters: Vec<_> = (0..16)
        .map(|n| {
            let api = entry.api.clone();
            tokio::spawn(async move {
                api.call(
                    Method::POST,
                    "/v1/locks/a:held",
                    Some(&acquire_body(&format!("waiter-{n}"), 60.0)),
                    TEAM_A,
                )
                .await
            })
        })
        .collect();
    let give_up = Instant::now() + HANG;
    while waiters.iter().filter(|w| w.is_finished()).count() < 8 {
        assert!(Instant::now() < give_up, "team A was never refused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for round in 0..2 {
        team_b_is_served(entry, round).await;
        team_b_is_served(authority, round + 10).await;
    }
    let (refused, waiting): (Vec<_>, Vec<_>) = waiters.into_iter().partition(|w| w.is_finished());
    assert_eq!(
        waiting.len(),
        8,
        "team A's share of the 16 waiters is still in line, team B served meanwhile"
    );
    assert_eq!(refused.len(), 8, "team A holds at most half the 16 waiters");
    for waiter in refused {
        let reply = waiter.await.unwrap();
        reply.expect(StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(reply.problem_type(), "too-many-requests");
        assert_eq!(reply.header("retry-after"), Some("1"));
    }
    for waiter in waiting {
        waiter.abort();
    }
    release(authority, "a:held", &held, TEAM_A).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_teams_waiters_leave_another_teams_acquire_and_read_answered() {
    let app = spawn_app_with_teams(&unique_schema(), false).await;
    team_a_floods_waiters(&app, &app).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_teams_waiters_through_a_second_gateway_leave_another_team_answered() {
    let (authority, entry) = authority_and_entry().await;
    team_a_floods_waiters(&entry, &authority).await;
}

/// A gateway that will be the authority of the ids a test takes there, and
/// a second one on the same database that forwards to it.
async fn authority_and_entry() -> (TestApp, TestApp) {
    let schema = unique_schema();
    let authority = spawn_app_with_teams(&schema, true).await;
    let entry = spawn_app_with_teams(&schema, true).await;
    (authority, entry)
}

async fn spawn_app_with_teams(schema: &str, peer: bool) -> TestApp {
    let mut config = peer_config(schema);
    if !peer {
        config.locks.advertise_url = None;
    }
    two_teams(&mut config);
    spawn_configured(config).await
}

/// Opens a PUT of `id` whose body never finishes arriving, and answers the
/// connection with what came back so far once the head is in.
async fn slow_upload(base: &str, id: &str) -> TcpStream {
    let addr = base.trim_start_matches("http://");
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "PUT /v1/states/{id} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {TEAM_A}\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{{\"completed\": {{\"pad\": \""
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream
}

/// The status line's code of what `stream` answered within `wait`, if any.
async fn answered(stream: &mut TcpStream, wait: Duration) -> Option<u16> {
    let mut buf = [0u8; 512];
    let read = tokio::time::timeout(wait, stream.read(&mut buf))
        .await
        .ok()?;
    let n = read.ok()?;
    String::from_utf8_lossy(&buf[..n])
        .get(9..12)
        .and_then(|code| code.parse().ok())
}

/// Whether `stream` is still open with nothing answered on it.
async fn unanswered(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 1];
    tokio::time::timeout(Duration::from_millis(10), stream.read(&mut buf))
        .await
        .is_err()
}

/// Team A's 8 uploads that trickle in, sent to `entry` for ids `authority`
/// is the authority of: 4 hold team A's share, 4 are refused with 429 at
/// once, and team B is served while the 4 still trickle, unanswered.
async fn team_a_uploads_slowly(entry: &TestApp, authority: &TestApp) {
    for n in 0..8 {
        // The authority holds each id's claim, so the uploads are forwarded.
        let id = format!("a:slow-{n}");
        let held = lease(authority, &id, TEAM_A).await;
        release(authority, &id, &held, TEAM_A).await;
    }
    let mut uploads = Vec::new();
    for n in 0..8 {
        uploads.push((
            slow_upload(&entry.base, &format!("a:slow-{n}")).await,
            false,
        ));
    }
    let give_up = Instant::now() + HANG;
    while uploads.iter().filter(|(_, refused)| *refused).count() < 4 {
        assert!(Instant::now() < give_up, "team A was never refused");
        for (upload, refused) in uploads.iter_mut().filter(|(_, refused)| !*refused) {
            match answered(upload, Duration::from_millis(20)).await {
                Some(429) => *refused = true,
                Some(other) => panic!("a slow upload answered {other}"),
                None => {}
            }
        }
    }
    for round in 0..3 {
        team_b_is_served(entry, 20 + round).await;
        team_b_is_served(authority, 30 + round).await;
    }
    for (upload, refused) in &mut uploads {
        if !*refused {
            assert!(
                unanswered(upload).await,
                "team A's share still trickles, team B served meanwhile"
            );
        }
    }
    assert_eq!(
        uploads.iter().filter(|(_, refused)| *refused).count(),
        4,
        "team A holds at most half the 8 requests"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_teams_slow_uploads_leave_another_team_answered() {
    let app = spawn_app_with_teams(&unique_schema(), false).await;
    team_a_uploads_slowly(&app, &app).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_teams_slow_uploads_through_a_second_gateway_leave_another_team_answered() {
    let (authority, entry) = authority_and_entry().await;
    team_a_uploads_slowly(&entry, &authority).await;
}

#[tokio::test]
async fn made_up_methods_add_nothing_to_metrics() {
    let app = spawn_app().await;
    let size = || async { app.get("/metrics").await.text.len() };
    // Every series a first request of each kind adds exists before the attack.
    let _ = app.get("/nowhere").await;
    let before = size().await;
    for n in 0..150u32 {
        let name: String = (0..2048)
            .map(|i| char::from(b'A' + ((n * 31 + i) % 26) as u8))
            .collect();
        let method = Method::from_bytes(name.as_bytes()).unwrap();
        let reply = app
            .client
            .request(method, format!("{}/v1/states", app.base))
            .send()
            .await
            .unwrap();
        assert!(reply.status().is_client_error(), "{}", reply.status());
    }
    let metrics = app.get("/metrics").await.text;
    assert!(metrics.contains(r#"method="other""#), "{metrics}");
    let grown = metrics.len() - before;
    eprintln!("150 made-up methods of 2 KiB grew /metrics by {grown} bytes");
    assert!(grown < 20 * 1024, "/metrics grew by {grown} bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readiness_probes_share_one_check_a_second() {
    let app = spawn_app().await;
    let pings = |text: &str| {
        metric(
            text,
            r#"statehouse_clickhouse_query_duration_seconds_count{operation="ping"}"#,
        )
        .unwrap_or(0.0)
    };
    let before = pings(&app.get("/metrics").await.text);
    let started = Instant::now();
    let probers: Vec<_> = (0..16)
        .map(|_| {
            let api = app.api.clone();
            tokio::spawn(async move {
                for _ in 0..25 {
                    let ready = api.get("/readyz").await;
                    ready.expect(StatusCode::OK);
                }
            })
        })
        .collect();
    for prober in probers {
        prober.await.unwrap();
    }
    let seconds = started.elapsed().as_secs_f64();
    let sent = pings(&app.get("/metrics").await.text) - before;
    eprintln!("400 probes from 16 tasks in {seconds:.2} s sent {sent} pings");
    // A check at most a second old answers: one a second, and the first.
    assert!(
        sent <= seconds.ceil() + 1.0,
        "400 probes in {seconds:.1} s sent {sent} pings"
    );
}

/// Sends `method path` with `headers` and a `text/plain` body, as a form or
/// a no-cors fetch of another site's page would.
async fn simple_request(
    app: &TestApp,
    method: Method,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut request = app
        .client
        .request(method, format!("{}{path}", app.base))
        .header("content-type", "text/plain")
        .body(body.to_owned());
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap()
}

async fn problem_of(response: reqwest::Response) -> (StatusCode, String) {
    let status = response.status();
    let body: serde_json::Value = response.json().await.unwrap();
    (status, body["type"].as_str().unwrap_or_default().to_owned())
}

#[tokio::test]
async fn a_web_page_cannot_write_to_a_gateway_without_tokens() {
    let app = spawn_app().await;
    let document = json!({"completed": {"n": 1}}).to_string();
    let evil = [("origin", "http://evil.example")];
    let put = simple_request(&app, Method::PUT, "/v1/states/web", &document, &evil).await;
    assert_eq!(
        problem_of(put).await,
        (
            StatusCode::FORBIDDEN,
            "urn:statehouse:problem:cross-origin".to_owned()
        )
    );
    let batch = json!([{"state_id": "web-import", "completed": {"n": 1}}]).to_string();
    let import = simple_request(&app, Method::POST, "/v1/states", &batch, &evil).await;
    assert_eq!(import.status(), StatusCode::FORBIDDEN);
    let opaque = [("origin", "null")];
    let sandboxed = simple_request(&app, Method::PUT, "/v1/states/web", &document, &opaque).await;
    assert_eq!(sandboxed.status(), StatusCode::FORBIDDEN);
    app.get_state("web").await.expect(StatusCode::NOT_FOUND);
    app.get_state("web-import")
        .await
        .expect(StatusCode::NOT_FOUND);

    // A cross-origin read is the browser's to keep from the page.
    let read = simple_request(&app, Method::GET, "/v1/states", "", &evil).await;
    assert_eq!(read.status(), StatusCode::OK);
    // curl sends no Origin; the dashboard's own page sends its own.
    let curl = simple_request(&app, Method::PUT, "/v1/states/web", &document, &[]).await;
    assert_eq!(curl.status(), StatusCode::CREATED);
    let own = [("origin", app.base.as_str())];
    let page = simple_request(&app, Method::PUT, "/v1/states/web", &document, &own).await;
    assert_eq!(page.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_rebound_host_is_not_answered_by_a_gateway_without_tokens() {
    let app = spawn_app().await;
    app.put_state("rebound", &json!({"completed": {"n": 1}}))
        .await;
    for host in [
        "evil.example",
        "evil.example:8080",
        "localhost.evil.example",
    ] {
        let reply = simple_request(
            &app,
            Method::GET,
            "/v1/states/rebound",
            "",
            &[("host", host)],
        )
        .await;
        assert_eq!(
            problem_of(reply).await,
            (
                StatusCode::MISDIRECTED_REQUEST,
                "urn:statehouse:problem:unknown-host".to_owned()
            ),
            "{host}"
        );
    }
    for host in ["localhost", "127.0.0.1", "[::1]:8080"] {
        let reply = simple_request(
            &app,
            Method::GET,
            "/v1/states/rebound",
            "",
            &[("host", host)],
        )
        .await;
        assert_eq!(reply.status(), StatusCode::OK, "{host}");
    }
}

#[tokio::test]
async fn with_tokens_neither_origin_nor_host_is_asked() {
    let app = spawn_app_with_teams(&unique_schema(), false).await;
    let document = json!({"completed": {"n": 1}}).to_string();
    let bearer = format!("Bearer {TEAM_A}");
    let headers = [
        ("origin", "http://evil.example"),
        ("host", "statehouse.internal"),
        ("authorization", bearer.as_str()),
    ];
    let put = simple_request(&app, Method::PUT, "/v1/states/a:web", &document, &headers).await;
    assert_eq!(put.status(), StatusCode::CREATED);
}

/// A pattern delete of `a:*` sent to `entry` while a worker holds the lease
/// on `a:running` at `authority`: that state stays, and the answer says so.
async fn pattern_delete_around_a_lease(entry: &TestApp, authority: &TestApp, forged: bool) {
    let lease_id = lease(authority, "a:running", TEAM_A).await;
    let bearer = format!("Bearer {TEAM_A}");
    let with_lease = authority
        .request(
            Method::PUT,
            "/v1/states/a:running",
            Some(&json!({"completed": {"bookmark": 7}}).to_string()),
            &[("authorization", &bearer), ("lease-id", &lease_id)],
        )
        .await;
    with_lease.expect(StatusCode::CREATED);
    // A state the authority holds in memory: its claim is still held.
    let done = lease(authority, "a:done", TEAM_A).await;
    let put = authority
        .request(
            Method::PUT,
            "/v1/states/a:done",
            Some(&json!({"completed": {"bookmark": 1}}).to_string()),
            &[("authorization", &bearer), ("lease-id", &done)],
        )
        .await;
    put.expect(StatusCode::CREATED);
    release(authority, "a:done", &done, TEAM_A).await;

    let admin = format!("Bearer {ADMIN}");
    let mut headers = vec![("authorization", admin.as_str())];
    if forged {
        // What only gateways should send; a client's is not trusted.
        headers.push((
            "x-statehouse-forwarded-by",
            "00000000-0000-0000-0000-000000000001",
        ));
    }
    let cleared = entry
        .request(Method::DELETE, "/v1/states?pattern=a:*", None, &headers)
        .await;
    cleared.expect(StatusCode::OK);
    assert_eq!(
        cleared.json(),
        json!({"deleted": 1, "skipped_locked": 1, "locked": ["a:running"]})
    );
    for gateway in [entry, authority] {
        let kept = gateway
            .call(Method::GET, "/v1/states/a:running", None, TEAM_A)
            .await;
        kept.expect(StatusCode::OK);
        assert_eq!(kept.json()["completed"], json!({"bookmark": 7}));
        let gone = gateway
            .call(Method::GET, "/v1/states/a:done", None, TEAM_A)
            .await;
        gone.expect(StatusCode::NOT_FOUND);
    }
    // Once the run is done, the same delete takes it.
    release(authority, "a:running", &lease_id, TEAM_A).await;
    let cleared = entry
        .request(Method::DELETE, "/v1/states?pattern=a:*", None, &headers)
        .await;
    assert_eq!(
        cleared.json(),
        json!({"deleted": 1, "skipped_locked": 0, "locked": []})
    );
}

#[tokio::test]
async fn a_pattern_delete_leaves_a_state_whose_lease_another_holds() {
    let app = spawn_app_with_teams(&unique_schema(), false).await;
    pattern_delete_around_a_lease(&app, &app, false).await;
}

#[tokio::test]
async fn a_pattern_delete_through_a_second_gateway_leaves_the_authoritys_leased_state() {
    let (authority, entry) = authority_and_entry().await;
    pattern_delete_around_a_lease(&entry, &authority, false).await;
}

#[tokio::test]
async fn a_forged_forwarding_header_does_not_keep_the_authority_from_hearing_of_a_delete() {
    let (authority, entry) = authority_and_entry().await;
    pattern_delete_around_a_lease(&entry, &authority, true).await;
}
