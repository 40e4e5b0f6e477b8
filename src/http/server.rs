//! Serving connections. `axum::serve` has no header, body or idle timeouts,
//! so the gateway drives hyper's HTTP/1 connections itself (over TLS when
//! configured) and watches each one for a client that is too slow with its
//! handshake or request, or has gone quiet.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

use super::held_body::HeldBody;
use crate::config::ClientTimeouts;
use crate::metrics::Metrics;

/// Connections the kernel completes and queues for the gateway to accept.
/// std and mio listen with 128: a burst of new connections beyond that, while
/// the accept loop is busy, has its handshakes dropped or reset by the kernel
/// before the gateway ever sees them (capped by `net.core.somaxconn`).
const ACCEPT_BACKLOG: u32 = 4096;

/// Binds the gateway's listening socket.
pub fn bind(addr: std::net::SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As std and mio do: a restarted gateway can bind while old connections linger.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(ACCEPT_BACKLOG)
}

/// Serves `router` on `listener` (HTTPS only, given `tls`) until `signal` resolves; then stops
/// accepting, lets each connection finish its request in flight (idle ones
/// close at once) and returns when all are closed.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    timeouts: ClientTimeouts,
    tls: Option<TlsAcceptor>,
    metrics: Arc<Metrics>,
    signal: impl Future<Output = ()>,
) {
    let (stop, stopping) = watch::channel(false);
    // Every connection holds a receiver; once all are dropped, all are closed.
    let (open, open_marker) = watch::channel(());
    let mut signal = pin!(signal);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut signal => break,
        };
        match accepted {
            Ok((stream, _)) => {
                tokio::spawn(connection(
                    stream,
                    router.clone(),
                    timeouts,
                    tls.clone(),
                    metrics.clone(),
                    stopping.clone(),
                    open_marker.clone(),
                ));
            }
            Err(err) => accept_failed(err).await,
        }
    }
    drop(listener);
    stop.send_replace(true);
    drop(open_marker);
    open.closed().await;
}

/// A refused or reset connection is the client's business; anything else
/// (out of file descriptors, most likely) gets a pause, as hyper and axum do,
/// so connections in progress can finish and free some.
async fn accept_failed(err: io::Error) {
    if matches!(
        err.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    ) {
        return;
    }
    tracing::error!(error = %err, "cannot accept connections; retrying in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

async fn connection(
    stream: TcpStream,
    router: Router,
    timeouts: ClientTimeouts,
    tls: Option<TlsAcceptor>,
    metrics: Arc<Metrics>,
    mut stopping: watch::Receiver<bool>,
    _open: watch::Receiver<()>,
) {
    let _ = stream.set_nodelay(true);
    let (phase, watching) = watch::channel(Phase::Idle {
        until: Instant::now() + timeouts.idle,
    });
    let tracker = Arc::new(Tracker { phase, timeouts });
    let io = TrackedIo {
        inner: stream,
        tracker: tracker.clone(),
    };
    let mut outstayed = pin!(outstayed(watching));
    let Some(acceptor) = tls else {
        if let Some(reason) = serve_http(io, router, tracker, None, outstayed, stopping).await {
            metrics.connection_closed(reason);
        }
        return;
    };
    // The handshake's first bytes start the header-read deadline, so a
    // client that never finishes it is closed like a slow request.
    let accepted = tokio::select! {
        accepted = acceptor.accept(io) => accepted,
        reason = &mut outstayed => {
            tracing::debug!(reason, "closing a connection in its TLS handshake");
            metrics.connection_closed(reason);
            return;
        }
        // No request is in flight yet, so shutting down need not wait for it.
        _ = stopping.wait_for(|stop| *stop) => return,
    };
    let stream = match accepted {
        Ok(stream) => stream,
        Err(err) => {
            // Plain HTTP to this port ends here too: rustls answers it with
            // an alert, never with HTTP.
            tracing::debug!(error = %err, "TLS handshake failed");
            metrics.connection_closed("tls_handshake");
            return;
        }
    };
    let session = TlsSession {
        client_certificate: stream
            .get_ref()
            .1
            .peer_certificates()
            .is_some_and(|chain| !chain.is_empty()),
    };
    tracker.response_done();
    let served = serve_http(stream, router, tracker, Some(session), outstayed, stopping);
    if let Some(reason) = served.await {
        metrics.connection_closed(reason);
    }
}

/// A request came over TLS; `client_certificate`: its client presented a
/// certificate the listener's client CA signed (the handshake checked it).
#[derive(Clone, Copy, Debug)]
pub struct TlsSession {
    pub client_certificate: bool,
}

/// Serves HTTP/1 on `io` until the client or the server is done with it;
/// answers why the connection was closed, when it outstayed a deadline.
async fn serve_http<I>(
    io: I,
    router: Router,
    tracker: Arc<Tracker>,
    session: Option<TlsSession>,
    mut outstayed: Pin<&mut impl Future<Output = &'static str>>,
    mut stopping: watch::Receiver<bool>,
) -> Option<&'static str>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        tracker.request_started();
        let done = ResponseDone(tracker.clone());
        let mut request = Request::from(request.map(Body::new));
        if let Some(session) = session {
            request.extensions_mut().insert(session);
        }
        let response = router.clone().oneshot(request);
        async move {
            let response = response.await?;
            Ok::<_, Infallible>(response.map(|body| HeldBody::new(body, done)))
        }
    });
    let mut conn = pin!(
        http1::Builder::new()
            // The tracker below does this, and bounds idle keep-alive too.
            .header_read_timeout(None)
            .serve_connection(TokioIo::new(io), service)
    );
    let mut draining = false;
    loop {
        tokio::select! {
            served = conn.as_mut() => {
                if let Err(err) = served {
                    tracing::debug!(error = %err, "connection ended with an error");
                }
                return None;
            }
            reason = &mut outstayed => {
                tracing::debug!(reason, "closing a connection");
                return Some(reason);
            }
            _ = stopping.wait_for(|stop| *stop), if !draining => {
                conn.as_mut().graceful_shutdown();
                draining = true;
            }
        }
    }
}

/// Where a connection is, and until when it may stay there.
#[derive(Clone, Copy, Debug)]
enum Phase {
    /// No request in progress: a fresh connection, or one kept alive after a response.
    Idle { until: Instant },
    /// A request's first bytes have arrived; the rest of its head must follow.
    Head { until: Instant },
    /// A request is being handled; reading its body has a deadline of its
    /// own (see `extract.rs`), the rest is bounded by the query timeout and
    /// the lock's wait_seconds.
    Busy,
}

struct Tracker {
    phase: watch::Sender<Phase>,
    timeouts: ClientTimeouts,
}

impl Tracker {
    fn bytes_arrived(&self) {
        self.phase.send_if_modified(|phase| match phase {
            Phase::Idle { .. } => {
                *phase = Phase::Head {
                    until: Instant::now() + self.timeouts.header_read,
                };
                true
            }
            Phase::Head { .. } | Phase::Busy => false,
        });
    }

    fn request_started(&self) {
        self.phase.send_replace(Phase::Busy);
    }

    fn response_done(&self) {
        self.phase.send_replace(Phase::Idle {
            until: Instant::now() + self.timeouts.idle,
        });
    }
}

/// Resolves once the connection has stayed in a phase past its deadline,
/// with the reason (a metrics label).
async fn outstayed(mut phase: watch::Receiver<Phase>) -> &'static str {
    loop {
        let deadline = match *phase.borrow_and_update() {
            Phase::Idle { until } => Some((until, "idle_timeout")),
            Phase::Head { until } => Some((until, "header_timeout")),
            Phase::Busy => None,
        };
        let changed = match deadline {
            Some((until, reason)) => tokio::select! {
                () = tokio::time::sleep_until(until) => return reason,
                changed = phase.changed() => changed,
            },
            None => phase.changed().await,
        };
        if changed.is_err() {
            // The connection is gone; its own future ends the task.
            std::future::pending::<()>().await;
        }
    }
}

/// The socket, telling the tracker when bytes arrive.
struct TrackedIo {
    inner: TcpStream,
    tracker: Arc<Tracker>,
}

impl AsyncRead for TrackedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.tracker.bytes_arrived();
        }
        polled
    }
}

impl AsyncWrite for TrackedIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Marks the connection idle when hyper drops the response body, which it
/// does once it has sent it (or the connection is gone).
struct ResponseDone(Arc<Tracker>);

impl Drop for ResponseDone {
    fn drop(&mut self) {
        self.0.response_done();
    }
}
