//! Workload identity: JSON Web Tokens that a platform issues to its
//! workloads (Kubernetes service account tokens, GitHub Actions and GitLab
//! CI ID tokens), verified against their issuer's published keys and mapped
//! by bindings to a role, a scope and a name. See "Workload identity" in
//! docs/operations.md.
//!
//! `issuers` reads the file, `keys` keeps each issuer's key set, `verify`
//! checks a token, `binding` grants it what its claims earn.

pub mod binding;
pub mod issuers;
pub mod keys;
pub mod verify;

use std::path::PathBuf;
use std::sync::{Arc, PoisonError, RwLock};

use tokio::sync::broadcast::{self, error::RecvError};
use tokio::task::JoinHandle;

use self::issuers::Issuer;
use self::keys::{IssuerKeys, KeyTiming, Lookup};
pub use self::verify::{Refusal, looks_like_jwt};
use crate::auth::Grant;

/// The issuers in use with their keys, replaced whole by a reload.
struct Configured {
    issuers: Vec<(Arc<Issuer>, Arc<IssuerKeys>)>,
    /// Each key set's refresher; ended when its keys leave the configuration.
    refreshers: Vec<JoinHandle<()>>,
}

impl Drop for Configured {
    fn drop(&mut self) {
        for refresher in &self.refreshers {
            refresher.abort();
        }
    }
}

/// The gateway's issuers (`--jwt-issuers`).
pub struct JwtAuth {
    path: PathBuf,
    timing: KeyTiming,
    current: RwLock<Arc<Configured>>,
}

impl std::fmt::Debug for JwtAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JwtAuth({})", self.path.display())
    }
}

impl JwtAuth {
    /// Reads the issuers file; their key sets are fetched once [`Self::start`] runs.
    pub fn load(path: PathBuf, timing: KeyTiming) -> Result<Self, String> {
        let issuers = issuers::load(&path)?;
        let configured = configure(issuers, &[], timing, false)?;
        Ok(Self {
            path,
            timing,
            current: RwLock::new(Arc::new(configured)),
        })
    }

    /// How many issuers are configured.
    pub fn len(&self) -> usize {
        self.current().issuers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn current(&self) -> Arc<Configured> {
        // The lock guards a pointer swap, which cannot panic half-way.
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Starts fetching the key sets (in the background: the gateway does not
    /// wait for an issuer), and reloads the file on every SIGHUP.
    pub fn start(self: &Arc<Self>, hangups: broadcast::Receiver<()>) -> JoinHandle<()> {
        let old = self.current();
        match configure(
            old.issuers
                .iter()
                .map(|(issuer, _)| (**issuer).clone())
                .collect(),
            &old.issuers,
            self.timing,
            true,
        ) {
            Ok(started) => self.replace(started),
            Err(error) => tracing::error!(%error, "workload identity: cannot start the key sets"),
        }
        tokio::spawn(reload_on_hangup(self.clone(), hangups))
    }

    fn replace(&self, configured: Configured) {
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(configured);
    }

    /// Reads the issuers file again; a file that does not parse keeps the
    /// issuers in use. Key sets of issuers that stay are kept.
    pub fn reload(&self) -> Result<usize, String> {
        let issuers = issuers::load(&self.path)?;
        let old = self.current();
        let configured = configure(issuers, &old.issuers, self.timing, true)?;
        let count = configured.issuers.len();
        self.replace(configured);
        Ok(count)
    }

    /// The grant of a JWT, fetching its issuer's keys when it names a `kid`
    /// they lack (at most once per gap).
    pub async fn identify(&self, token: &str) -> Result<Grant, Refusal> {
        let (issuer, keys, header) = self.issuer_of(token)?;
        let key = match keys.lookup_fetching(header.kid.as_deref()).await {
            Lookup::Found(key) => key,
            Lookup::NeverFetched(wait) => return Err(Refusal::KeysUnavailable(wait)),
            Lookup::Unknown => return Err(unknown_kid()),
        };
        verify::verify(token, header.alg, &issuer, &key)
    }

    /// The grant of a JWT with the keys at hand, fetching nothing: for a
    /// stream that checks its token again on every turn.
    pub fn identify_cached(&self, token: &str) -> Result<Grant, Refusal> {
        let (issuer, keys, header) = self.issuer_of(token)?;
        match keys.lookup(header.kid.as_deref()) {
            Lookup::Found(key) => verify::verify(token, header.alg, &issuer, &key),
            Lookup::NeverFetched(wait) => Err(Refusal::KeysUnavailable(wait)),
            Lookup::Unknown => Err(unknown_kid()),
        }
    }

    fn issuer_of(&self, token: &str) -> Result<Picked, Refusal> {
        let (header, iss) = verify::unverified(token)?;
        let current = self.current();
        let (issuer, keys) = current
            .issuers
            .iter()
            .find(|(issuer, _)| issuer.issuer == iss)
            .cloned()
            .ok_or(Refusal::UnknownIssuer)?;
        verify::check_algorithm(&issuer, &header)?;
        Ok((issuer, keys, header))
    }
}

/// A token's issuer, that issuer's keys, and the token's header.
type Picked = (Arc<Issuer>, Arc<IssuerKeys>, jsonwebtoken::Header);

fn unknown_kid() -> Refusal {
    Refusal::Invalid("the token's kid is not in its issuer's key set".to_owned())
}

/// The issuers with their keys: those of `old` that serve an issuer as it
/// is kept, new ones for the rest (refreshed from now on when `run`).
fn configure(
    issuers: Vec<Issuer>,
    old: &[(Arc<Issuer>, Arc<IssuerKeys>)],
    timing: KeyTiming,
    run: bool,
) -> Result<Configured, String> {
    let mut configured = Configured {
        issuers: Vec::with_capacity(issuers.len()),
        refreshers: Vec::new(),
    };
    for issuer in issuers {
        let keys = match old.iter().find(|(_, keys)| keys.serves(&issuer)) {
            Some((_, keys)) => keys.clone(),
            None => IssuerKeys::new(&issuer, timing)
                .map_err(|why| format!("issuer {:?}: {why}", issuer.issuer))?,
        };
        if run {
            configured.refreshers.push(keys.keep_fresh());
        }
        configured.issuers.push((Arc::new(issuer), keys));
    }
    Ok(configured)
}

async fn reload_on_hangup(auth: Arc<JwtAuth>, mut hangups: broadcast::Receiver<()>) {
    loop {
        match hangups.recv().await {
            Ok(()) | Err(RecvError::Lagged(_)) => match auth.reload() {
                Ok(issuers) => tracing::info!(issuers, "workload identity: issuers reloaded"),
                // The error names the file, the issuer and what is wrong.
                Err(error) => tracing::warn!(
                    %error,
                    "workload identity: issuers not reloaded; keeping the ones in use"
                ),
            },
            Err(RecvError::Closed) => return,
        }
    }
}
