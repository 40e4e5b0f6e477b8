//! A per-request round-robin HTTP load balancer, as an L7 balancer (nginx,
//! Envoy, a cloud load balancer) runs in front of several gateways: each
//! request goes to the next upstream over a fresh connection, and an upstream
//! that refuses the connection is skipped.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

pub struct Balancer {
    pub base: String,
}

struct Upstreams {
    bases: Vec<String>,
    next: AtomicUsize,
    client: reqwest::Client,
}

impl Balancer {
    pub async fn start(upstreams: Vec<String>) -> Self {
        Self::start_with(upstreams, reqwest::Client::builder()).await
    }

    /// A balancer whose client to the upstreams is `client` (HTTPS settings).
    pub async fn start_with(upstreams: Vec<String>, client: reqwest::ClientBuilder) -> Self {
        let shared = Arc::new(Upstreams {
            bases: upstreams,
            next: AtomicUsize::new(0),
            client: client.pool_max_idle_per_host(0).build().unwrap(),
        });
        let app = axum::Router::new().fallback(relay).with_state(shared);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self { base }
    }
}

async fn relay(State(upstreams): State<Arc<Upstreams>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    for _ in 0..upstreams.bases.len() {
        let index = upstreams.next.fetch_add(1, Ordering::SeqCst) % upstreams.bases.len();
        let mut sent = upstreams
            .client
            .request(
                parts.method.clone(),
                format!("{}{path}", upstreams.bases[index]),
            )
            .body(body.clone());
        for (name, value) in &parts.headers {
            if name != "host" && name != "connection" {
                sent = sent.header(name, value);
            }
        }
        match sent.send().await {
            Ok(answer) => {
                let mut response = Response::builder().status(answer.status());
                for (name, value) in answer.headers() {
                    if name != "transfer-encoding" && name != "connection" {
                        response = response.header(name, value);
                    }
                }
                let bytes = answer.bytes().await.unwrap_or_default();
                return response.body(Body::from(bytes)).unwrap();
            }
            Err(err) if err.is_connect() => continue,
            Err(err) => return (StatusCode::BAD_GATEWAY, err.to_string()).into_response(),
        }
    }
    (StatusCode::BAD_GATEWAY, "no upstream took the connection").into_response()
}
