//! Keeps a web browser from being used against a gateway without tokens.
//! Any page may send a "simple" cross-origin request (a `text/plain` POST or
//! PUT from a form or `fetch(..., {mode: "no-cors"})`) with no preflight,
//! and a DNS-rebinding page may even read the answers. With tokens, a page
//! has none to send; without them nothing else stands in the way, so:
//! - a request whose `Origin` is not the gateway's own is refused (403)
//!   unless it only reads;
//! - while the gateway listens on loopback only, a request for a `Host`
//!   that is neither a loopback name or address nor the advertise URL's
//!   host is refused (421): a rebound name is neither.
//!
//! curl, the shim and the runner send no `Origin`, and name the address they
//! were given as `Host`: they pass.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::uri::Authority;
use axum::http::{Method, header};
use axum::middleware::Next;
use axum::response::Response;

use super::error::{ProblemType, problem};
use super::server::TlsSession;
use crate::auth::live::LiveTokens;

/// What the guard needs to know of the gateway, fixed at start.
#[derive(Clone, Debug, Default)]
pub struct OwnHosts {
    /// The host of `--advertise-url`, lower case: peers and balancers reach
    /// the gateway by it.
    pub advertised: Option<String>,
    /// The gateway listens on a loopback address only, so only loopback
    /// names and addresses (and the advertised host) can be its own.
    pub loopback_only: bool,
}

/// Handed the tokens and the hosts, not the whole `AppContext`: the
/// context holds the [`OwnHosts`], so this module stays below it.
pub async fn guard(
    State((tokens, own_hosts)): State<(Arc<LiveTokens>, Arc<OwnHosts>)>,
    request: Request,
    next: Next,
) -> Response {
    if tokens.required() {
        return next.run(request).await;
    }
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| request.uri().authority().map(Authority::as_str));
    if own_hosts.loopback_only
        && let Some(host) = host
        && !own_hosts.serves(host)
    {
        return problem(
            ProblemType::UnknownHost,
            "this gateway has no tokens and serves only requests addressed to a loopback name or address, or to its --advertise-url host",
        );
    }
    let reads_only = matches!(*request.method(), Method::GET | Method::HEAD);
    if !reads_only && let Some(origin) = request.headers().get(header::ORIGIN) {
        let tls = request.extensions().get::<TlsSession>().is_some();
        if !same_origin(origin.to_str().unwrap_or("null"), host, tls) {
            return problem(
                ProblemType::CrossOrigin,
                "this gateway has no tokens, so it takes changes only from clients that send no Origin (curl, Meltano) or from its own pages",
            );
        }
    }
    next.run(request).await
}

impl OwnHosts {
    /// Whether `host` (a `Host` header: name or address, maybe a port) is
    /// one this gateway answers to.
    fn serves(&self, host: &str) -> bool {
        let Ok(authority) = host.parse::<Authority>() else {
            return false;
        };
        let name = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .trim_end_matches('.')
            .to_ascii_lowercase();
        if let Ok(ip) = name.parse::<IpAddr>() {
            return ip.is_loopback() || self.advertised.as_deref() == Some(name.as_str());
        }
        name == "localhost"
            || name.ends_with(".localhost")
            || self.advertised.as_deref() == Some(name.as_str())
    }
}

/// Whether `origin` (an `Origin` header) is the page of the gateway the
/// request was sent to: same scheme, same host and port.
fn same_origin(origin: &str, host: Option<&str>, tls: bool) -> bool {
    let scheme = if tls { "https://" } else { "http://" };
    match (origin.strip_prefix(scheme), host) {
        (Some(authority), Some(host)) => authority.eq_ignore_ascii_case(host),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_names_and_addresses_and_the_advertised_host_are_served() {
        let hosts = OwnHosts {
            advertised: Some("gw-1.statehouse.internal".into()),
            loopback_only: true,
        };
        for host in [
            "localhost",
            "localhost:8080",
            "LOCALHOST.:8080",
            "app.localhost",
            "127.0.0.1:8080",
            "127.1.2.3",
            "[::1]:8080",
            "gw-1.statehouse.internal:8080",
        ] {
            assert!(hosts.serves(host), "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:8080",
            "localhost.evil.example",
            "10.0.0.5:8080",
            "[2001:db8::1]:8080",
            "",
            "a b",
        ] {
            assert!(!hosts.serves(host), "{host}");
        }
    }

    #[test]
    fn only_the_gateways_own_page_is_its_origin() {
        assert!(same_origin(
            "http://127.0.0.1:8080",
            Some("127.0.0.1:8080"),
            false
        ));
        assert!(same_origin(
            "http://LocalHost:8080",
            Some("localhost:8080"),
            false
        ));
        assert!(same_origin(
            "https://localhost:8443",
            Some("localhost:8443"),
            true
        ));
        assert!(!same_origin(
            "https://localhost:8080",
            Some("localhost:8080"),
            false
        ));
        assert!(!same_origin(
            "http://evil.example",
            Some("127.0.0.1:8080"),
            false
        ));
        assert!(!same_origin(
            "http://127.0.0.1:9999",
            Some("127.0.0.1:8080"),
            false
        ));
        assert!(!same_origin("null", Some("127.0.0.1:8080"), false));
        assert!(!same_origin("http://127.0.0.1:8080", None, false));
    }
}
