//! An issuer for the workload identity tests: signing keys made here with
//! openssl, tokens signed with them, and a key set (JWKS) served on a port
//! of its own that counts its fetches and can be down or replaced.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};

/// A fresh directory under the system's temporary one.
pub fn scratch_dir(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("statehouse-{what}-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn openssl(args: &[&str]) -> Vec<u8> {
    let out = std::process::Command::new("openssl")
        .args(args)
        .output()
        .expect("openssl runs");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// A signing key with its `kid`, and its public half as a JWK.
#[derive(Clone)]
pub struct Key {
    pub kid: String,
    pub alg: Algorithm,
    /// The private key, PKCS#8 PEM.
    pem: Vec<u8>,
    /// The public key, PEM (an HMAC secret for the forgery test).
    pub public_pem: Vec<u8>,
    pub jwk: Value,
}

impl Key {
    pub fn rsa(dir: &Path, kid: &str) -> Self {
        let path = dir.join(format!("{kid}.pem"));
        let path = path.to_str().unwrap();
        openssl(&[
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
            path,
        ]);
        let modulus =
            String::from_utf8(openssl(&["rsa", "-in", path, "-noout", "-modulus"])).unwrap();
        let hex = modulus.trim().trim_start_matches("Modulus=");
        let n: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        Self {
            kid: kid.to_owned(),
            alg: Algorithm::RS256,
            pem: std::fs::read(path).unwrap(),
            public_pem: openssl(&["pkey", "-in", path, "-pubout"]),
            jwk: json!({"kty": "RSA", "kid": kid, "use": "sig", "alg": "RS256",
                        "n": URL_SAFE_NO_PAD.encode(n), "e": "AQAB"}),
        }
    }

    pub fn ec(dir: &Path, kid: &str) -> Self {
        let path = dir.join(format!("{kid}.pem"));
        let path = path.to_str().unwrap();
        openssl(&[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
            path,
        ]);
        // The DER public key ends with the uncompressed point: x then y.
        let der = openssl(&["pkey", "-in", path, "-pubout", "-outform", "DER"]);
        let point = &der[der.len() - 64..];
        Self {
            kid: kid.to_owned(),
            alg: Algorithm::ES256,
            pem: std::fs::read(path).unwrap(),
            public_pem: openssl(&["pkey", "-in", path, "-pubout"]),
            jwk: json!({"kty": "EC", "kid": kid, "crv": "P-256", "alg": "ES256",
                        "x": URL_SAFE_NO_PAD.encode(&point[..32]),
                        "y": URL_SAFE_NO_PAD.encode(&point[32..])}),
        }
    }

    /// `claims` signed with this key, under `kid` in the header.
    pub fn sign_as(&self, kid: &str, claims: &Value) -> String {
        let mut header = Header::new(self.alg);
        header.kid = Some(kid.to_owned());
        let key = match self.alg {
            Algorithm::RS256 => EncodingKey::from_rsa_pem(&self.pem),
            _ => EncodingKey::from_ec_pem(&self.pem),
        }
        .unwrap();
        jsonwebtoken::encode(&header, claims, &key).unwrap()
    }

    pub fn sign(&self, claims: &Value) -> String {
        self.sign_as(&self.kid, claims)
    }
}

pub fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// A key set of `keys`, as an issuer publishes it.
pub fn key_set(keys: &[&Key]) -> String {
    json!({"keys": keys.iter().map(|k| k.jwk.clone()).collect::<Vec<_>>()}).to_string()
}

struct Served {
    body: Mutex<String>,
    up: AtomicBool,
    fetches: AtomicUsize,
}

/// The issuer's key set endpoint.
pub struct JwksServer {
    pub url: String,
    served: Arc<Served>,
}

impl JwksServer {
    pub async fn start(body: String) -> Self {
        let served = Arc::new(Served {
            body: Mutex::new(body),
            up: AtomicBool::new(true),
            fetches: AtomicUsize::new(0),
        });
        let app = axum::Router::new()
            .route("/jwks", axum::routing::get(answer))
            .with_state(served.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/jwks", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self { url, served }
    }

    pub fn serve(&self, body: String) {
        *self.served.body.lock().unwrap() = body;
    }

    /// Down: every fetch gets a 503.
    pub fn set_up(&self, up: bool) {
        self.served.up.store(up, Ordering::SeqCst);
    }

    pub fn fetches(&self) -> usize {
        self.served.fetches.load(Ordering::SeqCst)
    }
}

async fn answer(State(served): State<Arc<Served>>) -> Response {
    served.fetches.fetch_add(1, Ordering::SeqCst);
    if !served.up.load(Ordering::SeqCst) {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    let body = served.body.lock().unwrap().clone();
    ([("content-type", "application/json")], body).into_response()
}
