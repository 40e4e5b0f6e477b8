//! Past its concurrency limits the gateway sheds requests with an immediate
//! 503 `overloaded` and Retry-After instead of queueing them; lock acquires
//! count against a limit of their own; health checks always answer.

use std::sync::Arc;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::json;
use tokio::sync::Notify;

use crate::helpers::{Reply, metric, spawn_app_with};
use crate::proxy::spawn_app_behind_proxy;

fn assert_overloaded(reply: &Reply) {
    reply.expect(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.problem_type(), "overloaded");
    let retry_after: u64 = reply
        .header("retry-after")
        .expect("a shed request says when to retry")
        .parse()
        .expect("Retry-After in seconds");
    assert!(retry_after >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_of_four_times_the_limit_is_answered_or_shed_never_queued() {
    const LIMIT: usize = 4;
    let (app, proxy) = spawn_app_behind_proxy(|config| {
        config.concurrency.requests = LIMIT as u32;
    })
    .await;
    let created = app
        .put_state("flooded", &json!({"completed": {"v": 1}}))
        .await;
    created.expect(StatusCode::CREATED);

    // Slow ClickHouse round trips make the flood's requests overlap.
    proxy.set_delay(Duration::from_millis(400));
    let first_shed = Arc::new(Notify::new());
    let flood: Vec<_> = (0..4 * LIMIT)
        .map(|_| {
            let (api, first_shed) = (app.api.clone(), first_shed.clone());
            tokio::spawn(async move {
                let reply = api.get_state("flooded").await;
                if reply.status == StatusCode::SERVICE_UNAVAILABLE {
                    first_shed.notify_one();
                }
                reply
            })
        })
        .collect();
    // While the limit is taken, health, readiness and metrics still answer.
    tokio::time::timeout(Duration::from_secs(30), first_shed.notified())
        .await
        .expect("the flood is shed at once, not queued");
    for path in ["/healthz", "/readyz", "/metrics"] {
        app.get(path).await.expect_because(StatusCode::OK, path);
    }
    let mut answered = 0;
    let mut shed = 0;
    for request in flood {
        let reply = request.await.unwrap();
        if reply.status == StatusCode::OK {
            assert_eq!(reply.json()["completed"]["v"], 1);
            answered += 1;
        } else {
            assert_overloaded(&reply);
            shed += 1;
        }
    }
    assert!(shed >= 1, "{answered} answered, none shed");
    assert!(
        answered >= LIMIT,
        "the requests within the limit are answered: {answered} answered, {shed} shed"
    );

    proxy.set_delay(Duration::ZERO);
    let after = app.get_state("flooded").await;
    after.expect(StatusCode::OK);
    let written = app
        .put_state("flooded", &json!({"completed": {"v": 2}}))
        .await;
    written.expect(StatusCode::OK);
    let metrics = app.get("/metrics").await.text;
    assert_eq!(
        metric(
            &metrics,
            r#"statehouse_requests_shed_total{limit="requests"}"#
        ),
        Some(shed as f64),
        "{metrics}"
    );
}

#[tokio::test]
async fn lock_acquires_count_against_the_waiter_limit_not_the_request_limit() {
    let app = spawn_app_with(|config| {
        config.concurrency.requests = 1;
        config.concurrency.lock_waiters = 2;
    })
    .await;
    let (held, _) = app.lease("busy", "holder", 60, 0.0).await;
    // Two waiters get in line (retrying while the probe below takes a place).
    let waiters: Vec<_> = (0..2)
        .map(|n| {
            let api = app.api.clone();
            tokio::spawn(async move {
                let body =
                    json!({"owner": format!("waiter-{n}"), "ttl_seconds": 60, "wait_seconds": 60});
                let mut shed = 0;
                loop {
                    let reply = api.acquire("busy", &body).await;
                    if reply.status == StatusCode::SERVICE_UNAVAILABLE {
                        assert_overloaded(&reply);
                        shed += 1;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                    reply.expect(StatusCode::CREATED);
                    let lease = reply.json()["lease_id"].as_str().unwrap().to_owned();
                    let released = api.release("busy", &lease).await;
                    released.expect(StatusCode::NO_CONTENT);
                    return shed;
                }
            })
        })
        .collect();

    // Once both waiters are in line, one more acquire is shed, even one that
    // would not wait at all; until then it is granted.
    let mut shed = None;
    for attempt in 0..200 {
        let id = format!("free-{attempt}");
        let reply = app
            .acquire(&id, &json!({"owner": "prober", "wait_seconds": 0}))
            .await;
        if reply.status == StatusCode::CREATED {
            let lease = reply.json()["lease_id"].as_str().unwrap().to_owned();
            app.release(&id, &lease)
                .await
                .expect(StatusCode::NO_CONTENT);
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        shed = Some(reply);
        break;
    }
    let shed = shed.expect("an acquire beyond the waiter limit is shed");
    assert_overloaded(&shed);
    assert!(
        shed.json()["detail"]
            .as_str()
            .unwrap()
            .contains("--max-lock-waiters")
    );

    // The waiters hold no place under the request limit (of one).
    for _ in 0..3 {
        app.get("/v1/states").await.expect(StatusCode::OK);
        let lock = app.get("/v1/locks/busy").await;
        lock.expect(StatusCode::OK);
        assert_eq!(lock.json()["owner"], "holder");
    }

    app.release("busy", &held)
        .await
        .expect(StatusCode::NO_CONTENT);
    let mut waiters_shed = 0;
    for waiter in waiters {
        waiters_shed += tokio::time::timeout(Duration::from_secs(60), waiter)
            .await
            .expect("both waiters get their turn")
            .unwrap();
    }
    let (again, _) = app.lease("busy", "after", 60, 0.0).await;
    app.release("busy", &again)
        .await
        .expect(StatusCode::NO_CONTENT);
    let metrics = app.get("/metrics").await.text;
    assert_eq!(
        metric(
            &metrics,
            r#"statehouse_requests_shed_total{limit="lock_waiters"}"#
        ),
        Some(f64::from(1 + waiters_shed)),
        "{metrics}"
    );
}

#[tokio::test]
async fn lock_request_bodies_have_a_small_limit_of_their_own() {
    let app = spawn_app_with(|_| {}).await;
    let padded = |len: usize| {
        let skeleton = r#"{"owner":"w"}"#;
        format!("{}{skeleton}", " ".repeat(len - skeleton.len()))
    };
    let limit = 64 * 1024;
    let at_limit = app
        .request(Method::POST, "/v1/locks/padded", Some(&padded(limit)), &[])
        .await;
    at_limit.expect(StatusCode::CREATED);
    let over = app
        .request(
            Method::POST,
            "/v1/locks/padded-more",
            Some(&padded(limit + 1)),
            &[],
        )
        .await;
    over.expect(StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(over.problem_type(), "payload-too-large");
    app.get("/v1/locks/padded-more")
        .await
        .expect(StatusCode::NOT_FOUND);
}
