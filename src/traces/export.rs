//! How spans leave the process: a bounded queue drained by a thread of its
//! own, which sends them over OTLP/HTTP with the project's reqwest.
//!
//! The SDK's batch processor exports from a thread without a Tokio runtime,
//! where an async HTTP client panics and every later span is lost; and the
//! exporter's own clients bring a second reqwest and TLS stack. Here the
//! export thread runs its own one-thread runtime, so the project's reqwest
//! (rustls, ring) works there, and it outlives the gateway's runtime long
//! enough to flush at shutdown. A request only ever `try_send`s into the
//! queue: a dead or slow collector fills it, and what does not fit is
//! counted as dropped, never waited for.

use std::sync::LazyLock;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use opentelemetry::Context;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};
use prometheus_client::metrics::counter::Counter;

/// Spans that never reached the collector: the queue was full, or their
/// export failed. One for the process, as the exporter is.
pub(super) static DROPPED: LazyLock<Counter> = LazyLock::new(Counter::default);

/// Spans waiting for the export thread; more are dropped, not waited for.
const QUEUE_SPANS: usize = 2048;
/// Spans sent in one export request.
const BATCH_SPANS: usize = 512;

/// The reqwest client the OTLP exporter sends with. Its timeout bounds an
/// export, so a collector that never answers holds the thread no longer.
#[derive(Debug)]
pub(super) struct Reqwest(pub reqwest::Client);

#[async_trait]
impl HttpClient for Reqwest {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let request = reqwest::Request::try_from(request)?;
        let answer = self.0.execute(request).await?;
        let mut response = Response::builder().status(answer.status());
        if let Some(headers) = response.headers_mut() {
            headers.extend(answer.headers().clone());
        }
        Ok(response.body(answer.bytes().await?)?)
    }
}

enum Message {
    Span(Box<SpanData>),
    /// Sends what is queued now, then answers.
    Flush(mpsc::Sender<()>),
}

/// The span processor: ends each sampled span into the queue. The export
/// thread ends with the queue's sender, after sending what is left.
#[derive(Debug)]
pub(super) struct Queue {
    sender: SyncSender<Message>,
}

impl Queue {
    /// Starts the export thread around `exporter`, whose resource is set;
    /// a span waits at most `every` for its batch to fill.
    pub(super) fn start<E: SpanExporter + 'static>(
        exporter: E,
        every: Duration,
    ) -> std::io::Result<Self> {
        let (sender, receiver) = mpsc::sync_channel(QUEUE_SPANS);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        std::thread::Builder::new()
            .name("statehouse-traces".into())
            .spawn(move || drain(&runtime, &exporter, &receiver, every))?;
        Ok(Self { sender })
    }

    /// Sends what is queued, waiting for it at most `within`.
    fn flush(&self, within: Duration) -> OTelSdkResult {
        let (done, sent) = mpsc::channel();
        // The queue may be full: the flush waits for room as long as it may.
        let deadline = Instant::now() + within;
        let mut message = Message::Flush(done);
        loop {
            match self.sender.try_send(message) {
                Ok(()) => break,
                Err(TrySendError::Full(back)) if Instant::now() < deadline => {
                    message = back;
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(_) => return Err(OTelSdkError::Timeout(within)),
            }
        }
        sent.recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .map_err(|_| OTelSdkError::Timeout(within))
    }
}

impl SpanProcessor for Queue {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        if self.sender.try_send(Message::Span(Box::new(span))).is_err() {
            DROPPED.inc();
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.flush(Duration::from_secs(5))
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.flush(timeout)
    }
}

/// The export thread: batches of spans, sent when full, when the oldest has
/// waited `every`, or when a flush asks.
fn drain<E: SpanExporter>(
    runtime: &tokio::runtime::Runtime,
    exporter: &E,
    receiver: &Receiver<Message>,
    every: Duration,
) {
    let mut batch: Vec<SpanData> = Vec::with_capacity(BATCH_SPANS);
    let mut due = Instant::now() + every;
    loop {
        let wait = due.saturating_duration_since(Instant::now());
        match receiver.recv_timeout(wait) {
            Ok(Message::Span(span)) => {
                if batch.is_empty() {
                    due = Instant::now() + every;
                }
                batch.push(*span);
                if batch.len() >= BATCH_SPANS {
                    send(runtime, exporter, &mut batch);
                }
            }
            Ok(Message::Flush(done)) => {
                send(runtime, exporter, &mut batch);
                let _ = done.send(());
            }
            Err(RecvTimeoutError::Timeout) => {
                send(runtime, exporter, &mut batch);
                due = Instant::now() + every;
            }
            Err(RecvTimeoutError::Disconnected) => {
                send(runtime, exporter, &mut batch);
                return;
            }
        }
    }
}

fn send<E: SpanExporter>(
    runtime: &tokio::runtime::Runtime,
    exporter: &E,
    batch: &mut Vec<SpanData>,
) {
    if batch.is_empty() {
        return;
    }
    let spans = std::mem::replace(batch, Vec::with_capacity(BATCH_SPANS));
    let count = spans.len() as u64;
    if runtime.block_on(exporter.export(spans)).is_err() {
        DROPPED.inc_by(count);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{Tracer, TracerProvider};
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};

    #[test]
    fn a_flush_sends_what_is_queued() {
        let exporter = InMemorySpanExporter::default();
        let queue = Queue::start(exporter.clone(), Duration::from_secs(60)).unwrap();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(queue)
            .build();
        provider.tracer("test").in_span("one", |_| {});
        provider.force_flush().unwrap();
        let spans = exporter.get_finished_spans().unwrap();
        assert_eq!(spans.len(), 1);
        assert_eq!(spans[0].name, "one");
    }

    /// An exporter that never finishes (a collector that does not answer),
    /// until the test lets it go.
    #[derive(Debug)]
    struct Stuck(std::sync::Mutex<mpsc::Receiver<()>>);

    impl SpanExporter for Stuck {
        async fn export(&self, _batch: Vec<SpanData>) -> OTelSdkResult {
            let _ = self.0.lock().unwrap().recv_timeout(Duration::from_secs(30));
            Ok(())
        }
    }

    #[test]
    fn a_full_queue_drops_and_counts_spans_instead_of_waiting() {
        let (release, stuck) = mpsc::channel();
        let queue =
            Queue::start(Stuck(std::sync::Mutex::new(stuck)), Duration::from_secs(60)).unwrap();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(queue)
            .build();
        let tracer = provider.tracer("test");
        let before = DROPPED.get();
        let ended = 3000;
        for _ in 0..ended {
            tracer.in_span("s", |_| {});
        }
        // At most a batch in the export that hangs and a full queue behind it.
        let kept = QUEUE_SPANS + BATCH_SPANS;
        assert!(DROPPED.get() - before >= (ended - kept) as u64);
        drop(release);
    }
}
