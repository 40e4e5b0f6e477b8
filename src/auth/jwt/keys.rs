//! An issuer's key set (its JWKS): fetched at start without holding the
//! start up, refreshed on a timer, fetched again for a `kid` it lacks at
//! most once per gap, and kept through failed fetches. A set over 64 KiB
//! is refused: no issuer publishes one, and the gateway never holds an
//! unbounded answer.

use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use jsonwebtoken::DecodingKey;
use jsonwebtoken::jwk::{AlgorithmParameters, Jwk};

use super::issuers::{Issuer, KeySource};
use crate::telemetry::ClientText;

/// The largest key set taken.
pub const MAX_KEY_SET_BYTES: usize = 64 * 1024;

/// How often the keys are fetched.
#[derive(Clone, Copy, Debug)]
pub struct KeyTiming {
    /// A good set is fetched again after this long (5 min).
    pub refresh: Duration,
    /// At most one fetch per this long per issuer, whatever asks for it
    /// (30 s): tokens with made-up `kid`s cannot make the gateway hammer
    /// the issuer.
    pub min_gap: Duration,
    /// One fetch's limit.
    pub timeout: Duration,
}

impl Default for KeyTiming {
    fn default() -> Self {
        Self {
            refresh: Duration::from_secs(300),
            min_gap: Duration::from_secs(30),
            timeout: Duration::from_secs(10),
        }
    }
}

/// The usable keys of a set: RSA and EC signing keys. HMAC (`oct`) keys and
/// encryption keys are left out, so that no token can be checked against one.
#[derive(Clone)]
pub struct KeySet {
    keys: Vec<(Option<String>, DecodingKey)>,
}

impl std::fmt::Debug for KeySet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KeySet({} keys)", self.keys.len())
    }
}

impl KeySet {
    pub fn parse(body: &[u8]) -> Result<Self, String> {
        if body.len() > MAX_KEY_SET_BYTES {
            return Err(format!("the key set is over {MAX_KEY_SET_BYTES} bytes"));
        }
        #[derive(serde::Deserialize)]
        struct Raw {
            keys: Vec<serde_json::Value>,
        }
        let raw: Raw = serde_json::from_slice(body).map_err(|e| format!("not a JWK set: {e}"))?;
        // A key of a kind this crate does not know is skipped, not fatal: the
        // rest of the set still serves.
        let keys: Vec<_> = raw
            .keys
            .into_iter()
            .filter_map(|value| serde_json::from_value::<Jwk>(value).ok())
            .filter(|jwk| {
                matches!(
                    jwk.algorithm,
                    AlgorithmParameters::RSA(_) | AlgorithmParameters::EllipticCurve(_)
                ) && !matches!(
                    jwk.common.public_key_use,
                    Some(jsonwebtoken::jwk::PublicKeyUse::Encryption)
                )
            })
            .filter_map(|jwk| {
                let key = DecodingKey::from_jwk(&jwk).ok()?;
                Some((jwk.common.key_id, key))
            })
            .collect();
        if keys.is_empty() {
            return Err("the key set has no RSA or EC signing key".to_owned());
        }
        Ok(Self { keys })
    }

    /// The key of `kid`; a token without one may use the set's only key.
    fn key(&self, kid: Option<&str>) -> Option<&DecodingKey> {
        match kid {
            Some(kid) => self
                .keys
                .iter()
                .find(|(id, _)| id.as_deref() == Some(kid))
                .map(|(_, key)| key),
            None if self.keys.len() == 1 => Some(&self.keys[0].1),
            None => None,
        }
    }
}

/// At most one fetch per `min_gap`.
#[derive(Clone, Copy, Debug)]
pub struct FetchGate {
    min_gap: Duration,
    last: Option<Instant>,
}

impl FetchGate {
    pub fn new(min_gap: Duration) -> Self {
        Self {
            min_gap,
            last: None,
        }
    }

    /// Takes the turn to fetch at `now`, or says how long until the next one.
    pub fn try_start(&mut self, now: Instant) -> Result<(), Duration> {
        match self.last {
            Some(last) if now.duration_since(last) < self.min_gap => {
                Err(self.min_gap - now.duration_since(last))
            }
            _ => {
                self.last = Some(now);
                Ok(())
            }
        }
    }

    /// How long until the next fetch may start.
    pub fn wait(&self, now: Instant) -> Duration {
        self.last.map_or(Duration::ZERO, |last| {
            self.min_gap.saturating_sub(now.duration_since(last))
        })
    }
}

/// What the keys say of a token's `kid`.
pub enum Lookup {
    Found(DecodingKey),
    /// The issuer has never answered: come back after this long.
    NeverFetched(Duration),
    Unknown,
}

struct KeyState {
    set: Option<Arc<KeySet>>,
    gate: FetchGate,
}

/// One issuer's keys, shared by every request and its refresher.
pub struct IssuerKeys {
    issuer: String,
    source: KeySource,
    /// For a `jwks_url`: reqwest on the project's rustls, with the issuer's CA.
    client: Option<reqwest::Client>,
    timing: KeyTiming,
    state: Mutex<KeyState>,
    /// One fetch at a time; a request waiting here finds the new set.
    fetching: tokio::sync::Mutex<()>,
}

impl IssuerKeys {
    pub fn new(issuer: &Issuer, timing: KeyTiming) -> Result<Arc<Self>, String> {
        let client = match &issuer.keys {
            KeySource::File(_) => None,
            KeySource::Url(_) => {
                let tls = crate::client::TlsFiles {
                    ca_file: issuer.ca_file.clone(),
                    ..Default::default()
                };
                Some(
                    crate::client::builder(&tls)?
                        .timeout(timing.timeout)
                        .redirect(reqwest::redirect::Policy::none())
                        .build()
                        .map_err(|e| format!("cannot set up the key set client: {e}"))?,
                )
            }
        };
        Ok(Arc::new(Self {
            issuer: issuer.issuer.clone(),
            source: issuer.keys.clone(),
            client,
            timing,
            state: Mutex::new(KeyState {
                set: None,
                gate: FetchGate::new(timing.min_gap),
            }),
            fetching: tokio::sync::Mutex::new(()),
        }))
    }

    /// Whether these keys serve `issuer` as it is configured now.
    pub fn serves(&self, issuer: &Issuer) -> bool {
        self.issuer == issuer.issuer && self.source == issuer.keys
    }

    fn state(&self) -> std::sync::MutexGuard<'_, KeyState> {
        // The lock guards plain assignments, which cannot panic half-way.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The key of `kid` in the set as it is, without fetching.
    pub fn lookup(&self, kid: Option<&str>) -> Lookup {
        let state = self.state();
        match &state.set {
            None => {
                Lookup::NeverFetched(state.gate.wait(Instant::now()).max(Duration::from_secs(1)))
            }
            Some(set) => set.key(kid).cloned().map_or(Lookup::Unknown, Lookup::Found),
        }
    }

    /// The key of `kid`, fetching the set again first if it lacks it and a
    /// fetch is allowed now.
    pub async fn lookup_fetching(&self, kid: Option<&str>) -> Lookup {
        match self.lookup(kid) {
            Lookup::Found(key) => Lookup::Found(key),
            Lookup::NeverFetched(_) | Lookup::Unknown => {
                self.fetch_if_allowed().await;
                self.lookup(kid)
            }
        }
    }

    /// Fetches the set unless one was fetched within the gap.
    async fn fetch_if_allowed(&self) {
        let _one = self.fetching.lock().await;
        if self.state().gate.try_start(Instant::now()).is_err() {
            return;
        }
        match self.fetch().await {
            Ok(set) => {
                let first = self.state().set.replace(Arc::new(set)).is_none();
                if first {
                    tracing::info!(issuer = %ClientText(&self.issuer), "workload identity: key set fetched");
                }
            }
            Err(error) => {
                let kept = self.state().set.is_some();
                tracing::warn!(
                    issuer = %ClientText(&self.issuer),
                    error = %ClientText(&error),
                    kept_last_good = kept,
                    "workload identity: key set fetch failed"
                );
            }
        }
    }

    async fn fetch(&self) -> Result<KeySet, String> {
        let body = match (&self.source, &self.client) {
            (KeySource::Url(url), Some(client)) => {
                let response = client
                    .get(url.clone())
                    .send()
                    .await
                    .map_err(|e| crate::client::error_chain(&e))?;
                if !response.status().is_success() {
                    return Err(format!("{url} answered {}", response.status()));
                }
                crate::client::read_body(response, MAX_KEY_SET_BYTES).await?
            }
            (KeySource::File(path), _) => {
                let path = path.clone();
                tokio::task::spawn_blocking(move || read_capped(&path))
                    .await
                    .map_err(|e| e.to_string())??
            }
            (KeySource::Url(_), None) => unreachable!("a jwks_url always has its client"),
        };
        KeySet::parse(&body)
    }

    /// Keeps the set fresh for as long as the keys are in use: a fetch now,
    /// then one per refresh, or per gap while the issuer has never answered.
    pub fn keep_fresh(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let keys: Weak<Self> = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(strong) = keys.upgrade() else {
                    return;
                };
                strong.fetch_if_allowed().await;
                let wait = if strong.state().set.is_some() {
                    strong.timing.refresh
                } else {
                    strong.timing.min_gap
                };
                drop(strong);
                tokio::time::sleep(wait).await;
            }
        })
    }
}

fn read_capped(path: &std::path::Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let file = std::fs::File::open(path)
        .map_err(|e| format!("cannot read the key set file {}: {e}", path.display()))?;
    let mut body = Vec::new();
    file.take(MAX_KEY_SET_BYTES as u64 + 1)
        .read_to_end(&mut body)
        .map_err(|e| format!("cannot read the key set file {}: {e}", path.display()))?;
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_fetch_per_gap() {
        let start = Instant::now();
        let mut gate = FetchGate::new(Duration::from_secs(30));
        assert_eq!(gate.wait(start), Duration::ZERO);
        assert!(gate.try_start(start).is_ok());
        let mut fetches = 1;
        // 100 asks over a minute, as many unknown kids would make.
        for second in 0..60u64 {
            for _ in 0..2 {
                if gate.try_start(start + Duration::from_secs(second)).is_ok() {
                    fetches += 1;
                }
            }
        }
        assert_eq!(fetches, 2, "at 0 s and 30 s");
        assert_eq!(
            gate.try_start(start + Duration::from_secs(45)),
            Err(Duration::from_secs(15))
        );
    }

    #[test]
    fn hmac_and_encryption_keys_are_left_out() {
        let only_bad = br#"{"keys":[{"kty":"oct","k":"c2VjcmV0","kid":"h"},
            {"kty":"RSA","use":"enc","kid":"e","n":"sXch","e":"AQAB"},
            {"kty":"OKP","crv":"X25519","x":"abc"}]}"#;
        assert!(
            KeySet::parse(only_bad)
                .unwrap_err()
                .contains("no RSA or EC")
        );
        let good = br#"{"keys":[{"kty":"oct","k":"c2VjcmV0","kid":"h"},
            {"kty":"RSA","kid":"r","n":"sXch","e":"AQAB"},{"kty":"weird"}]}"#;
        let set = KeySet::parse(good).unwrap();
        assert!(set.key(Some("r")).is_some());
        assert!(set.key(Some("h")).is_none());
        assert!(set.key(None).is_some(), "the only key");
    }

    #[test]
    fn a_set_over_64_kib_is_refused() {
        let big = format!(r#"{{"keys":[],"pad":"{}"}}"#, "x".repeat(MAX_KEY_SET_BYTES));
        assert!(KeySet::parse(big.as_bytes()).unwrap_err().contains("over"));
        assert!(KeySet::parse(b"[]").unwrap_err().contains("not a JWK set"));
    }
}
