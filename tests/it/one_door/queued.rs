//! A write that waits in the group-commit queue while its lease ends is
//! refused with 409 and never sent: the lease was gone before the write
//! went out, so nothing of it may land.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::json;

use super::{STATE_INSERT, stored, versions};
use crate::helpers::encode_id;
use crate::proxy::spawn_app_behind_proxy;

/// How long the proxy holds each state INSERT: the first write's batch is
/// on its way that long, and the second write queues behind it. Long
/// beside the test's own steps, which a loaded machine may slow to a second.
const HOLD: Duration = Duration::from_secs(3);

#[derive(Clone, Copy, Debug)]
enum End {
    Release,
    ForceUnlock,
}

async fn a_write_queued_at_the_lease_end_is_refused(end: End) {
    let (app, proxy) = spawn_app_behind_proxy(|_| {}).await;
    let (first, queued) = ("first", "queued");
    for id in [first, queued] {
        let seeded = app.put_state(id, &json!({"completed": {"n": 0}})).await;
        assert!(seeded.status.is_success(), "{}", seeded.text);
    }
    let (lease, _) = app.lease(queued, "worker", 30, 0.0).await;

    proxy.hold_requests_containing(Some((STATE_INSERT, HOLD)));
    proxy.record_heads();
    let t0 = Instant::now();
    // Write #1 takes the batch that goes out now; it stays on its way.
    let one = {
        let api = app.api.clone();
        tokio::spawn(async move {
            let reply = api.put_state(first, &json!({"completed": {"n": 1}})).await;
            (reply, t0.elapsed())
        })
    };
    // Write #2 is sent once #1's batch is held on its way, never with it.
    let on_its_way = || {
        proxy
            .heads()
            .iter()
            .any(|head| STATE_INSERT.iter().all(|text| head.contains(text)))
    };
    while !on_its_way() {
        assert!(t0.elapsed() < HOLD * 10, "write #1's INSERT never went out");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Write #2, under the lease, waits for the next batch.
    let two = {
        let (api, lease) = (app.api.clone(), lease.clone());
        tokio::spawn(async move {
            let reply = api
                .put_state_with_lease(queued, &json!({"completed": {"n": 2}}), &lease)
                .await;
            (reply, t0.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let ending = {
        let (api, lease) = (app.api.clone(), lease.clone());
        tokio::spawn(async move {
            let reply = match end {
                End::Release => api.release(queued, &lease).await,
                End::ForceUnlock => {
                    let path = format!("/v1/locks/{}", encode_id(queued));
                    api.request(Method::DELETE, &path, None, &[]).await
                }
            };
            (reply.status, t0.elapsed())
        })
    };
    let (one, one_at) = one.await.unwrap();
    let (two, two_at) = two.await.unwrap();
    let (ended, ended_at) = ending.await.unwrap();
    proxy.hold_requests_containing(None);
    // Whatever went out has landed by now.
    tokio::time::sleep(HOLD + Duration::from_secs(1)).await;
    let finally = stored(&app.schema, queued).await;
    let history = versions(&app.schema, queued).await;
    println!(
        "queued write at {end:?}: #1 {} at {one_at:?}; lease ended ({ended}) at {ended_at:?}; \
         #2 {} at {two_at:?}; {queued} holds {finally:?} with {history} version(s)",
        one.status, two.status
    );
    assert!(one.status.is_success(), "write #1: {}", one.text);
    assert!(ended.is_success(), "{end:?} answered {ended}");
    two.expect_because(
        StatusCode::CONFLICT,
        format!("{end:?}: the write whose lease ended while it queued was sent"),
    );
    assert_eq!(two.problem_type(), "lease-not-current");
    assert_eq!(
        finally,
        Some(json!({"n": 0})),
        "{end:?}: the refused write landed"
    );
    assert_eq!(history, 1, "{end:?}: the refused write left a version");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_queued_at_release_gets_409_and_nothing_of_it_is_written() {
    a_write_queued_at_the_lease_end_is_refused(End::Release).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_queued_at_force_unlock_gets_409_and_nothing_of_it_is_written() {
    a_write_queued_at_the_lease_end_is_refused(End::ForceUnlock).await;
}
