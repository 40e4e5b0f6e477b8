//! A bulk import sent to a gateway that is not the authority of its id,
//! while the id's lease ends (expiry, release, force-unlock) and its INSERT
//! is held on the way to ClickHouse. The entry is admitted by a ticket from
//! the authority, so the rule of `lock_faults` holds for it too: either it
//! is refused and the next holder reads nothing, or it is acknowledged
//! before the next grant and the next holder reads it.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::json;

use crate::helpers::{peer_config, spawn_configured, unique_schema};
use crate::lock_faults::{served_n, stored_n};
use crate::proxy::Proxy;

#[derive(Clone, Copy, Debug)]
enum End {
    Expiry,
    Release,
    ForceUnlock,
}

async fn import_in_flight_at_the_lease_end(end: End) {
    let schema = unique_schema();
    let proxy = Proxy::to_clickhouse().await;
    // The authority reaches ClickHouse directly; the importing gateway
    // through the proxy, which holds its INSERTs.
    let authority = spawn_configured(peer_config(&schema)).await;
    let mut importer = peer_config(&schema);
    proxy.route(&mut importer);
    let importer = spawn_configured(importer).await;
    let id = "imported";
    let (lease, _) = authority.lease(id, "worker-1", 2, 0.0).await;
    let granted_at = Instant::now();

    let next = authority.api.clone();
    let next_schema = schema.clone();
    let worker_2 = tokio::spawn(async move {
        let (_, _) = next.lease(id, "worker-2", 30, 20.0).await;
        let granted = Instant::now();
        (
            granted,
            stored_n(&next_schema, id).await,
            served_n(&next, id).await,
        )
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    if let End::Expiry = end {
        tokio::time::sleep_until((granted_at + Duration::from_millis(1500)).into()).await;
    }
    proxy.hold_requests_containing(Some((&["INSERT INTO"], Duration::from_millis(1500))));
    let api = importer.api.clone();
    let body = json!([{"state_id": id, "lease_id": lease, "completed": {"n": 1}}]).to_string();
    let import = tokio::spawn(async move {
        let reply = api
            .request(Method::POST, "/v1/states", Some(&body), &[])
            .await;
        (reply, Instant::now())
    });
    // The import has its ticket and its INSERT is held.
    tokio::time::sleep(Duration::from_millis(400)).await;
    match end {
        End::Expiry => {}
        End::Release => {
            let released = authority.release(id, &lease).await;
            released.expect(StatusCode::NO_CONTENT);
        }
        End::ForceUnlock => {
            let unlock = authority
                .request(Method::DELETE, &format!("/v1/locks/{id}"), None, &[])
                .await;
            unlock.expect(StatusCode::NO_CONTENT);
        }
    }
    let (import, acknowledged) = import.await.unwrap();
    proxy.hold_requests_containing(None);
    let (granted, stored, served) = worker_2.await.unwrap();
    println!(
        "{end:?}: import {} {:?} after worker 2's grant: {}",
        import.status,
        acknowledged.saturating_duration_since(granted),
        acknowledged > granted
    );
    match import.status {
        StatusCode::OK => {
            // The importer settles its ticket once its INSERT has returned,
            // then answers: on a loaded machine that answer may trail the
            // next grant by its own trip, never by the INSERT's 1.5 s hold.
            assert!(
                acknowledged <= granted + Duration::from_millis(500),
                "{end:?}: the import was acknowledged {:?} after worker 2's grant",
                acknowledged - granted
            );
            assert_eq!(stored, Some(1), "{end:?}: worker 2 did not read the import");
            assert_eq!(
                served,
                Some(1),
                "{end:?}: the authority served the old state"
            );
        }
        StatusCode::CONFLICT => {
            assert_eq!(stored, None, "{end:?}: a refused import landed");
            assert_eq!(served, None);
        }
        other => panic!("{end:?}: the import got {other}: {}", import.text),
    }
    assert_eq!(stored_n(&schema, id).await, stored, "nothing landed later");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_import_through_a_peer_in_flight_at_force_unlock_lands_before_the_next_grant() {
    import_in_flight_at_the_lease_end(End::ForceUnlock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_import_through_a_peer_in_flight_at_release_lands_before_the_next_grant() {
    import_in_flight_at_the_lease_end(End::Release).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_import_through_a_peer_in_flight_at_expiry_lands_before_the_next_grant() {
    import_in_flight_at_the_lease_end(End::Expiry).await;
}
