//! The HTTP client under the clickhouse crate: plain HTTP, or TLS through
//! rustls (ring) trusting the system's roots plus any configured ones.

use std::time::Duration;

use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rustls::RootCertStore;

use super::target::ClickHouseTarget;

/// ClickHouse closes idle keep-alive connections after 3 s; reuse stays below.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(2);
const TCP_KEEPALIVE: Duration = Duration::from_secs(60);

pub fn connector(target: &ClickHouseTarget) -> HttpsConnector<HttpConnector> {
    let mut http = HttpConnector::new();
    http.set_keepalive(Some(TCP_KEEPALIVE));
    http.set_nodelay(true);
    http.enforce_http(false);
    let mut roots = RootCertStore::empty();
    if target.secure {
        roots.add_parsable_certificates(crate::tls::system_roots().iter().cloned());
        roots.add_parsable_certificates(target.extra_roots.iter().cloned());
    }
    let tls = rustls::ClientConfig::builder_with_provider(
        rustls::crypto::ring::default_provider().into(),
    )
    .with_safe_default_protocol_versions()
    .expect("ring supports the default TLS versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http)
}

/// The crate's body type is not nameable, so the caller's `with_http_client`
/// fixes it; this builds everything else.
pub fn builder() -> hyper_util::client::legacy::Builder {
    let mut builder = Client::builder(TokioExecutor::new());
    builder.pool_idle_timeout(POOL_IDLE_TIMEOUT);
    builder
}
