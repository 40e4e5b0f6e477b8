//! Point in time: reads as of an instant (`at=`) answer what stood then,
//! with the version's `updated_at` and ETag, from one timeline: A written
//! three times, B created after the instant, C deleted after it.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use statehouse::store::History;

use crate::helpers::{Api, TestApp, encode_id, spawn_app_with};

pub(crate) const A: &str = "pit:tap-a";
pub(crate) const B: &str = "pit:tap-b";
pub(crate) const C: &str = "pit:tap-c";

pub(crate) fn bookmark(stream: &str, value: u64) -> Value {
    json!({"completed": {"singer_state": {"bookmarks": {
        stream: {"replication_key": "id", "replication_key_value": value}
    }}}})
}

/// What the timeline left: the instant, and what A was at it.
pub(crate) struct Timeline {
    pub at: String,
    pub a_at: Value,
    pub a_etag: String,
}

/// A gateway keeping an hour of history.
pub(crate) async fn gateway() -> TestApp {
    spawn_app_with(|config| config.history = History::Kept(Some(Duration::from_secs(3600)))).await
}

/// A1, C, A2, then the instant (A2's `updated_at`), then A3, B and C's delete.
pub(crate) async fn timeline(api: &Api) -> Timeline {
    api.put_state(A, &bookmark("orders", 1))
        .await
        .expect(StatusCode::CREATED);
    api.put_state(C, &bookmark("users", 5))
        .await
        .expect(StatusCode::CREATED);
    let a2 = api.put_state(A, &bookmark("orders", 2)).await;
    a2.expect(StatusCode::OK);
    let at = a2.json()["updated_at"].as_str().unwrap().to_owned();
    let a_etag = a2.header("etag").unwrap().to_owned();
    // Later changes are stamped in later milliseconds.
    tokio::time::sleep(Duration::from_millis(5)).await;
    api.put_state(A, &bookmark("orders", 3))
        .await
        .expect(StatusCode::OK);
    api.put_state(B, &bookmark("items", 9))
        .await
        .expect(StatusCode::CREATED);
    api.delete_state(C).await.expect(StatusCode::NO_CONTENT);
    Timeline {
        a_at: a2.json(),
        at,
        a_etag,
    }
}

/// `at` written with a +05:30 offset: the same instant.
fn in_india(at: &str) -> String {
    let utc = humantime::parse_rfc3339(at).unwrap();
    let local = humantime::format_rfc3339_millis(utc + Duration::from_secs(5 * 3600 + 1800));
    local.to_string().replace('Z', "+05:30")
}

fn query(at: &str) -> String {
    at.replace('+', "%2B")
}

async fn state_at(api: &Api, id: &str, at: &str) -> crate::helpers::Reply {
    api.get(&format!("/v1/states/{}?at={}", encode_id(id), query(at)))
        .await
}

#[tokio::test]
async fn reads_at_an_instant_answer_what_stood_then() {
    let app = gateway().await;
    let timeline = timeline(&app).await;
    for at in [timeline.at.clone(), in_india(&timeline.at)] {
        let a = state_at(&app, A, &at).await;
        a.expect(StatusCode::OK);
        assert_eq!(a.json(), timeline.a_at, "A as it was at {at}");
        assert_eq!(a.header("etag"), Some(timeline.a_etag.as_str()));
        state_at(&app, B, &at)
            .await
            .expect_because(StatusCode::NOT_FOUND, "B was created later");
        let c = state_at(&app, C, &at).await;
        c.expect_because(StatusCode::OK, "C was deleted later");
        assert_eq!(c.json()["completed"], bookmark("users", 5)["completed"]);

        let listed = app
            .get(&format!("/v1/states?pattern=pit:*&at={}", query(&at)))
            .await;
        listed.expect(StatusCode::OK);
        let states = listed.json()["states"].clone();
        let ids: Vec<&str> = states
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["state_id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, [A, C]);
        assert_eq!(states[0]["updated_at"], timeline.a_at["updated_at"]);

        let documents = app
            .get(&format!(
                "/v1/states?pattern=pit:*&include=documents&at={}",
                query(&at)
            ))
            .await;
        assert_eq!(
            documents.json()["states"][0]["completed"],
            timeline.a_at["completed"]
        );

        let bookmarks = app
            .get(&format!("/v1/bookmarks?pattern=pit:*&at={}", query(&at)))
            .await;
        bookmarks.expect(StatusCode::OK);
        let rows: Vec<(String, Value)> = bookmarks.json()["bookmarks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| {
                (
                    row["state_id"].as_str().unwrap().to_owned(),
                    row["replication_key_value"].clone(),
                )
            })
            .collect();
        assert_eq!(
            rows,
            [(A.to_owned(), json!(2)), (C.to_owned(), json!(5))],
            "bookmarks agree with the states"
        );
    }
    // Now, the same reads answer the present.
    let a = app.get_state(A).await;
    assert_eq!(a.json()["completed"], bookmark("orders", 3)["completed"]);
    app.get_state(C).await.expect(StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn an_instant_ahead_or_past_the_retention_is_refused() {
    let app = gateway().await;
    app.put_state(A, &bookmark("orders", 1))
        .await
        .expect(StatusCode::CREATED);
    let now = std::time::SystemTime::now();
    let future = humantime::format_rfc3339_millis(now + Duration::from_secs(3600)).to_string();
    let ahead = state_at(&app, A, &future).await;
    ahead.expect(StatusCode::BAD_REQUEST);
    assert_eq!(ahead.problem_type(), "invalid-query");

    let past = humantime::format_rfc3339_millis(now - Duration::from_secs(7200)).to_string();
    for path in [
        format!("/v1/states/{}?at={past}", encode_id(A)),
        format!("/v1/states?at={past}"),
        format!("/v1/bookmarks?at={past}"),
    ] {
        let expired = app.get(&path).await;
        expired.expect(StatusCode::GONE);
        assert_eq!(expired.problem_type(), "history-expired");
        let oldest = expired.json()["oldest"].as_str().unwrap().to_owned();
        let oldest = humantime::parse_rfc3339(&oldest).unwrap();
        assert!(
            oldest > now - Duration::from_secs(3700) && oldest <= now + Duration::from_secs(60)
        );
    }
    for bad in ["yesterday", "2026-12-01T10:00:00"] {
        state_at(&app, A, bad).await.expect(StatusCode::BAD_REQUEST);
    }
}
