//! TLS of the gateway's own: the HTTPS listener (optionally checking client
//! certificates) and the client that speaks to peers. rustls with ring, TLS
//! 1.2 and 1.3 only; the certificate and key are read again on SIGHUP.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, RwLock};

use tokio::sync::broadcast::{self, error::RecvError};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{
    ClientConfig, RootCertStore, ServerConfig, SignatureScheme, SupportedProtocolVersion,
};

const VERSIONS: [&SupportedProtocolVersion; 2] = [&rustls::version::TLS13, &rustls::version::TLS12];

fn provider() -> Arc<CryptoProvider> {
    rustls::crypto::ring::default_provider().into()
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot use the certificate file {path}: {reason}")]
    Certificate { path: String, reason: String },
    #[error("cannot use the key file {path}: {reason}")]
    Key { path: String, reason: String },
    #[error("cannot use the client CA file {path}: {reason}")]
    ClientCa { path: String, reason: String },
}

/// The gateway's certificate chain and key, as last read from their files.
/// It answers TLS handshakes as a server and, to peers that ask for one, as
/// a client; a reload swaps it for connections made from then on.
#[derive(Debug)]
pub struct Identity {
    cert_file: PathBuf,
    key_file: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
}

impl Identity {
    pub fn load(cert_file: &Path, key_file: &Path) -> Result<Self, TlsError> {
        Ok(Self {
            cert_file: cert_file.to_owned(),
            key_file: key_file.to_owned(),
            current: RwLock::new(Arc::new(read_identity(cert_file, key_file)?)),
        })
    }

    /// Reads the files again; a pair that does not load leaves the one in use
    /// in place, and the log says why.
    pub fn reload(&self) {
        match read_identity(&self.cert_file, &self.key_file) {
            Ok(fresh) => {
                *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(fresh);
                tracing::info!(cert_file = %self.cert_file.display(), "TLS certificate reloaded");
            }
            Err(err) => tracing::error!(
                error = %err,
                "TLS certificate not reloaded; still serving the previous one"
            ),
        }
    }

    fn current(&self) -> Arc<CertifiedKey> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl ResolvesServerCert for Identity {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

impl rustls::client::ResolvesClientCert for Identity {
    fn resolve(&self, _: &[&[u8]], _: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

fn read_identity(cert_file: &Path, key_file: &Path) -> Result<CertifiedKey, TlsError> {
    let cert_error = |reason: String| TlsError::Certificate {
        path: cert_file.display().to_string(),
        reason,
    };
    let chain = read_certificates(cert_file).map_err(cert_error)?;
    let key = PrivateKeyDer::from_pem_file(key_file).map_err(|e| TlsError::Key {
        path: key_file.display().to_string(),
        reason: e.to_string(),
    })?;
    CertifiedKey::from_der(chain, key, &provider()).map_err(|e| TlsError::Key {
        path: key_file.display().to_string(),
        reason: format!(
            "{e} (is it the key of the certificate in {}?)",
            cert_file.display()
        ),
    })
}

/// Every certificate in a PEM file; none is an error.
pub fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| e.to_string())?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    if certs.is_empty() {
        return Err("no PEM certificate in it".into());
    }
    Ok(certs)
}

/// How the gateway serves HTTPS.
#[derive(Clone, Debug)]
pub struct ServerTls {
    pub identity: Arc<Identity>,
    pub config: Arc<ServerConfig>,
    /// Client certificates are checked during the handshake, but a
    /// connection without one is let in: the router refuses it everything
    /// except the health checks and the dashboard page (see `http::auth`).
    pub client_certificates_required: bool,
}

impl ServerTls {
    pub fn new(
        cert_file: &Path,
        key_file: &Path,
        client_ca_file: Option<&Path>,
    ) -> Result<Self, TlsError> {
        let identity = Arc::new(Identity::load(cert_file, key_file)?);
        let builder = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&VERSIONS)
            .expect("ring supports TLS 1.2 and 1.3");
        let builder = match client_ca_file {
            None => builder.with_no_client_auth(),
            Some(path) => {
                let fail = |reason: String| TlsError::ClientCa {
                    path: path.display().to_string(),
                    reason,
                };
                let mut roots = RootCertStore::empty();
                for cert in read_certificates(path).map_err(fail)? {
                    roots.add(cert).map_err(|e| fail(e.to_string()))?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(roots.into(), provider())
                        .allow_unauthenticated()
                        .build()
                        .map_err(|e| fail(e.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_cert_resolver(identity.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            identity,
            config: Arc::new(config),
            client_certificates_required: client_ca_file.is_some(),
        })
    }
}

/// The TLS client for `https://` peers, and for `statehouse lock` and
/// `statehouse healthcheck` (see `crate::client`): certificates must chain to
/// `roots` (the system's when none are given); `identity`, when there is
/// one, is presented to servers that ask for a client certificate.
pub fn peer_client_config(
    roots: Option<&[CertificateDer<'static>]>,
    identity: Option<Arc<Identity>>,
) -> Arc<ClientConfig> {
    match roots {
        Some(roots) => client_config(roots, identity),
        None => client_config(system_roots(), identity),
    }
}

/// The system's trusted roots, read once per process: parsing the bundle
/// costs milliseconds, and every ClickHouse client and peer client trusts
/// them. Unreadable certificates are skipped; the readable ones still count.
pub fn system_roots() -> &'static [CertificateDer<'static>] {
    static ROOTS: OnceLock<Vec<CertificateDer<'static>>> = OnceLock::new();
    ROOTS.get_or_init(|| rustls_native_certs::load_native_certs().certs)
}

/// A TLS client trusting `roots`, presenting `identity` to a server that asks.
fn client_config(
    roots: &[CertificateDer<'static>],
    identity: Option<Arc<Identity>>,
) -> Arc<ClientConfig> {
    let mut store = RootCertStore::empty();
    store.add_parsable_certificates(roots.iter().cloned());
    let builder = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&VERSIONS)
        .expect("ring supports TLS 1.2 and 1.3")
        .with_root_certificates(store);
    // No ALPN here: hyper-rustls sets it from the HTTP versions it enables.
    Arc::new(match identity {
        Some(identity) => builder.with_client_cert_resolver(identity),
        None => builder.with_no_client_auth(),
    })
}

/// Reloads the certificate and key on every SIGHUP `hangups` tells of, for
/// as long as the returned future runs.
pub async fn reload_on_hangup(identity: Arc<Identity>, mut hangups: broadcast::Receiver<()>) {
    loop {
        match hangups.recv().await {
            Ok(()) | Err(RecvError::Lagged(_)) => identity.reload(),
            Err(RecvError::Closed) => return,
        }
    }
}
