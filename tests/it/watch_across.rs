//! Watch across gateways (issue 42, acceptance 2): a writer on gateway A, a
//! watcher on gateway B, half of the ids leased through A (so A is their
//! authority and serves them from memory). Each of sixteen changes reaches
//! B's long-poll waiting on it, as a 200 with the change's ETag, within the
//! long-poll's 20 s wait (a wait that ran out would be a 304). How soon
//! (the contract's 1 s at the 90th percentile) is a figure a loaded machine
//! moves: `bench/watch` measures it, with its p50 and p99 delays from a
//! write's answer to a watcher on another gateway.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::helpers::{Api, encode_id, peer_config, spawn_configured, unique_schema};

fn doc(n: u64) -> Value {
    json!({"completed": {"singer_state": {"bookmarks": {"s": {"replication_key_value": n}}}}})
}

/// Long-polls `id` on `api` until its ETag moves from `etag`; answers the
/// new ETag.
async fn next_change(api: Api, id: String, etag: String) -> String {
    let path = format!("/v1/states/{}?wait=20s", encode_id(&id));
    let reply = api
        .request(
            reqwest::Method::GET,
            &path,
            None,
            &[("if-none-match", etag.as_str())],
        )
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    reply.header("etag").expect("an ETag").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_changes_through_a_reach_watchers_on_b() {
    sixteen_changes(false).await;
}

/// The same while someone follows the feed on B: then the feed's poller
/// wakes the long-polls, and its reads are the only ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_a_feed_followed_on_b_its_reads_wake_the_long_polls() {
    sixteen_changes(true).await;
}

async fn sixteen_changes(with_feed: bool) {
    let schema = unique_schema();
    let a = spawn_configured(peer_config(&schema)).await;
    let b = spawn_configured(peer_config(&schema)).await;
    let ids: Vec<String> = (0..8)
        .map(|n| format!("across-{n}-{}", uuid::Uuid::new_v4().simple()))
        .collect();
    let mut leases = Vec::new();
    for (n, id) in ids.iter().enumerate() {
        let lease = if n % 2 == 0 {
            Some(a.lease(id, "writer", 60, 5.0).await.0)
        } else {
            None
        };
        let created = match &lease {
            Some(lease) => a.put_state_with_lease(id, &doc(0), lease).await,
            None => a.put_state(id, &doc(0)).await,
        };
        assert_eq!(created.status, StatusCode::CREATED, "{}", created.text);
        leases.push(lease);
    }
    let follower = with_feed.then(|| {
        let b = b.clone();
        tokio::spawn(async move {
            loop {
                let reply = b.get("/v1/changes?pattern=*&wait=0").await;
                assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
                let cursor = reply.json()["cursor"].as_str().unwrap().to_owned();
                let path = format!("/v1/changes?pattern=*&since={cursor}&wait=2m");
                b.get(&path).await;
            }
        })
    });

    // Change c goes to id (3c mod 8): two changes each. The ids' changes run
    // side by side, each id's in order, as the watchers of different ids
    // have nothing to do with one another.
    let rounds: Vec<_> = ids
        .iter()
        .zip(leases)
        .enumerate()
        .map(|(n, (id, lease))| {
            let changes: Vec<u64> = (1..=16u64)
                .filter(|change| (*change as usize * 3) % ids.len() == n)
                .collect();
            let (a, b, id) = (a.api.clone(), b.api.clone(), id.clone());
            tokio::spawn(async move {
                let mut heard = 0;
                for change in changes {
                    change_heard(&a, &b, &id, lease.as_deref(), change).await;
                    heard += 1;
                }
                heard
            })
        })
        .collect();
    let mut heard = 0;
    for round in rounds {
        heard += round.await.unwrap();
    }
    assert_eq!(heard, 16);
    if let Some(follower) = follower {
        follower.abort();
    }
}

/// Writes `change` to `id` through `a` while a long-poll on `b` waits for
/// it, which must hear it.
async fn change_heard(a: &Api, b: &Api, id: &str, lease: Option<&str>, change: u64) {
    let current = b.get_state(id).await;
    let watching = tokio::spawn(next_change(
        b.clone(),
        id.to_owned(),
        current.header("etag").unwrap().to_owned(),
    ));
    // Changes land at every point of B's poll period, not in step with it.
    tokio::time::sleep(Duration::from_millis(100 + 613 * change % 1000)).await;
    let written = match lease {
        Some(lease) => a.put_state_with_lease(id, &doc(change), lease).await,
        None => a.put_state(id, &doc(change)).await,
    };
    assert_eq!(written.status, StatusCode::OK, "{}", written.text);
    let etag = watching.await.unwrap();
    assert_eq!(etag, written.header("etag").unwrap(), "change {change}");
}
