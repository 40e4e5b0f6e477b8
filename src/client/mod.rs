//! The HTTP client of the command-line tools that speak to a gateway
//! (`statehouse lock`, `statehouse wait`, `statehouse healthcheck`): reqwest
//! on the project's one TLS stack, rustls with ring, set up from the same PEM
//! files as the shim (a CA file, a client certificate and its key), and what
//! every one of them reads from an answer. Where the gateway is and with
//! which token is `connection`.

mod bearer;
mod connection;

pub use self::bearer::Bearer;
pub use self::connection::{Connection, ConnectionArgs, GatewayUrl};

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use reqwest::header::{HeaderMap, RETRY_AFTER};

use crate::tls::{Identity, peer_client_config, read_certificates};

/// The PEM files a client trusts and presents over HTTPS.
#[derive(Clone, Debug, Default)]
pub struct TlsFiles {
    /// The CA the gateway's certificate must chain to; the system's when none.
    pub ca_file: Option<PathBuf>,
    /// A client certificate to present (mTLS), with its key.
    pub client_cert_file: Option<PathBuf>,
    /// The key of `client_cert_file`.
    pub client_key_file: Option<PathBuf>,
}

/// A reqwest builder that trusts and presents what `tls` names; only its
/// TLS is set, the caller adds timeouts and the like.
pub fn builder(tls: &TlsFiles) -> Result<reqwest::ClientBuilder, String> {
    let roots = match &tls.ca_file {
        Some(path) => Some(
            read_certificates(path)
                .map_err(|e| format!("cannot use the CA file {}: {e}", path.display()))?,
        ),
        None => None,
    };
    let identity = match (&tls.client_cert_file, &tls.client_key_file) {
        (Some(cert), Some(key)) => Some(Arc::new(
            Identity::load(cert, key).map_err(|e| e.to_string())?,
        )),
        (None, None) => None,
        _ => return Err("a client certificate needs its key, and a key its certificate".into()),
    };
    let config = peer_client_config(roots.as_deref(), identity);
    // reqwest takes a rustls config of the version it was built with, which
    // is this one (one rustls in the tree): no second TLS setup to keep.
    Ok(reqwest::Client::builder().use_preconfigured_tls((*config).clone()))
}

/// An error with its causes: reqwest's own text leaves out why a connection
/// failed (a refused connection, an unknown certificate issuer).
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// An answer's `Retry-After` in whole seconds, as the gateway sends it.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
}

/// An answer's body, refused past `max` bytes: a larger one is not the
/// gateway's. An error says why it could not be read whole.
pub async fn read_body(mut response: reqwest::Response, max: usize) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| format!("the answer broke off: {}", error_chain(&e)))?
    {
        if body.len() + chunk.len() > max {
            return Err(format!("the answer is over {max} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// A path segment keeps only RFC 3986's unreserved characters as they are.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// A state_id or a pool name as one segment of a path.
pub fn path_segment(raw: &str) -> String {
    utf8_percent_encode(raw, SEGMENT).to_string()
}
