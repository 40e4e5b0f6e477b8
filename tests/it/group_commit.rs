//! Group commit: writes that arrive while an INSERT is on its way go out
//! together in the next one. What must not bend: an acknowledged write is
//! readable, a failed batch fails exactly its writes and none of them is
//! readable, and writes to one id keep their order and their merges.

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::helpers::{Api, Reply, encode_id, metric, spawn_app, write_path_statements};
use crate::proxy::spawn_app_behind_proxy;

async fn put(api: &Api, id: &str, n: u64) -> Reply {
    api.put_state(id, &json!({"completed": {"n": n}})).await
}

/// `n` of `id` as the gateway serves it, None when there is no state.
async fn served_n(api: &Api, id: &str) -> Option<u64> {
    let read = api.get_state(id).await;
    match read.status {
        StatusCode::OK => read.json()["completed"]["n"].as_u64(),
        StatusCode::NOT_FOUND => None,
        other => panic!("{id}: {other} {}", read.text),
    }
}

/// A lease on `id`, with the id's state read once: this gateway is then its
/// authority and knows its state, so a write of it costs one round trip,
/// its INSERT.
async fn held(api: &Api, id: &str) -> String {
    let (lease, _) = api.lease(id, "writer", 60, 0.0).await;
    api.get_state(id).await;
    lease
}

async fn put_held(api: &Api, id: &str, lease: &str, doc: &Value) -> Reply {
    api.put_state_with_lease(id, doc, lease).await
}

async fn exposition(api: &Api) -> String {
    api.get("/metrics").await.text
}

/// INSERTs of versions so far, and the rows they carried.
async fn inserts_and_rows(api: &Api) -> (f64, f64) {
    let text = exposition(api).await;
    let inserts = metric(
        &text,
        r#"statehouse_clickhouse_query_duration_seconds_count{operation="history_record"}"#,
    )
    .unwrap_or(0.0);
    let rows = metric(&text, "statehouse_write_batch_rows_sum").unwrap_or(0.0);
    (inserts, rows)
}

/// 32 writers at once through a ClickHouse that takes 200 ms per INSERT:
/// while one INSERT is on its way the others gather, so writes share
/// INSERTs, and every acknowledged write reads back. How few INSERTs they
/// take depends on how the writes' arrivals spread, which a loaded machine
/// moves: `bench/fleet` prints INSERTs per write for 1, 8 and 64 writers.
/// Here no INSERT is shared only if the writes came 200 ms apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_that_arrive_together_go_out_in_a_few_inserts() {
    let (app, proxy) = spawn_app_behind_proxy(|_| {}).await;
    let (inserts_before, rows_before) = inserts_and_rows(&app).await;
    proxy.set_delay(Duration::from_millis(200));
    let writers: Vec<_> = (0..32)
        .map(|n| {
            let api = app.api.clone();
            tokio::spawn(async move { put(&api, &format!("fleet-{n}"), n).await })
        })
        .collect();
    for writer in writers {
        let reply = writer.await.unwrap();
        assert!(reply.status.is_success(), "{}", reply.text);
    }
    proxy.set_delay(Duration::ZERO);
    let (inserts, rows) = inserts_and_rows(&app).await;
    let (inserts, rows) = (inserts - inserts_before, rows - rows_before);
    assert_eq!(rows, 32.0, "every write in some batch");
    assert!(inserts < 32.0, "32 writes took {inserts} INSERTs");
    for n in 0..32 {
        assert_eq!(served_n(&app, &format!("fleet-{n}")).await, Some(n));
    }
}

/// A batch whose INSERT fails fails exactly its writes: a write on its way
/// first, then eight that gather behind it, whose INSERT is cut before
/// ClickHouse sees it, then four more. Every write answered 2xx reads back,
/// none answered 503 does, and the eight share one fate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_batch_fails_exactly_its_writes_and_none_of_them_lands() {
    let (app, proxy) = spawn_app_behind_proxy(|_| {}).await;
    let mut leases = Vec::new();
    for n in 0..8 {
        leases.push(held(&app, &format!("gathered-{n}")).await);
    }
    let first_lease = held(&app, "first").await;
    proxy.set_delay(Duration::from_millis(700));
    let first = {
        let api = app.api.clone();
        tokio::spawn(async move {
            put_held(&api, "first", &first_lease, &json!({"completed": {"n": 1}})).await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let gathered: Vec<_> = leases
        .into_iter()
        .enumerate()
        .map(|(n, lease)| {
            let api = app.api.clone();
            tokio::spawn(async move {
                let doc = json!({"completed": {"n": n}});
                put_held(&api, &format!("gathered-{n}"), &lease, &doc).await
            })
        })
        .collect();
    let first = first.await.unwrap();
    // The gathered batch's INSERT is held in the proxy now: cut it.
    proxy.set_down(true);
    let mut gathered_status = Vec::new();
    for writer in gathered {
        gathered_status.push(writer.await.unwrap().status);
    }
    proxy.set_down(false);
    proxy.set_delay(Duration::ZERO);
    let after: Vec<Reply> = {
        let mut replies = Vec::new();
        for n in 0..4 {
            replies.push(put(&app, &format!("after-{n}"), n).await);
        }
        replies
    };

    assert!(first.status.is_success(), "{}", first.text);
    assert_eq!(served_n(&app, "first").await, Some(1));
    assert!(
        gathered_status.windows(2).all(|w| w[0] == w[1]),
        "one batch, one fate: {gathered_status:?}"
    );
    for (n, status) in gathered_status.iter().enumerate() {
        let stored = served_n(&app, &format!("gathered-{n}")).await;
        match *status {
            s if s.is_success() => assert_eq!(stored, Some(n as u64)),
            StatusCode::SERVICE_UNAVAILABLE => assert_eq!(stored, None, "a failed write landed"),
            other => panic!("gathered-{n}: {other}"),
        }
    }
    for (n, reply) in after.iter().enumerate() {
        assert!(reply.status.is_success(), "{}", reply.text);
        assert_eq!(served_n(&app, &format!("after-{n}")).await, Some(n as u64));
    }
}

/// Two writers PATCHing one id at once: each merge builds on the other, so
/// both keys survive (two writes of one id never share a batch).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_patches_of_one_id_lose_no_merge() {
    let app = spawn_app().await;
    app.put_state("merged", &json!({"completed": {}})).await;
    for round in 0..5 {
        let (a, b) = (format!("a{round}"), format!("b{round}"));
        let patch = |key: String| {
            let api = app.api.clone();
            async move {
                api.patch_state("merged", &json!({"partial": {key: 1}}))
                    .await
            }
        };
        let (one, two) = tokio::join!(patch(a.clone()), patch(b.clone()));
        assert!(one.status.is_success() && two.status.is_success());
        let partial = app.get_state("merged").await.json()["partial"].clone();
        assert_eq!(partial[&a], 1, "{partial}");
        assert_eq!(partial[&b], 1, "{partial}");
    }
}

/// PUTs racing with the same If-Match: exactly one wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn if_match_races_on_one_id_have_exactly_one_winner() {
    let app = spawn_app().await;
    let created = app
        .put_state("raced", &json!({"completed": {"n": 0}}))
        .await;
    let etag = created.header("etag").unwrap().to_owned();
    let racers: Vec<_> = (1..=8)
        .map(|n| {
            let (api, etag) = (app.api.clone(), etag.clone());
            tokio::spawn(async move {
                api.request(
                    Method::PUT,
                    &format!("/v1/states/{}", encode_id("raced")),
                    Some(&json!({"completed": {"n": n}}).to_string()),
                    &[("if-match", &etag)],
                )
                .await
                .status
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for racer in racers {
        statuses.push(racer.await.unwrap());
    }
    let won = statuses.iter().filter(|s| s.is_success()).count();
    let lost = statuses
        .iter()
        .filter(|s| **s == StatusCode::PRECONDITION_FAILED)
        .count();
    assert_eq!((won, lost), (1, 7), "{statuses:?}");
}

/// A client that hangs up while its write waits in a batch: the others'
/// writes land, and its own is written whole or not at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_hanging_up_in_a_batch_leaves_the_others_intact() {
    let (app, proxy) = spawn_app_behind_proxy(|_| {}).await;
    let mut leases = Vec::new();
    for n in 0..6 {
        leases.push(held(&app, &format!("batched-{n}")).await);
    }
    let ahead = held(&app, "ahead").await;
    proxy.set_delay(Duration::from_millis(500));
    let first = {
        let api = app.api.clone();
        tokio::spawn(
            async move { put_held(&api, "ahead", &ahead, &json!({"completed": {}})).await },
        )
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let others: Vec<_> = leases
        .into_iter()
        .enumerate()
        .map(|(n, lease)| {
            let api = app.api.clone();
            tokio::spawn(async move {
                let id = format!("batched-{n}");
                let body = json!({"completed": {"n": n, "big": "x".repeat(1000)}});
                if n == 3 {
                    // Hangs up while its write waits behind the first INSERT.
                    let gone = tokio::time::timeout(
                        Duration::from_millis(100),
                        put_held(&api, &id, &lease, &body),
                    )
                    .await;
                    assert!(gone.is_err(), "it should still have been waiting");
                    None
                } else {
                    Some(put_held(&api, &id, &lease, &body).await.status)
                }
            })
        })
        .collect();
    assert!(first.await.unwrap().status.is_success());
    let mut statuses = Vec::new();
    for other in others {
        statuses.push(other.await.unwrap());
    }
    proxy.set_delay(Duration::ZERO);
    for (n, status) in statuses.into_iter().enumerate() {
        let read = app.get_state(&format!("batched-{n}")).await;
        match status {
            Some(status) => {
                assert!(status.is_success(), "batched-{n}: {status}");
                assert_eq!(read.json()["completed"]["n"], n);
            }
            // Whole or nothing: either the full document or no state.
            None => match read.status {
                StatusCode::OK => {
                    let doc: Value = read.json()["completed"].clone();
                    assert_eq!(doc["n"], n);
                    assert_eq!(doc["big"].as_str().map(str::len), Some(1000));
                }
                StatusCode::NOT_FOUND => {}
                other => panic!("{other}"),
            },
        }
    }
}

/// An unlocked PUT (routing read with the current row, INSERT) costs no more
/// statements under load than alone: two alone, and 32 writers at once
/// through a slowed ClickHouse share their reads as they share their
/// INSERTs. A routing read slower than half the claim settle is followed
/// by a second one: the settle here is a minute, so no read is, and the
/// counts are the writes' own. How much the 32 share depends on how their
/// arrivals spread: `bench/fleet` prints statements per write for 1, 8 and
/// 64 writers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unlocked_puts_statements_do_not_grow_with_load() {
    let (app, proxy) =
        spawn_app_behind_proxy(|config| config.locks.settle = Duration::from_secs(60)).await;
    proxy.set_delay(Duration::from_millis(200));
    let before = write_path_statements(&app).await;
    for n in 0..8 {
        assert!(
            put(&app, &format!("alone-{n}"), n)
                .await
                .status
                .is_success()
        );
    }
    let alone = write_path_statements(&app).await - before;
    assert_eq!(alone, 16.0, "8 writes one after another");
    let before = write_path_statements(&app).await;
    let writers: Vec<_> = (0..32)
        .map(|n| {
            let api = app.api.clone();
            tokio::spawn(async move { put(&api, &format!("loaded-{n}"), n).await })
        })
        .collect();
    for writer in writers {
        assert!(writer.await.unwrap().status.is_success());
    }
    let loaded = write_path_statements(&app).await - before;
    proxy.set_delay(Duration::ZERO);
    assert!(
        loaded < 64.0,
        "32 writes at once took {loaded} statements, none shared"
    );
}
