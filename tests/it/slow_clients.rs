//! Clients that send their request a byte at a time are cut off (headers:
//! the connection is closed; bodies: 408), and idle kept-alive connections
//! are closed, while everyone else is served.

use std::net::SocketAddr;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::helpers::{
    clickhouse_url, metric, spawn_app, spawn_app_with, spawn_gateway_process, unique_schema,
};

fn address(base: &str) -> SocketAddr {
    base.trim_start_matches("http://").parse().unwrap()
}

/// Sends `head` at once, then one more byte (from `then`, repeated for ever)
/// every 200 ms, and says on `started` once the first byte is out. Answers
/// what came back before the gateway closed the connection.
async fn trickle(
    addr: SocketAddr,
    head: String,
    then: &'static [u8],
    started: mpsc::Sender<()>,
) -> String {
    let stream = TcpStream::connect(addr).await.expect("the gateway accepts");
    let (mut reader, mut writer) = stream.into_split();
    let feeding = async move {
        if writer.write_all(head.as_bytes()).await.is_ok() {
            let _ = started.send(()).await;
            for byte in then.iter().cycle() {
                tokio::time::sleep(Duration::from_millis(200)).await;
                if writer.write_all(&[*byte]).await.is_err() {
                    break;
                }
            }
        }
        // Keep the sending side open: closing it would end the request by itself.
        std::future::pending::<()>().await;
    };
    let reading = async move {
        let mut received = Vec::new();
        // A reset after the answer is fine: what arrived before it is kept.
        let _ = reader.read_to_end(&mut received).await;
        String::from_utf8_lossy(&received).into_owned()
    };
    tokio::select! {
        received = reading => received,
        () = feeding => unreachable!(),
    }
}

fn slow_head(n: usize) -> String {
    format!("GET /v1/states/slow-head-{n} HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
}

fn slow_body(n: usize) -> String {
    format!(
        "PUT /v1/states/slow-body-{n} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{{\"completed\": {{\"pad\": \""
    )
}

fn assert_body_timeout(received: &str) {
    assert!(received.starts_with("HTTP/1.1 408 "), "{received}");
    let lower = received.to_ascii_lowercase();
    assert!(lower.contains("\r\nconnection: close\r\n"), "{received}");
    assert!(
        lower.contains("\r\ncontent-type: application/problem+json\r\n"),
        "{received}"
    );
    assert!(
        received.contains("urn:statehouse:problem:body-timeout"),
        "{received}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_slow_clients_are_cut_off_while_others_are_served() {
    const SLOW_HEADS: usize = 400;
    const SLOW_BODIES: usize = 100;
    let schema = unique_schema();
    let gateway = spawn_gateway_process(
        &clickhouse_url(),
        &[
            "--schema",
            &schema,
            "--header-read-timeout",
            "5s",
            "--body-read-timeout",
            "5s",
            // Slow bodies hold a place under the limit until they are cut off.
            "--max-concurrent-requests",
            "200",
        ],
    )
    .await;
    let addr = address(&gateway.base);
    let (started, mut all_started) = mpsc::channel(SLOW_HEADS + SLOW_BODIES);
    let heads: Vec<_> = (0..SLOW_HEADS)
        .map(|n| tokio::spawn(trickle(addr, slow_head(n), b"a", started.clone())))
        .collect();
    let bodies: Vec<_> = (0..SLOW_BODIES)
        .map(|n| tokio::spawn(trickle(addr, slow_body(n), b"x", started.clone())))
        .collect();
    drop(started);
    tokio::time::timeout(Duration::from_secs(60), async {
        for _ in 0..SLOW_HEADS + SLOW_BODIES {
            all_started.recv().await.expect("every slow client starts");
        }
    })
    .await
    .expect("500 slow clients connect");

    let api = gateway.api();
    for round in 0..5 {
        let written = api
            .put_state("ordinary", &json!({"completed": {"round": round}}))
            .await;
        assert!(written.status.is_success(), "{}", written.text);
        let read = api.get_state("ordinary").await;
        assert_eq!(read.json()["completed"]["round"], round);
        let (lease, _) = api.lease("ordinary", "worker", 30, 0.0).await;
        api.release("ordinary", &lease)
            .await
            .expect(StatusCode::NO_CONTENT);
        api.get("/healthz").await.expect(StatusCode::OK);
    }

    let cut_off = Duration::from_secs(120);
    for head in heads {
        let received = tokio::time::timeout(cut_off, head)
            .await
            .expect("a slow request head is cut off")
            .unwrap();
        assert_eq!(received, "", "closed without an answer");
    }
    let mut answered_408 = 0;
    for body in bodies {
        let received = tokio::time::timeout(cut_off, body)
            .await
            .expect("a slow body is cut off")
            .unwrap();
        // The gateway closes with the rest of the body unread, so the 408 may
        // be overtaken by a reset; what does arrive must be the 408.
        if !received.is_empty() {
            assert_body_timeout(&received);
            answered_408 += 1;
        }
    }
    assert!(answered_408 > 0, "no slow body saw its 408");

    let metrics = api.get("/metrics").await.text;
    assert_eq!(
        metric(
            &metrics,
            r#"statehouse_connections_closed_total{reason="header_timeout"}"#
        ),
        Some(SLOW_HEADS as f64),
        "{metrics}"
    );
    assert_eq!(
        metric(
            &metrics,
            r#"statehouse_http_requests_total{method="PUT",route="/v1/states/{state_id}",status="408"}"#
        ),
        Some(SLOW_BODIES as f64),
        "{metrics}"
    );
    assert_eq!(
        api.get("/v1/states?pattern=slow-*").await.json()["states"],
        json!([]),
        "nothing slow was written"
    );
}

#[tokio::test]
async fn a_body_sent_a_byte_at_a_time_gets_408_and_writes_nothing() {
    let app =
        spawn_app_with(|config| config.client_timeouts.body_read = Duration::from_secs(1)).await;
    let (started, _) = mpsc::channel(1);
    let received = tokio::time::timeout(
        Duration::from_secs(60),
        trickle(address(&app.base), slow_body(0), b"x", started),
    )
    .await
    .expect("the slow body is cut off");
    assert_body_timeout(&received);
    app.get_state("slow-body-0")
        .await
        .expect(StatusCode::NOT_FOUND);
}

/// Reads one response with a Content-Length body from a kept-alive connection.
async fn read_response(stream: &mut TcpStream) -> String {
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed mid-response");
        received.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&received).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let length: usize = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")?
                        .parse()
                        .ok()
                })
                .expect("a content-length");
            if received.len() >= end + 4 + length {
                return text;
            }
        }
    }
}

#[tokio::test]
async fn idle_kept_alive_connections_are_closed_after_the_idle_timeout() {
    let app = spawn_app_with(|config| config.client_timeouts.idle = Duration::from_secs(1)).await;
    let addr = address(&app.base);
    let mut kept = TcpStream::connect(addr).await.unwrap();
    for _ in 0..2 {
        kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .await
            .unwrap();
        let response = read_response(&mut kept).await;
        assert!(response.starts_with("HTTP/1.1 200 "), "{response}");
    }
    let mut silent = TcpStream::connect(addr).await.unwrap();
    for (name, stream) in [("kept-alive", &mut kept), ("silent", &mut silent)] {
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut rest))
            .await
            .unwrap_or_else(|_| panic!("the {name} connection is closed"));
        assert_eq!(read.unwrap(), 0, "{name}: closed without another word");
    }
    let metrics = app.get("/metrics").await.text;
    assert_eq!(
        metric(
            &metrics,
            r#"statehouse_connections_closed_total{reason="idle_timeout"}"#
        ),
        Some(2.0),
        "{metrics}"
    );
}

/// The kernel holds completed connections for the gateway in a queue as long
/// as its listen backlog. std's and mio's 128 lost some of the 500 slow
/// clients above whenever the machine kept the accept loop waiting: their
/// handshakes were dropped, then reset, before the gateway saw them.
#[tokio::test]
async fn the_listening_socket_queues_a_burst_of_connections() {
    let app = spawn_app().await;
    let port = address(&app.base).port();
    let listing = std::process::Command::new("ss")
        .args(["-Hltn", &format!("sport = :{port}")])
        .output()
        .expect("ss (iproute2) is installed");
    let listing = String::from_utf8_lossy(&listing.stdout).into_owned();
    // For a listening socket, ss shows the backlog as its Send-Q.
    let backlog: u32 = listing
        .split_whitespace()
        .nth(2)
        .and_then(|q| q.parse().ok())
        .unwrap_or_else(|| panic!("no listening socket on {port}: {listing:?}"));
    let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(backlog, somaxconn.min(4096), "{listing}");
    assert!(
        backlog >= 1000,
        "room for a burst of 500 and more: {listing}"
    );
}
