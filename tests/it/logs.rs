//! Text logs cannot be forged or garbled by what a client sends.

use reqwest::{Method, StatusCode};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::helpers::{
    Api, clickhouse_url, encode_id, spawn_gateway_process_logging, unique_schema,
};

/// What a forger would like to start a line of its own with.
const FORGED: &str = "\r\nFORGED-LINE\0\x1b[31m";

/// Sends a raw HTTP/1.1 request head and answers the status (0 if none came back).
async fn raw_request(base: &str, head: &[u8]) -> u16 {
    let addr = base.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(head).await.unwrap();
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response).await;
    String::from_utf8_lossy(&response)
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn get_with_header(name: &str, value: &[u8]) -> Vec<u8> {
    let mut head =
        b"GET /v1/states?limit=1 HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n".to_vec();
    head.extend_from_slice(name.as_bytes());
    head.extend_from_slice(b": ");
    head.extend_from_slice(value);
    head.extend_from_slice(b"\r\n\r\n");
    head
}

#[tokio::test]
async fn client_text_is_escaped_in_every_text_log_line() {
    let schema = unique_schema();
    let gateway = spawn_gateway_process_logging(
        &clickhouse_url(),
        &["--schema", &schema, "--claim-settle", "100ms"],
        "text",
        // Every level of our own code, so that a debug line added later is checked too.
        &[("RUST_LOG", "statehouse=trace,tower_http=trace,info")],
    )
    .await;
    let api: Api = gateway.api();

    // state_id and owner: a lease taken and force-unlocked (which logs a warning).
    let id = format!("a{FORGED}b");
    let acquired = api
        .acquire(
            &id,
            &json!({"owner": format!("owner{FORGED}"), "ttl_seconds": 60}),
        )
        .await;
    acquired.expect(StatusCode::CREATED);
    let unlocked = api
        .request(
            Method::DELETE,
            &format!(
                "/v1/locks/{}?reason={}",
                encode_id(&id),
                encode_id(&format!("r{FORGED}"))
            ),
            None,
            &[],
        )
        .await;
    unlocked.expect(StatusCode::NO_CONTENT);
    let written = api
        .put_state(&id, &json!({"completed": {"owner": format!("v{FORGED}")}}))
        .await;
    written.expect(StatusCode::CREATED);

    // Stream names: a bookmark that goes backwards is logged with its
    // stream's name, by a PUT, a PATCH and a bulk import alike.
    let stream = format!("orders{FORGED}");
    let bookmarks = |value: &str| {
        json!({"singer_state": {"bookmarks": {&stream: {
            "replication_key": "updated_at", "replication_key_value": value}}}})
    };
    let bookmark = |value: &str| json!({"completed": bookmarks(value)});
    let regressing = format!("r{FORGED}");
    for (method, value) in [
        (Method::PUT, "2026-01-03"),
        (Method::PUT, "2026-01-02"),
        (Method::PATCH, "2026-01-01"),
    ] {
        let reply = api
            .request(
                method,
                &format!("/v1/states/{}", encode_id(&regressing)),
                Some(&bookmark(value).to_string()),
                &[],
            )
            .await;
        assert!(reply.status.is_success(), "{}", reply.text);
    }
    let imported = api
        .request(
            Method::POST,
            "/v1/states",
            Some(
                &json!([{"state_id": &regressing, "completed": bookmarks("2025-12-31")}])
                    .to_string(),
            ),
            &[],
        )
        .await;
    imported.expect(StatusCode::OK);

    // pattern: deleting by pattern logs it.
    let deleted = api
        .request(
            Method::DELETE,
            &format!("/v1/states?pattern={}", encode_id(&format!("a{FORGED}*"))),
            None,
            &[],
        )
        .await;
    assert_eq!(
        deleted.json(),
        json!({"deleted": 1, "skipped_locked": 0, "locked": []})
    );

    // User-Agent and X-Request-Id, in the request span. HTTP refuses control
    // bytes in a header (hyper answers 400 before any log line), but bytes
    // above 0x7f pass, and decode to C1 controls, line and bidi separators.
    let sneaky = "ua\u{85}FORGED-LINE\u{2028}FORGED-LINE\u{202e}\t\"k=v\"";
    assert_eq!(
        raw_request(
            &gateway.base,
            &get_with_header("User-Agent", sneaky.as_bytes())
        )
        .await,
        200
    );
    assert_eq!(
        raw_request(
            &gateway.base,
            &get_with_header("X-Request-Id", b"rid\t\"k=v\" x")
        )
        .await,
        200
    );
    for bytes in [
        &b"ua\x1b[31mred"[..],
        b"ua\0nul",
        b"ua\rFORGED-LINE",
        b"ua\x7fdel",
    ] {
        let status = raw_request(&gateway.base, &get_with_header("User-Agent", bytes)).await;
        assert!(status == 200 || status == 400, "{bytes:?}: {status}");
    }

    let logs = gateway.kill_and_collect_logs().await;
    let text: Vec<String> = logs
        .iter()
        .map(|line| String::from_utf8(line.clone()).expect("log lines are UTF-8"))
        .collect();
    for line in &text {
        assert!(
            !line
                .chars()
                .any(|c| c.is_control() || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202e}')),
            "a raw control character in {line:?}"
        );
        // Every line is one of ours: a timestamp, then a level.
        let mut fields = line.split_whitespace();
        let at = fields.next().unwrap_or_default();
        assert!(
            humantime::parse_rfc3339(at).is_ok(),
            "a line that does not start with a time: {line:?}"
        );
        assert!(
            matches!(
                fields.next(),
                Some("TRACE" | "DEBUG" | "INFO" | "WARN" | "ERROR")
            ),
            "a line without a level: {line:?}"
        );
        assert!(!line.starts_with("FORGED"), "{line:?}");
    }
    // The values were logged, escaped: the checks above were not vacuous.
    let escaped = r#"\r\nFORGED-LINE\0\u{1b}[31m"#;
    for needle in [
        format!(r#"state_id="a{escaped}b""#),
        format!(r#"pattern="a{escaped}*""#),
        format!(r#"streams="orders{escaped}""#),
        format!(r#"reason="r{escaped}""#),
        r#"user_agent="ua\u{85}FORGED-LINE\u{2028}FORGED-LINE\u{202e}\t\"k=v\"""#.to_owned(),
        r#"request_id="rid\t\"k=v\" x""#.to_owned(),
    ] {
        assert!(
            text.iter().any(|line| line.contains(&needle)),
            "no line holds {needle}:\n{}",
            text.join("\n")
        );
    }
}
