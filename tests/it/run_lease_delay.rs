//! `statehouse lock` and the lock-delay, from the client side: it asks for
//! one with every acquire, and an id in its lock-delay is busy. A stand-in
//! gateway answers, since the gateway's own lock-delay is built elsewhere.

use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::run_lease::{Scratch, ended, lock};

/// Answers one request with a 409 `lock-delay`; hands back the request's body.
async fn delayed_gateway() -> (String, tokio::task::JoinHandle<Value>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let served = tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.unwrap();
        let mut received = Vec::new();
        let mut buf = [0u8; 4096];
        let body = loop {
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0, "the request broke off");
            received.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&received).into_owned();
            let Some((head, body)) = text.split_once("\r\n\r\n") else {
                continue;
            };
            let length: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().to_owned())
                })
                .expect("a content-length")
                .parse()
                .unwrap();
            if body.len() >= length {
                break serde_json::from_str::<Value>(&body[..length]).unwrap();
            }
        };
        let problem = r#"{"type":"urn:statehouse:problem:lock-delay","title":"Lock-delay","status":409,"detail":"the last lease was lost","free_at":"2026-12-05T01:00:15.000Z"}"#;
        let answer = format!(
            "HTTP/1.1 409 Conflict\r\ncontent-type: application/problem+json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{problem}",
            problem.len()
        );
        conn.write_all(answer.as_bytes()).await.unwrap();
        body
    });
    (base, served)
}

#[tokio::test]
async fn an_id_in_its_lock_delay_is_busy_and_the_delay_asked_for_is_grace_plus_5s() {
    for (flags, asked) in [
        (vec!["--grace", "20s"], 25),
        (vec!["--lock-delay", "1500ms"], 2),
    ] {
        let (base, served) = delayed_gateway().await;
        let scratch = Scratch::new();
        let run = lock(&base, &flags, "job", &scratch.0, "touch ran");
        let (status, stderr) = ended(run, Duration::from_secs(20)).await;
        assert_eq!(status, Some(75), "{stderr}");
        assert!(stderr.contains("2026-12-05T01:00:15.000Z"), "{stderr}");
        assert!(stderr.contains("lock-delay"), "{stderr}");
        assert!(!scratch.path("ran").exists(), "nothing was run");
        let body = served.await.unwrap();
        assert_eq!(body["lock_delay_seconds"], asked, "{flags:?}: {body}");
    }
}
