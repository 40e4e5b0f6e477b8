//! The gateway's own TLS: HTTPS, client certificates (mTLS), certificate
//! rotation on SIGHUP, and peers forwarding to each other over HTTPS. The
//! certificates are throwaway ones that `scripts/make-certs` makes per test.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use reqwest::StatusCode;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde_json::{Value, json};
use statehouse::config::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use crate::balancer::Balancer;
use crate::checker::{self, Work};
use crate::helpers::{
    Api, GatewayProcess, TestApp, clickhouse_url, metric, spawn_configured, spawn_gateway_process,
    spawn_https_peer_process, test_config, unique_schema,
};

/// A directory of certificates from `scripts/make-certs`, removed at the end.
pub struct Certs {
    dir: PathBuf,
}

impl Certs {
    pub fn make() -> Self {
        let dir = std::env::temp_dir().join(format!("statehouse-certs-{}", uuid::Uuid::new_v4()));
        let certs = Self { dir };
        certs.issue();
        certs
    }

    /// Issues every certificate afresh (new serials) under the same CAs.
    pub fn issue(&self) {
        let made =
            std::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/make-certs"))
                .arg(&self.dir)
                .status()
                .expect("scripts/make-certs runs (it needs openssl)");
        assert!(made.success());
    }

    pub fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }

    fn read(&self, file: &str) -> Vec<u8> {
        std::fs::read(self.dir.join(file)).unwrap()
    }

    /// The flags that serve HTTPS with the gateway certificate `name`.
    pub fn serve_flags(&self, name: &str) -> Vec<String> {
        vec![
            "--tls-cert-file".into(),
            self.path(&format!("{name}.pem")),
            "--tls-key-file".into(),
            self.path(&format!("{name}.key")),
        ]
    }

    /// A client that trusts the CA `ca` and presents the certificate `identity`.
    pub fn client(&self, ca: &str, identity: Option<&str>) -> reqwest::ClientBuilder {
        let root = reqwest::Certificate::from_pem(&self.read(&format!("{ca}.pem"))).unwrap();
        let builder = reqwest::Client::builder()
            .add_root_certificate(root)
            .tls_built_in_root_certs(false);
        match identity {
            Some(name) => {
                let mut pem = self.read(&format!("{name}.pem"));
                pem.extend(self.read(&format!("{name}.key")));
                builder.identity(reqwest::Identity::from_pem(&pem).unwrap())
            }
            None => builder,
        }
    }

    fn api(&self, base: &str, identity: Option<&str>) -> Api {
        Api {
            base: base.to_owned(),
            client: self.client("ca", identity).build().unwrap(),
        }
    }

    /// The certificate in `file`, as a server would present it.
    fn certificate(&self, file: &str) -> CertificateDer<'static> {
        CertificateDer::from_pem_slice(&self.read(file)).unwrap()
    }

    /// A raw TLS connection trusting the test CA, to see which certificate
    /// the gateway presents and to keep one connection open.
    async fn connect(&self, addr: &str) -> TlsStream<TcpStream> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.certificate("ca.pem")).unwrap();
        let config = rustls::ClientConfig::builder_with_provider(
            rustls::crypto::ring::default_provider().into(),
        )
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let tcp = TcpStream::connect(addr).await.unwrap();
        TlsConnector::from(Arc::new(config))
            .connect("localhost".try_into().unwrap(), tcp)
            .await
            .expect("the TLS handshake succeeds")
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn presented(stream: &TlsStream<TcpStream>) -> CertificateDer<'static> {
    stream.get_ref().1.peer_certificates().unwrap()[0].clone()
}

/// One keep-alive GET on an open connection; answers the status code.
async fn get_on(stream: &mut TlsStream<TcpStream>, path: &str) -> u16 {
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut received = Vec::new();
    let mut buf = [0; 4096];
    let head_end = loop {
        if let Some(at) = received.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let n = stream.read(&mut buf).await.unwrap();
        assert!(n > 0, "the connection closed before the answer");
        received.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&received[..head_end]).to_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .expect("a content-length")
        .trim()
        .parse()
        .unwrap();
    while received.len() < head_end + length {
        let n = stream.read(&mut buf).await.unwrap();
        assert!(n > 0, "the connection closed in the body");
        received.extend_from_slice(&buf[..n]);
    }
    head.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn tls_config(certs: &Certs, extra: &[&str]) -> Config {
    let url = clickhouse_url();
    let schema = unique_schema();
    let mut args = vec![
        "--clickhouse-url",
        &url,
        "--listen",
        "127.0.0.1:0",
        "--schema",
        &schema,
        "--header-read-timeout",
        "2s",
    ];
    let flags = certs.serve_flags("gateway");
    args.extend(flags.iter().map(String::as_str));
    args.extend_from_slice(extra);
    let mut config = Config::from_serve_args(&args).expect("valid TLS configuration");
    config.query_timeout = test_config(&schema).query_timeout;
    config
}

pub async fn spawn_tls(certs: &Certs, extra: &[&str]) -> TestApp {
    let mut app = spawn_configured(tls_config(certs, extra)).await;
    assert!(app.api.base.starts_with("https://"), "{}", app.api.base);
    app.api = certs.api(&app.api.base, None);
    app
}

/// Every cause of a client error, which reqwest's own text leaves out.
pub fn causes(err: &reqwest::Error) -> String {
    let mut text = err.to_string();
    let mut cause = std::error::Error::source(err);
    while let Some(inner) = cause {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        cause = inner.source();
    }
    text
}

#[tokio::test]
async fn https_answers_a_client_that_trusts_the_ca_and_one_that_does_not_is_refused() {
    let certs = Certs::make();
    let app = spawn_tls(&certs, &[]).await;
    let put = app
        .put_state("over-https", &json!({"completed": {"secure": true}}))
        .await;
    put.expect(StatusCode::CREATED);
    assert_eq!(
        app.get_state("over-https").await.json()["completed"]["secure"],
        true
    );
    app.get("/readyz").await.expect(StatusCode::OK);

    let untrusting = reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .build()
        .unwrap();
    let refused = untrusting
        .get(format!("{}/healthz", app.base))
        .send()
        .await
        .expect_err("a client that does not trust the CA gets no answer");
    assert!(
        causes(&refused).contains("UnknownIssuer"),
        "{}",
        causes(&refused)
    );
    let other_ca = certs.client("other-ca", None).build().unwrap();
    assert!(
        other_ca
            .get(format!("{}/healthz", app.base))
            .send()
            .await
            .is_err()
    );
}

#[tokio::test]
async fn plain_http_to_the_tls_port_gets_no_http_answer_and_the_gateway_keeps_serving() {
    let certs = Certs::make();
    let app = spawn_tls(&certs, &[]).await;
    let addr = app.base.trim_start_matches("https://").to_owned();
    for _ in 0..3 {
        let mut plain = TcpStream::connect(&addr).await.unwrap();
        plain
            .write_all(b"GET /v1/states HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), plain.read_to_end(&mut answer))
            .await
            .expect("the gateway closes the connection")
            .expect("closed cleanly, not reset");
        assert!(
            !answer.starts_with(b"HTTP/"),
            "answered as HTTP: {:?}",
            String::from_utf8_lossy(&answer)
        );
    }
    let plain_client = reqwest::Client::new();
    let http_url = format!("http://{addr}/healthz");
    assert!(plain_client.get(&http_url).send().await.is_err());
    app.get("/readyz").await.expect(StatusCode::OK);
    let metrics = app.get("/metrics").await.text;
    assert!(
        metric(
            &metrics,
            r#"statehouse_connections_closed_total{reason="tls_handshake"}"#
        )
        .is_some_and(|n| n >= 4.0),
        "{metrics}"
    );
}

#[tokio::test]
async fn with_client_certificates_required_only_a_client_with_a_good_one_is_served() {
    let certs = Certs::make();
    let ca = certs.path("ca.pem");
    let app = spawn_tls(&certs, &["--tls-client-ca-file", &ca]).await;

    let anonymous = certs.api(&app.base, None);
    let refused = anonymous.get("/v1/states").await;
    refused.expect(StatusCode::FORBIDDEN);
    assert_eq!(refused.problem_type(), "forbidden");
    assert!(
        refused.text.contains("client certificate"),
        "{}",
        refused.text
    );
    anonymous
        .get("/metrics")
        .await
        .expect(StatusCode::FORBIDDEN);
    let put = anonymous
        .put_state("mtls", &json!({"completed": {"by": "anonymous"}}))
        .await;
    put.expect(StatusCode::FORBIDDEN);
    // Orchestrators probe without one.
    anonymous.get("/healthz").await.expect(StatusCode::OK);
    anonymous.get("/readyz").await.expect(StatusCode::OK);

    let worker = certs.api(&app.base, Some("client"));
    let put = worker
        .put_state("mtls", &json!({"completed": {"by": "worker"}}))
        .await;
    put.expect(StatusCode::CREATED);
    assert_eq!(
        worker.get_state("mtls").await.json()["completed"]["by"],
        "worker"
    );

    let stranger = certs
        .client("ca", Some("other-gateway"))
        .build()
        .unwrap()
        .get(format!("{}/healthz", app.base))
        .send()
        .await;
    assert!(
        stranger.is_err(),
        "a certificate from another CA fails the handshake"
    );
    worker.get("/readyz").await.expect(StatusCode::OK);
}

#[tokio::test]
async fn sighup_serves_a_replaced_certificate_to_new_connections_and_open_ones_carry_on() {
    let certs = Certs::make();
    let flags = certs.serve_flags("gateway");
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let gateway = spawn_gateway_process(
        &clickhouse_url(),
        &[&["--schema", &unique_schema()], &flags[..]].concat(),
    )
    .await;
    let addr = gateway.base.trim_start_matches("http://").to_owned();
    let old = certs.certificate("gateway.pem");
    let mut open = certs.connect(&addr).await;
    assert_eq!(presented(&open), old);
    assert_eq!(get_on(&mut open, "/healthz").await, 200);

    certs.issue();
    let new = certs.certificate("gateway.pem");
    assert_ne!(new, old, "a new certificate, with a new serial");
    hang_up(&gateway);
    let mut fresh = certs.connect(&addr).await;
    while presented(&fresh) != new {
        assert_eq!(presented(&fresh), old);
        tokio::time::sleep(Duration::from_millis(50)).await;
        fresh = certs.connect(&addr).await;
    }
    assert_eq!(get_on(&mut fresh, "/healthz").await, 200);
    // The connection from before is still served, on its old session.
    assert_eq!(get_on(&mut open, "/healthz").await, 200);
    assert_eq!(get_on(&mut open, "/readyz").await, 200);
    assert_eq!(presented(&open), old);

    let logs = gateway.kill_and_collect_logs().await;
    assert!(
        logs.iter()
            .any(|l| String::from_utf8_lossy(l).contains("TLS certificate reloaded")),
        "the reload is logged"
    );
}

fn hang_up(gateway: &GatewayProcess) {
    let pid = gateway.child.id().expect("the gateway runs").to_string();
    let sent = std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap();
    assert!(sent.success());
}

#[tokio::test]
async fn a_replacement_that_does_not_load_leaves_the_certificate_in_use() {
    let certs = Certs::make();
    let config = tls_config(&certs, &[]);
    let identity = config.tls.as_ref().unwrap().identity.clone();
    let app = spawn_configured(config).await;
    let addr = app.base.trim_start_matches("https://").to_owned();
    let old = certs.certificate("gateway.pem");
    std::fs::write(certs.path("gateway.pem"), "not a certificate").unwrap();
    identity.reload();
    assert_eq!(presented(&certs.connect(&addr).await), old);
    // A certificate with another certificate's key does not load either.
    certs.issue();
    std::fs::copy(certs.path("client.key"), certs.path("gateway.key")).unwrap();
    identity.reload();
    let mut still = certs.connect(&addr).await;
    assert_eq!(presented(&still), old);
    assert_eq!(get_on(&mut still, "/healthz").await, 200);
}

fn peer_flags(certs: &Certs, name: &str, schema: &str) -> Vec<String> {
    let mut flags = certs.serve_flags(name);
    flags.extend(
        [
            "--tls-client-ca-file",
            &certs.path("ca.pem"),
            "--peer-ca-file",
            &certs.path("ca.pem"),
            "--schema",
            schema,
            "--claim-settle",
            "200ms",
        ]
        .map(str::to_owned),
    );
    flags
}

async fn spawn_https_peer(certs: &Certs, name: &str, schema: &str) -> GatewayProcess {
    let flags = peer_flags(certs, name, schema);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    spawn_https_peer_process(&clickhouse_url(), &flags).await
}

fn log_lines(logs: &[Vec<u8>]) -> Vec<Value> {
    logs.iter()
        .filter_map(|l| serde_json::from_slice(l).ok())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_https_gateways_requiring_client_certificates_pass_the_lock_checker() {
    let certs = Certs::make();
    let schema = unique_schema();
    let mut gateways = Vec::new();
    for _ in 0..3 {
        gateways.push(spawn_https_peer(&certs, "gateway", &schema).await);
    }
    let balancer = Balancer::start_with(
        gateways.iter().map(|g| g.base.clone()).collect(),
        certs.client("ca", Some("client")),
    )
    .await;
    let api = Api::new(balancer.base.clone());
    checker::run(|_| api.clone(), "https-balanced", 9, 6, Work::Counter).await;

    // The authority's log shows the requests other gateways forwarded to it
    // arriving over HTTPS (the only thing its port speaks).
    let mut forwarded_over_https = 0;
    for gateway in gateways {
        for line in log_lines(&gateway.kill_and_collect_logs().await) {
            let span = &line["span"];
            if span["forwarded_by"].as_str().is_some_and(|by| by != "-") {
                assert_eq!(span["scheme"], "https", "{line}");
                forwarded_over_https += 1;
            }
        }
    }
    assert!(forwarded_over_https > 0, "some requests were forwarded");
}

#[tokio::test]
async fn a_peer_whose_certificate_is_from_another_ca_is_not_forwarded_to() {
    let certs = Certs::make();
    let schema = unique_schema();
    let stranger = spawn_https_peer(&certs, "other-gateway", &schema).await;
    let stranger_base = stranger.base.clone();
    let gateway = spawn_https_peer(&certs, "gateway", &schema).await;
    // The stranger trusts clients of the test CA, so the client reaches it
    // with a client certificate; its own certificate is what peers refuse.
    let to_stranger = Api {
        base: stranger.base.clone(),
        client: certs.client("other-ca", Some("client")).build().unwrap(),
    };
    let (lease, _) = to_stranger.lease("stranger-held", "w", 30, 5.0).await;
    assert!(!lease.is_empty());

    let through_gateway = certs.api(&gateway.base, Some("client"));
    let reply = through_gateway.get("/v1/locks/stranger-held").await;
    reply.expect(StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(reply.problem_type(), "authority-unreachable");

    let stranger_logs = log_lines(&stranger.kill_and_collect_logs().await);
    assert!(
        !stranger_logs.iter().any(|l| l["span"]["forwarded_by"]
            .as_str()
            .is_some_and(|by| by != "-")),
        "nothing reached the stranger from the gateway"
    );
    let logs = log_lines(&gateway.kill_and_collect_logs().await);
    assert!(
        logs.iter().any(|l| {
            let text = l.to_string();
            text.contains("UnknownIssuer") && text.contains(&stranger_base)
        }),
        "the log says why: {logs:?}"
    );
}

#[tokio::test]
async fn the_images_health_check_probes_a_tls_gateway_with_its_ca() {
    let certs = Certs::make();
    let ca = certs.path("ca.pem");
    let app = spawn_tls(&certs, &["--tls-client-ca-file", &ca]).await;
    let listen = app.base.trim_start_matches("https://").to_owned();
    let healthcheck = |extra: Vec<String>| {
        let listen = listen.clone();
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(env!("CARGO_BIN_EXE_statehouse"))
                .args(["healthcheck", "--listen", &listen])
                .args(extra)
                .output()
                .unwrap()
        })
    };
    let healthy = healthcheck(vec!["--ca-file".into(), ca.clone()])
        .await
        .unwrap();
    assert!(
        healthy.status.success(),
        "{}",
        String::from_utf8_lossy(&healthy.stderr)
    );
    let with_certificate = healthcheck(vec![
        "--ca-file".into(),
        ca.clone(),
        "--client-cert-file".into(),
        certs.path("client.pem"),
        "--client-key-file".into(),
        certs.path("client.key"),
    ])
    .await
    .unwrap();
    assert!(with_certificate.status.success());

    let plain = healthcheck(vec![]).await.unwrap();
    assert_eq!(plain.status.code(), Some(1));
    let untrusted = healthcheck(vec!["--ca-file".into(), certs.path("other-ca.pem")])
        .await
        .unwrap();
    assert_eq!(untrusted.status.code(), Some(1));
    let why = String::from_utf8_lossy(&untrusted.stderr);
    assert!(why.contains("UnknownIssuer"), "{why}");
}

#[tokio::test]
async fn a_client_that_stalls_in_the_handshake_is_closed_at_the_header_read_timeout() {
    let certs = Certs::make();
    let app = spawn_tls(&certs, &[]).await;
    let addr = app.base.trim_start_matches("https://").to_owned();
    let mut stalled = TcpStream::connect(&addr).await.unwrap();
    // The header of a ClientHello record, and nothing of the record itself.
    stalled
        .write_all(&[0x16, 0x03, 0x01, 0x00, 0xc8])
        .await
        .unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), stalled.read_to_end(&mut rest))
        .await
        .expect("the gateway closes the stalled connection")
        .expect("closed cleanly");
    assert!(rest.is_empty(), "no answer: {rest:?}");
    let metrics = app.get("/metrics").await.text;
    assert_eq!(
        metric(
            &metrics,
            r#"statehouse_connections_closed_total{reason="header_timeout"}"#
        ),
        Some(1.0),
        "{metrics}"
    );
}
