//! A TCP proxy between the gateway and ClickHouse that a test can cut or slow
//! down: the ClickHouse outage and stall, on loopback, without touching the engine.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use statehouse::config::Config;

use crate::helpers::{TestApp, spawn_app_with};

/// A gateway in this process whose ClickHouse traffic goes through a proxy.
pub async fn spawn_app_behind_proxy(adjust: impl FnOnce(&mut Config)) -> (TestApp, Proxy) {
    let proxy = Proxy::to_clickhouse().await;
    let app = spawn_app_with(|config| {
        proxy.route(config);
        adjust(config);
    })
    .await;
    (app, proxy)
}

pub struct Proxy {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
}

struct Shared {
    upstream: SocketAddr,
    down: AtomicBool,
    /// Connections are taken and kept, and nothing goes through either way:
    /// a peer behind it is frozen or cut off, as far as anyone can tell.
    black_hole: AtomicBool,
    /// A request whose first chunk, percent-decoded, contains this is cut
    /// before ClickHouse sees it: one kind of query fails, the rest pass.
    refuse: std::sync::Mutex<Option<String>>,
    /// A request that contains this reaches ClickHouse, and its connection
    /// is cut before the answer: it ran, but the gateway cannot know.
    lose_answer: std::sync::Mutex<Option<String>>,
    delay_ms: AtomicU64,
    /// A chunk that contains every one of these texts (decoded) waits this
    /// long before it goes on: one kind of query is slow, the rest are not.
    hold: std::sync::Mutex<Option<Hold>>,
    /// When ClickHouse's answer to each held request reached the proxy: the
    /// moment its outcome was known (the request itself may be answered to
    /// its client later, through another gateway).
    held_answers: std::sync::Mutex<Vec<std::time::Instant>>,
    /// Bumped to drop every open connection.
    cut: watch::Sender<u64>,
    /// While a test asks (Some), the head and start of each request sent
    /// on to ClickHouse, decoded: what headers its statements carried.
    heads: std::sync::Mutex<Option<Vec<String>>>,
}

impl Proxy {
    /// A proxy in front of the test ClickHouse.
    pub async fn to_clickhouse() -> Self {
        let target = crate::helpers::clickhouse_target();
        let upstream = tokio::net::lookup_host((target.host.as_str(), target.port))
            .await
            .unwrap()
            .next()
            .unwrap();
        Self::start(upstream).await
    }

    /// Points a gateway's configuration at this proxy.
    pub fn route(&self, config: &mut statehouse::config::Config) {
        config.clickhouse.host = self.addr.ip().to_string();
        config.clickhouse.port = self.addr.port();
    }

    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            upstream,
            down: AtomicBool::new(false),
            black_hole: AtomicBool::new(false),
            refuse: std::sync::Mutex::new(None),
            lose_answer: std::sync::Mutex::new(None),
            delay_ms: AtomicU64::new(0),
            hold: std::sync::Mutex::new(None),
            held_answers: std::sync::Mutex::new(Vec::new()),
            cut: watch::channel(0).0,
            heads: std::sync::Mutex::new(None),
        });
        let accepting = shared.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if accepting.down.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                tokio::spawn(relay(client, accepting.clone()));
            }
        });
        Self { addr, shared }
    }

    /// Down: open connections are cut and new ones are closed at once.
    pub fn set_down(&self, down: bool) {
        self.shared.down.store(down, Ordering::SeqCst);
        if down {
            self.shared.cut.send_modify(|generation| *generation += 1);
        }
    }

    /// A black hole: every connection, open or new, is kept and answered
    /// nothing, and what is sent through it is dropped.
    pub fn set_black_hole(&self, on: bool) {
        self.shared.black_hole.store(on, Ordering::SeqCst);
    }

    /// Cuts every request that contains `text` (in its URL or body, decoded).
    pub fn refuse_requests_containing(&self, text: Option<&str>) {
        *self.shared.refuse.lock().unwrap() = text.map(str::to_owned);
    }

    /// Lets every request that contains `text` run, and loses its answer.
    pub fn lose_answers_to(&self, text: Option<&str>) {
        *self.shared.lose_answer.lock().unwrap() = text.map(str::to_owned);
    }

    /// Holds each request whose first chunk contains every one of `texts`
    /// for `delay` before ClickHouse sees it (the rest of the request waits
    /// behind it); `None` lets them through again.
    pub fn hold_requests_containing(&self, hold: Option<(&[&str], Duration)>) {
        self.set_hold(hold, false, false, false);
    }

    /// As [`Self::hold_requests_containing`], for the first such request
    /// only: the ones after it go through, however soon they follow.
    pub fn hold_one_request_containing(&self, texts: &[&str], delay: Duration) {
        self.set_hold(Some((texts, delay)), false, true, false);
    }

    /// Lets the first request that contains every one of `texts` through
    /// at once and holds ClickHouse's answer to it for `delay`: it ran when
    /// sent, and the gateway learns so only after `delay`.
    pub fn hold_the_answer_to_one_request_containing(&self, texts: &[&str], delay: Duration) {
        self.set_hold(Some((texts, delay)), false, true, true);
    }

    /// As [`Self::hold_requests_containing`], but the request's head goes on
    /// at once and only its body is held: ClickHouse has started the query
    /// (it is in `system.processes`) and waits for its rows, as it would
    /// for a slow INSERT.
    pub fn hold_bodies_of_requests_containing(&self, hold: Option<(&[&str], Duration)>) {
        self.set_hold(hold, true, false, false);
    }

    fn set_hold(
        &self,
        hold: Option<(&[&str], Duration)>,
        body_only: bool,
        once: bool,
        answer: bool,
    ) {
        *self.shared.hold.lock().unwrap() = hold.map(|(texts, delay)| Hold {
            texts: texts.iter().map(|t| (*t).to_owned()).collect(),
            delay,
            body_only,
            once,
            answer,
        });
    }

    /// When ClickHouse answered each held request so far, in order.
    pub fn held_answers(&self) -> Vec<std::time::Instant> {
        self.shared.held_answers.lock().unwrap().clone()
    }

    /// Records the head (and what follows it in its chunk) of every request
    /// from now on, decoded.
    pub fn record_heads(&self) {
        *self.shared.heads.lock().unwrap() = Some(Vec::new());
    }

    /// The requests recorded since [`Self::record_heads`].
    pub fn heads(&self) -> Vec<String> {
        self.shared
            .heads
            .lock()
            .unwrap()
            .clone()
            .unwrap_or_default()
    }

    /// Every chunk sent towards ClickHouse waits this long first.
    pub fn set_delay(&self, delay: Duration) {
        self.shared
            .delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }
}

#[derive(Clone)]
struct Hold {
    texts: Vec<String>,
    delay: Duration,
    body_only: bool,
    /// Cleared by the first request it holds.
    once: bool,
    /// The answer waits, not the request.
    answer: bool,
}

async fn relay(client: TcpStream, shared: Arc<Shared>) {
    let Ok(server) = TcpStream::connect(shared.upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let mut cut = shared.cut.subscribe();
    let losing = AtomicBool::new(false);
    let holding = AtomicBool::new(false);
    let answer_delay_ms = AtomicU64::new(0);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let to_server = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = client_read.read(&mut buf).await.unwrap_or(0);
            if n == 0 {
                return;
            }
            if shared.black_hole.load(Ordering::SeqCst) {
                continue;
            }
            let (refuse, lose, hold) = (
                shared.refuse.lock().unwrap().clone(),
                shared.lose_answer.lock().unwrap().clone(),
                shared.hold.lock().unwrap().clone(),
            );
            let mut held = None;
            if let Some(heads) = shared.heads.lock().unwrap().as_mut()
                && buf[..n].windows(4).any(|w| w == b"\r\n\r\n")
            {
                let plain = String::from_utf8_lossy(&buf[..n]).replace('+', " ");
                let decoded = percent_encoding::percent_decode_str(&plain).decode_utf8_lossy();
                heads.push(decoded.into_owned());
            }
            // Decoded only while a test looks for something: the other tests
            // (and their slow-ClickHouse timings) pay nothing for it.
            if refuse.is_some() || lose.is_some() || hold.is_some() {
                let plain = String::from_utf8_lossy(&buf[..n]).replace('+', " ");
                let decoded = percent_encoding::percent_decode_str(&plain).decode_utf8_lossy();
                let found = |needle: &Option<String>| {
                    needle
                        .as_ref()
                        .is_some_and(|text| decoded.contains(text.as_str()))
                };
                if found(&refuse) {
                    return;
                }
                if found(&lose) {
                    losing.store(true, Ordering::SeqCst);
                }
                if let Some(hold) = hold
                    && hold
                        .texts
                        .iter()
                        .all(|text| decoded.contains(text.as_str()))
                {
                    if hold.once {
                        shared.hold.lock().unwrap().take();
                    }
                    held = Some(hold);
                }
            }
            let mut start = 0;
            if let Some(hold) = held {
                holding.store(true, Ordering::SeqCst);
                if hold.answer {
                    answer_delay_ms.store(hold.delay.as_millis() as u64, Ordering::SeqCst);
                } else if hold.body_only {
                    // The head, through its blank line, goes on now.
                    start = buf[..n]
                        .windows(4)
                        .position(|w| w == b"\r\n\r\n")
                        .map_or(0, |at| at + 4);
                    if server_write.write_all(&buf[..start]).await.is_err() {
                        return;
                    }
                }
                if !hold.answer {
                    tokio::time::sleep(hold.delay).await;
                }
            }
            let delay = shared.delay_ms.load(Ordering::SeqCst);
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            if server_write.write_all(&buf[start..n]).await.is_err() {
                return;
            }
        }
    };
    let to_client = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = server_read.read(&mut buf).await.unwrap_or(0);
            // ClickHouse has answered, so it ran the request; the answer is lost.
            if n == 0 || losing.load(Ordering::SeqCst) {
                return;
            }
            if shared.black_hole.load(Ordering::SeqCst) {
                continue;
            }
            if holding.swap(false, Ordering::SeqCst) {
                let now = std::time::Instant::now();
                shared.held_answers.lock().unwrap().push(now);
            }
            let answer_delay = answer_delay_ms.swap(0, Ordering::SeqCst);
            if answer_delay > 0 {
                tokio::time::sleep(Duration::from_millis(answer_delay)).await;
            }
            if client_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        () = to_server => {},
        () = to_client => {},
        _ = cut.changed() => {},
    }
}
