//! Forwarding to peers: every state_id with a live claim has one authority,
//! the gateway holding the claim, and any other gateway passes that id's
//! lock operations and lock-checked writes to it, one hop, under a deadline
//! of its own. A forwarded request carries the forwarding gateway's id in
//! `x-statehouse-forwarded-by`, and is never forwarded again: a gateway that
//! gets one for an id another gateway holds answers 421, and the forwarding
//! gateway looks the authority up afresh.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, Request, Response, Uri, header};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use uuid::Uuid;

use super::claim::{Authority, Coordinator};
use super::error::LockError;
use super::peer::{FORWARDED_BY, Peer, Route, SeenLease};
use super::slots::Slots;
use crate::config::LockSettings;
use crate::domain::StateId;
use crate::traces;

/// Authorities looked up lately, so that a non-authority forwards without a
/// ClickHouse read per request. An entry is kept for a third of the claim
/// TTL at most, and dropped when the peer turns out not to be the authority.
#[derive(Default)]
pub(super) struct Authorities {
    known: Mutex<HashMap<StateId, (Peer, Instant)>>,
}

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("gateway {gateway_id} at {url} did not answer: {reason}")]
    Unreachable {
        gateway_id: Uuid,
        url: String,
        reason: String,
        /// It could not be reached at all (not merely slow): it is looked
        /// up afresh for every id.
        refused: bool,
    },
}

/// The HTTP client to peers: plain HTTP to `http://` advertise URLs, TLS
/// checked against the peer CA to `https://` ones.
#[derive(Clone)]
pub(super) struct PeerClient {
    client: Client<HttpsConnector<HttpConnector>, Body>,
}

impl PeerClient {
    pub(super) fn new(tls: Arc<rustls::ClientConfig>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        connector.enforce_http(false);
        let connector = HttpsConnectorBuilder::new()
            .with_tls_config(Arc::unwrap_or_clone(tls))
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
        }
    }
}

/// An error with its causes, which hyper's client keeps out of its own
/// text: a peer's refused certificate shows only there.
fn with_causes(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(inner) = cause {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        cause = inner.source();
    }
    text
}

/// How long a peer that left a request unanswered is remembered at most:
/// longer than any claim TTL it is asked about.
const UNANSWERED_KEPT: Duration = Duration::from_secs(600);

/// A peer that does not take the connection within this is taken for gone.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Headers that belong to one connection, not to the request.
const HOP_BY_HOP: [HeaderName; 5] = [
    header::CONNECTION,
    header::TRANSFER_ENCODING,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
];

/// Where requests about a state_id go, and the client that takes them
/// there.
pub(super) struct Router {
    peers: PeerClient,
    /// Who the authority for an id is, as looked up lately.
    authorities: Authorities,
    /// Peers that did not answer a forwarded request lately, and when: a
    /// lapsed holder among them is not asked first (see [`Router::route`]).
    unanswered: Mutex<HashMap<Uuid, Instant>>,
    gateway_id: Uuid,
}

/// What a routing read saw, for a request served here: the lease in
/// force, and when.
fn seen(authority: Authority, at: Instant) -> SeenLease {
    SeenLease {
        lease: authority.lease_in_force().cloned(),
        at,
    }
}

impl Router {
    pub fn new(settings: &LockSettings) -> Self {
        Self {
            peers: PeerClient::new(settings.peer_tls.clone()),
            authorities: Authorities::default(),
            unanswered: Mutex::default(),
            gateway_id: settings.gateway_id,
        }
    }

    /// The client to peers, as this gateway.
    pub fn client(&self) -> (PeerClient, Uuid) {
        (self.peers.clone(), self.gateway_id)
    }

    /// Where requests about `id` go: here, when this gateway holds its claim
    /// (or keeps leases under its lapsed claim) or nobody does; else to the
    /// live authority, if it advertised a URL. With no live claim, a gateway
    /// whose claim lapsed while its leases ran is asked first, as it may
    /// re-win the claim and keep them, unless it left a forwarded request
    /// unanswered within the claim TTL (it is gone, and the id is claimed
    /// here). `remembered` allows an authority looked up lately instead of
    /// asking ClickHouse; `with_row` reads the id's current row with the
    /// authority, for a write served here.
    pub async fn route(
        &self,
        id: &StateId,
        remembered: bool,
        with_row: bool,
        slots: &Slots,
        coordinator: &Coordinator,
    ) -> Result<Route, LockError> {
        if slots.answers_for(id) {
            return Ok(Route::Here(None));
        }
        if remembered && let Some(peer) = self.authorities.cached(id) {
            return Ok(Route::Peer(peer));
        }
        let at = Instant::now();
        let authority = coordinator.authority(id, with_row).await?;
        let Some(first) = authority.holder() else {
            if let Some(lapsed) = authority.lapsed_holder(self.gateway_id)
                && !self.unanswered_within(lapsed.gateway_id, coordinator.timing().ttl())
            {
                return Ok(Route::Peer(Peer::of(lapsed)));
            }
            return Ok(Route::Here(Some(seen(authority, at))));
        };
        if first.gateway_id == self.gateway_id {
            // This gateway's own claim, not yet won here (a claim for
            // writes settling): no other gateway can grant a lease before
            // it is gone, so the read stands in for a fresh one as when
            // nobody holds a claim, and the write reads nothing more.
            return Ok(Route::Here(Some(seen(authority, at))));
        }
        if first.advertise_url.is_empty() {
            tracing::info!(
                state_id = %id,
                gateway_id = %first.gateway_id,
                "the gateway holding this claim advertises no URL (--advertise-url), so requests cannot be forwarded to it; serving here"
            );
            return Ok(Route::Here(None));
        }
        let peer = Peer::of(first);
        self.authorities
            .remember(id, &peer, coordinator.timing().renew_interval());
        Ok(Route::Peer(peer))
    }

    /// The peer looked up for `id` turned out not to be its authority.
    pub fn forget_authority(&self, id: &StateId) {
        self.authorities.forget(id);
    }

    /// Sends `request` to `peer` and answers its response, or fails within `deadline`.
    pub async fn forward(
        &self,
        peer: &Peer,
        request: Request<Body>,
        deadline: Duration,
    ) -> Result<Response<Body>, ForwardError> {
        let sent = self
            .peers
            .send(self.gateway_id, peer, request, deadline)
            .await;
        if let Err(ForwardError::Unreachable { refused, .. }) = &sent {
            if *refused {
                self.authorities.forget_peer(peer.gateway_id);
            }
            let mut unanswered = self.unanswered.lock().unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            // Entries older than any TTL asked about go with each insert.
            unanswered.retain(|_, at| now.duration_since(*at) < UNANSWERED_KEPT);
            unanswered.insert(peer.gateway_id, now);
        }
        sent
    }

    /// Whether `gateway_id` left a forwarded request unanswered within `within`.
    fn unanswered_within(&self, gateway_id: Uuid, within: Duration) -> bool {
        self.unanswered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&gateway_id)
            .is_some_and(|at| at.elapsed() < within)
    }
}

impl PeerClient {
    /// Sends `request` to `peer` as gateway `me`, one hop: it is marked
    /// forwarded, so the peer never sends it on.
    pub(super) async fn send(
        &self,
        me: Uuid,
        peer: &Peer,
        request: Request<Body>,
        deadline: Duration,
    ) -> Result<Response<Body>, ForwardError> {
        let unreachable = |reason: String, refused: bool| ForwardError::Unreachable {
            gateway_id: peer.gateway_id,
            url: peer.url.clone(),
            reason,
            refused,
        };
        let (mut parts, body) = request.into_parts();
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        parts.uri = format!("{}{path}", peer.url)
            .parse::<Uri>()
            .map_err(|e| unreachable(format!("bad advertised URL: {e}"), false))?;
        for name in HOP_BY_HOP.iter().chain([&header::HOST]) {
            parts.headers.remove(name);
        }
        let me = HeaderValue::from_str(&me.to_string()).expect("a UUID is a valid header value");
        parts.headers.insert(FORWARDED_BY, me);
        // The peer's span is a child of this gateway's, not of its caller's.
        traces::inject(&mut parts.headers);
        let sent = self.client.request(Request::from_parts(parts, body));
        let response = match tokio::time::timeout(deadline, sent).await {
            Ok(Ok(response)) => response,
            Ok(Err(err)) => return Err(unreachable(with_causes(&err), true)),
            Err(_) => {
                return Err(unreachable(format!("no answer within {deadline:?}"), false));
            }
        };
        let (mut parts, body) = response.into_parts();
        for name in &HOP_BY_HOP {
            parts.headers.remove(name);
        }
        Ok(Response::from_parts(parts, Body::new(body)))
    }
}

impl Authorities {
    fn cached(&self, id: &StateId) -> Option<Peer> {
        let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        known
            .get(id)
            .filter(|(_, until)| Instant::now() < *until)
            .map(|(peer, _)| peer.clone())
    }

    fn remember(&self, id: &StateId, peer: &Peer, for_at_most: Duration) {
        let until = Instant::now() + for_at_most.min(peer.lapses_in());
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        // Expired entries go with each insert; the map never outgrows the ids
        // forwarded within one entry lifetime.
        let now = Instant::now();
        known.retain(|_, (_, until)| now < *until);
        known.insert(id.clone(), (peer.clone(), until));
    }

    fn forget(&self, id: &StateId) {
        self.known
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }

    /// A peer that cannot be reached is looked up afresh for every id.
    fn forget_peer(&self, gateway_id: Uuid) {
        self.known
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, (peer, _)| peer.gateway_id != gateway_id);
    }
}
