//! A local OTLP/HTTP collector on loopback: it accepts `POST /v1/traces` in
//! protobuf or JSON and keeps every span, for the trace tests to look at.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use prost::Message;

/// A span as the collector received it, ids in lowercase hex.
#[derive(Clone, Debug)]
pub struct Received {
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub name: String,
    /// The span's kind, as OTLP numbers it (2: server).
    pub kind: i32,
    /// The span's attributes, and its resource's under `resource.`.
    pub attributes: HashMap<String, String>,
    /// The (trace id, span id) of each span it links to.
    pub links: Vec<(String, String)>,
}

#[derive(Clone, Default)]
pub struct Collector {
    pub endpoint: String,
    spans: Arc<Mutex<Vec<Received>>>,
}

impl Collector {
    /// Starts a collector on a free loopback port.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let collector = Self {
            endpoint: format!("http://{}", listener.local_addr().unwrap()),
            spans: Arc::default(),
        };
        let app = Router::new()
            .route("/v1/traces", post(receive))
            .with_state(collector.spans.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        collector
    }

    pub fn spans(&self) -> Vec<Received> {
        self.spans.lock().unwrap().clone()
    }

    /// The spans of trace `trace_id`, once `enough` holds of them (within 15 s).
    pub async fn trace(
        &self,
        trace_id: &str,
        enough: impl Fn(&[Received]) -> bool,
    ) -> Vec<Received> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            let spans: Vec<Received> = self
                .spans()
                .into_iter()
                .filter(|span| span.trace_id == trace_id)
                .collect();
            if enough(&spans) {
                return spans;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "trace {trace_id} incomplete after 15 s: {spans:#?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn receive(
    State(spans): State<Arc<Mutex<Vec<Received>>>>,
    headers: HeaderMap,
    body: Bytes,
) -> StatusCode {
    let json = headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    let request = if json {
        serde_json::from_slice::<ExportTraceServiceRequest>(&body).map_err(|e| e.to_string())
    } else {
        ExportTraceServiceRequest::decode(body).map_err(|e| e.to_string())
    };
    let Ok(request) = request else {
        return StatusCode::BAD_REQUEST;
    };
    let mut received = Vec::new();
    for resource_spans in request.resource_spans {
        let resource: Vec<(String, String)> = resource_spans
            .resource
            .map(|r| r.attributes)
            .unwrap_or_default()
            .into_iter()
            .map(|kv| (format!("resource.{}", kv.key), text(kv.value)))
            .collect();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                let mut attributes: HashMap<String, String> =
                    span.attributes.into_iter().map(pair).collect();
                attributes.extend(resource.iter().cloned());
                received.push(Received {
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    name: span.name,
                    kind: span.kind,
                    attributes,
                    links: span
                        .links
                        .into_iter()
                        .map(|link| (hex(&link.trace_id), hex(&link.span_id)))
                        .collect(),
                });
            }
        }
    }
    spans.lock().unwrap().extend(received);
    StatusCode::OK
}

fn pair(kv: KeyValue) -> (String, String) {
    (kv.key, text(kv.value))
}

fn text(value: Option<AnyValue>) -> String {
    match value.and_then(|v| v.value) {
        Some(any_value::Value::StringValue(s)) => s,
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
