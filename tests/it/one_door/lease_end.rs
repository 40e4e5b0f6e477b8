//! A change under a lease, sent through the gateway that is not the id's
//! authority, while the lease ends: by expiry, by release, by force-unlock.
//! Either it is refused and the next holder never sees it, or it is
//! acknowledged before the next grant and the next holder reads it.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use super::{Pair, served, stored, versions};
use crate::helpers::{Api, Reply, encode_id};

/// How long the proxy holds each state INSERT: longer than the gap between
/// the send and the lease's end, so the lease ends with the change on its way.
const HOLD: Duration = Duration::from_millis(1500);

#[derive(Clone, Copy, Debug)]
enum End {
    Expiry,
    Release,
    ForceUnlock,
}

/// The ways a change reaches a state besides PUT and PATCH.
#[derive(Clone, Copy, Debug)]
enum Door {
    /// `POST /v1/states`, the entry carrying `lease_id`; a non-authority
    /// writes it itself.
    Import,
    /// `DELETE /v1/states/{id}` with `Lease-Id`.
    Delete,
    /// `POST /v1/states/{id}/rollback` to the first version.
    Rollback,
    /// `DELETE /v1/states/{id}/bookmarks/s`.
    ResetStream,
}

/// What the state is before the change and what the change makes it.
struct Case {
    before: Option<Value>,
    after: Option<Value>,
    /// The version a rollback goes back to.
    version: Option<String>,
}

fn bookmarks(streams: &[&str]) -> Value {
    let marks: serde_json::Map<String, Value> = streams
        .iter()
        .map(|s| ((*s).to_owned(), json!({"n": 1})))
        .collect();
    json!({"singer_state": {"bookmarks": marks}})
}

/// Writes the state the change starts from, unlocked, through `api`.
async fn seed(api: &Api, id: &str, door: Door) -> Case {
    let put = |completed: Value| async move {
        let reply = api.put_state(id, &json!({ "completed": completed })).await;
        assert!(reply.status.is_success(), "seed: {}", reply.text);
    };
    match door {
        Door::Import => {
            put(json!({"n": 0})).await;
            Case {
                before: Some(json!({"n": 0})),
                after: Some(json!({"n": 1})),
                version: None,
            }
        }
        Door::Delete => {
            put(json!({"n": 0})).await;
            Case {
                before: Some(json!({"n": 0})),
                after: None,
                version: None,
            }
        }
        Door::Rollback => {
            put(json!({"n": 1})).await;
            put(json!({"n": 2})).await;
            let history = api
                .get(&format!("/v1/states/{}/history", encode_id(id)))
                .await
                .json();
            let first = history["versions"][1]["version"].as_str().unwrap();
            Case {
                before: Some(json!({"n": 2})),
                after: Some(json!({"n": 1})),
                version: Some(first.to_owned()),
            }
        }
        Door::ResetStream => {
            put(bookmarks(&["s", "t"])).await;
            Case {
                before: Some(bookmarks(&["s", "t"])),
                after: Some(bookmarks(&["t"])),
                version: None,
            }
        }
    }
}

/// Sends the change through `api` under `lease`.
async fn send(api: &Api, id: &str, door: Door, lease: &str, version: Option<&str>) -> Reply {
    let path = format!("/v1/states/{}", encode_id(id));
    let with_lease = [("lease-id", lease)];
    match door {
        Door::Import => {
            let batch = json!([{"state_id": id, "completed": {"n": 1}, "lease_id": lease}]);
            let body = batch.to_string();
            api.request(Method::POST, "/v1/states", Some(&body), &[])
                .await
        }
        Door::Delete => api.request(Method::DELETE, &path, None, &with_lease).await,
        Door::Rollback => {
            let body = json!({ "version": version.unwrap() }).to_string();
            let path = format!("{path}/rollback");
            api.request(Method::POST, &path, Some(&body), &with_lease)
                .await
        }
        Door::ResetStream => {
            let path = format!("{path}/bookmarks/s");
            api.request(Method::DELETE, &path, None, &with_lease).await
        }
    }
}

/// Worker 1 holds the lease through A, the id's authority, and sends the
/// change through B; the proxies hold state INSERTs, so the lease ends
/// (`end`) with the change on its way. Worker 2 waits through A, and reads
/// the moment it is granted.
async fn change_through_the_non_authority_at_the_lease_end(door: Door, end: End) {
    let pair = Pair::start(|_| {}).await;
    let (a, b) = (&pair.a, &pair.b);
    let id = format!("{door:?}-{end:?}").to_lowercase();
    let case = seed(a, &id, door).await;
    let ttl = match end {
        End::Expiry => 2,
        End::Release | End::ForceUnlock => 30,
    };
    let versions_before = versions(&a.schema, &id).await;
    let (lease, _) = a.lease(&id, "worker-1", ttl, 0.0).await;
    let t0 = Instant::now();

    let worker_2 = {
        let (api, schema, id) = (a.api.clone(), a.schema.clone(), id.clone());
        tokio::spawn(async move {
            let (lease, _) = api.lease(&id, "worker-2", 30, 20.0).await;
            let granted = Instant::now();
            let stored = stored(&schema, &id).await;
            let served = served(&api, &id).await;
            (lease, granted, stored, served)
        })
    };
    // Worker 2 is in line before the change starts.
    tokio::time::sleep(Duration::from_millis(300)).await;
    if let End::Expiry = end {
        // Sent with a second of the lease left; it ends while held.
        tokio::time::sleep_until((t0 + Duration::from_millis(1000)).into()).await;
    }
    pair.hold_state_inserts(Some(HOLD));
    let change = {
        let (api, id, lease, version) = (b.api.clone(), id.clone(), lease.clone(), case.version);
        tokio::spawn(async move {
            let reply = send(&api, &id, door, &lease, version.as_deref()).await;
            (reply, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let ended = match end {
        End::Expiry => StatusCode::NO_CONTENT,
        End::Release => a.release(&id, &lease).await.status,
        End::ForceUnlock => {
            let path = format!("/v1/locks/{}", encode_id(&id));
            a.request(Method::DELETE, &path, None, &[]).await.status
        }
    };
    let ended_at = t0.elapsed();
    let (reply, answered) = change.await.unwrap();
    let (_, granted, read_stored, read_served) = worker_2.await.unwrap();
    pair.hold_state_inserts(None);
    // Whatever was on its way has landed or failed by now.
    tokio::time::sleep(HOLD + Duration::from_secs(1)).await;
    let finally = stored(&a.schema, &id).await;
    let versions_after = versions(&a.schema, &id).await;
    // When ClickHouse answered the change's INSERT: the client's answer may
    // come through B a hop later than worker 2's grant from A, so the
    // order that counts is the INSERT's outcome against the grant.
    let landed = [&pair.proxy_a, &pair.proxy_b]
        .iter()
        .flat_map(|proxy| proxy.held_answers())
        .max();
    println!(
        "{door:?} at {end:?}: change {} answered at {:?} (its INSERT answered at {:?}); \
         lease ended ({ended}) at {ended_at:?}; worker 2 granted at {:?} and read {read_stored:?} \
         (served {read_served:?}); ClickHouse finally holds {finally:?}, {versions_before} -> \
         {versions_after} version(s)",
        reply.status,
        answered - t0,
        landed.map(|at| at - t0),
        granted - t0,
    );
    assert!(ended.is_success(), "{end:?} answered {ended}");
    if reply.status.is_success() {
        let landed = landed.expect("an acknowledged change's INSERT was answered");
        assert!(
            landed < granted,
            "{door:?} at {end:?}: its INSERT was answered {:?} after worker 2's grant",
            landed - granted
        );
        assert_eq!(
            read_stored, case.after,
            "{door:?} at {end:?}: worker 2 was granted before the acknowledged change landed"
        );
        assert_eq!(
            read_served, case.after,
            "{door:?} at {end:?}: the authority served worker 2 the old state"
        );
    } else {
        // An unknown outcome first: whatever landed, the next holder must
        // have read it.
        assert_eq!(
            finally, read_stored,
            "{door:?} at {end:?}: the change answered {} landed after worker 2 read the state",
            reply.status
        );
        assert!(
            reply.status.is_client_error(),
            "{door:?} at {end:?}: neither refused nor acknowledged: {} {}",
            reply.status,
            reply.text
        );
        assert_eq!(
            read_stored, case.before,
            "{door:?} at {end:?}: a refused change landed"
        );
        assert_eq!(read_served, case.before);
        assert_eq!(
            versions_after, versions_before,
            "{door:?} at {end:?}: the refused change left a version in history"
        );
    }
    assert_eq!(
        finally, read_stored,
        "{door:?} at {end:?}: the state changed after worker 2 read it"
    );
}

macro_rules! cases {
    ($($name:ident: $door:ident at $end:ident;)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                change_through_the_non_authority_at_the_lease_end(Door::$door, End::$end).await;
            }
        )*
    };
}

cases! {
    import_through_a_non_authority_at_expiry: Import at Expiry;
    import_through_a_non_authority_at_release: Import at Release;
    import_through_a_non_authority_at_force_unlock: Import at ForceUnlock;
    delete_through_a_non_authority_at_expiry: Delete at Expiry;
    delete_through_a_non_authority_at_release: Delete at Release;
    delete_through_a_non_authority_at_force_unlock: Delete at ForceUnlock;
    rollback_through_a_non_authority_at_expiry: Rollback at Expiry;
    rollback_through_a_non_authority_at_release: Rollback at Release;
    rollback_through_a_non_authority_at_force_unlock: Rollback at ForceUnlock;
    stream_reset_through_a_non_authority_at_expiry: ResetStream at Expiry;
    stream_reset_through_a_non_authority_at_release: ResetStream at Release;
    stream_reset_through_a_non_authority_at_force_unlock: ResetStream at ForceUnlock;
}
