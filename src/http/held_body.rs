//! A response body that holds something until the body ends or is dropped:
//! a stream's watcher place, or the server's count of responses under way.
//! The body itself is passed through untouched.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use http_body::{Frame, SizeHint};

pub(super) struct HeldBody<H> {
    /// The handler's body.
    body: Body,
    /// Given back (dropped) with the body.
    _held: H,
}

impl<H> HeldBody<H> {
    pub(super) fn new(body: Body, held: H) -> Self {
        Self { body, _held: held }
    }
}

impl<H: Unpin> http_body::Body for HeldBody<H> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
