//! Forwarding to peers: every state_id with a live claim has one authority,
//! the gateway holding the claim, and any other gateway passes that id's
//! lock operations and lock-checked writes to it, one hop, under a deadline
//! of its own. A forwarded request carries the forwarding gateway's id in
//! `x-statehouse-forwarded-by`, and is never forwarded again: a gateway that
//! gets one for an id another gateway holds answers 421, and the forwarding
//! gateway looks the authority up afresh. It also names the gateway it is
//! meant for in `x-statehouse-forwarded-to`: any other that gets it (one now
//! at the address the claim names) answers 421 naming itself, and the peer
//! is taken for gone, as when its address refuses connections.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderName, Request, Response, StatusCode, Uri, header};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use uuid::Uuid;

use super::claim::{Authority, Coordinator};
use super::error::LockError;
use super::peer::{FORWARDED_BY, FORWARDED_TO, GATEWAY_ID, Peer, Route, SeenLease, uuid_header};
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
        /// It could not be reached at all (a refused connection, a failed
        /// handshake, another gateway answering at its address), or
        /// answered no probe past its claim: not merely slow.
        /// It is looked up afresh for every id, and not asked first as a
        /// lapsed holder for a claim TTL.
        gone: bool,
    },
}

/// What the probes of a peer that keeps a forward waiting found so far.
#[derive(Clone, Copy)]
enum Probed {
    NotYet,
    /// The last probe was answered, at this instant.
    Answered(Instant),
    /// The last probe went unanswered.
    Silent,
}

/// How a peer that keeps a forward waiting was found silent.
enum Silence {
    /// Its claim has lapsed and it answers no probe: treated as dead.
    Gone,
    /// The answer's time came, and it answered no probe lately.
    Unanswered,
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

/// A forward unanswered for this long has its peer probed: most are
/// answered sooner, and those pay no probe.
const PROBE_AFTER: Duration = Duration::from_secs(1);

/// How long a probe of a peer (`GET /healthz`, which touches no ClickHouse)
/// may take before the peer counts as not answering: a live gateway answers
/// in milliseconds even beside a slow ClickHouse.
const PROBE_DEADLINE: Duration = Duration::from_secs(2);

/// The pause between two probes of a peer that keeps a forward waiting.
const PROBE_EVERY: Duration = Duration::from_secs(1);

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
    /// Peers found gone lately (unreachable, another gateway at their
    /// address, or silent past their claim),
    /// and when: a lapsed holder among them is not asked first (see
    /// [`Router::route`]).
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
    /// re-win the claim and keep them, unless it was found gone within the
    /// claim TTL (see [`ForwardError::Unreachable`]'s `gone`: the id is
    /// claimed here). `remembered` allows an authority looked up lately instead of
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

    /// Sends `request` to `peer` and answers its response. A peer that
    /// answers no probe fails it by `answer_within`, or as soon as its claim
    /// has lapsed too (then it is taken for dead, see [`PeerClient::silence`]);
    /// one that answers its probes is alive and merely slow, and is waited
    /// for up to `patience`: failing its request earlier would answer "not
    /// done" for a write that may still land.
    pub async fn forward(
        &self,
        peer: &Peer,
        request: Request<Body>,
        answer_within: Duration,
        patience: Duration,
    ) -> Result<Response<Body>, ForwardError> {
        let answer_by = Instant::now() + answer_within;
        let silent = |reason: &str, gone| ForwardError::Unreachable {
            gateway_id: peer.gateway_id,
            url: peer.url.clone(),
            reason: reason.to_owned(),
            gone,
        };
        let sent = tokio::select! {
            sent = self.peers.send(self.gateway_id, peer, request, patience.max(answer_within)) => sent,
            silence = self.peers.silence(peer, answer_by) => Err(match silence {
                Silence::Gone => silent("its claim lapsed and it answers no probe (frozen, or cut off)", true),
                Silence::Unanswered => silent(&format!("no answer within {answer_within:?}, nor to a probe"), false),
            }),
        };
        if let Err(ForwardError::Unreachable { gone: true, .. }) = &sent {
            self.authorities.forget_peer(peer.gateway_id);
            let mut unanswered = self.unanswered.lock().unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            // Entries older than any TTL asked about go with each insert.
            unanswered.retain(|_, at| now.duration_since(*at) < UNANSWERED_KEPT);
            unanswered.insert(peer.gateway_id, now);
        }
        sent
    }

    /// Whether `gateway_id` was found gone within `within`.
    fn unanswered_within(&self, gateway_id: Uuid, within: Duration) -> bool {
        self.unanswered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&gateway_id)
            .is_some_and(|at| at.elapsed() < within)
    }
}

impl PeerClient {
    /// Resolves once `peer`, keeping a forward waiting, is found silent: it
    /// answers no probe, and either its claim has lapsed too (a live
    /// authority renews it while a request waits on it), so it is taken for
    /// dead, or `answer_by` has come. A peer that answers its probes is alive
    /// and never resolves this: it keeps its leases through a coordination
    /// outage that lapsed its claim (the outage rule, docs/gateways.md).
    async fn silence(&self, peer: &Peer, answer_by: Instant) -> Silence {
        let probed = Mutex::new(Probed::NotYet);
        let set = |state| *probed.lock().unwrap_or_else(|p| p.into_inner()) = state;
        let probing = async {
            tokio::time::sleep(PROBE_AFTER).await;
            loop {
                if self.probe(peer).await {
                    set(Probed::Answered(Instant::now()));
                } else if peer.lapses_in().is_zero() {
                    // While its claim is live nobody else may act on the id.
                    return Silence::Gone;
                } else {
                    set(Probed::Silent);
                }
                tokio::time::sleep(PROBE_EVERY).await;
            }
        };
        let judging = async {
            tokio::time::sleep_until(answer_by.into()).await;
            loop {
                let state = *probed.lock().unwrap_or_else(|p| p.into_inner());
                match state {
                    Probed::Silent => return Silence::Unanswered,
                    Probed::Answered(at) if at.elapsed() < PROBE_EVERY + PROBE_DEADLINE => {
                        tokio::time::sleep(PROBE_EVERY).await;
                    }
                    // Not asked yet (the request came late in its time), or
                    // not lately: asked now.
                    Probed::NotYet | Probed::Answered(_) => {
                        if !self.probe(peer).await {
                            return Silence::Unanswered;
                        }
                        set(Probed::Answered(Instant::now()));
                    }
                }
            }
        };
        tokio::select! {
            silence = probing => silence,
            silence = judging => silence,
        }
    }

    /// Whether `peer` answers `GET /healthz` within [`PROBE_DEADLINE`].
    async fn probe(&self, peer: &Peer) -> bool {
        let Ok(uri) = format!("{}/healthz", peer.url).parse::<Uri>() else {
            return false;
        };
        let Ok(request) = Request::get(uri).body(Body::empty()) else {
            return false;
        };
        matches!(
            tokio::time::timeout(PROBE_DEADLINE, self.client.request(request)).await,
            Ok(Ok(response)) if response.status().is_success()
        )
    }

    /// Sends `request` to `peer` as gateway `me`, one hop: it is marked
    /// forwarded, so the peer never sends it on, and names `peer`, so that
    /// another gateway at its address acts on nothing; that one's refusal
    /// finds `peer` gone.
    pub(super) async fn send(
        &self,
        me: Uuid,
        peer: &Peer,
        request: Request<Body>,
        deadline: Duration,
    ) -> Result<Response<Body>, ForwardError> {
        let unreachable = |reason: String, gone: bool| ForwardError::Unreachable {
            gateway_id: peer.gateway_id,
            url: peer.url.clone(),
            reason,
            gone,
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
        parts.headers.insert(FORWARDED_BY, uuid_header(me));
        parts
            .headers
            .insert(FORWARDED_TO, uuid_header(peer.gateway_id));
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
        if let Some(other) = answered_instead(&response, peer) {
            // Its address is another gateway's now: it is as gone as one
            // whose address refuses connections.
            return Err(unreachable(
                format!("gateway {other} answers there instead"),
                true,
            ));
        }
        let (mut parts, body) = response.into_parts();
        for name in &HOP_BY_HOP {
            parts.headers.remove(name);
        }
        Ok(Response::from_parts(parts, Body::new(body)))
    }
}

/// The gateway that refused a request forwarded to `peer` as not meant for
/// it (see [`FORWARDED_TO`]), if another one did.
fn answered_instead<B>(response: &Response<B>, peer: &Peer) -> Option<Uuid> {
    if response.status() != StatusCode::MISDIRECTED_REQUEST {
        return None;
    }
    let other = response.headers().get(GATEWAY_ID)?.to_str().ok()?;
    Uuid::parse_str(other)
        .ok()
        .filter(|other| *other != peer.gateway_id)
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
