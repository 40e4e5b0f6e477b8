//! Why a configuration was refused; each says which setting to change.

use crate::auth::LoadError;
use crate::tls::TlsError;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "no ClickHouse URL: set --clickhouse-url or STATEHOUSE_CLICKHOUSE_URL (clickhouse://user:password@host:8123/database)"
    )]
    MissingUrl,
    #[error("invalid ClickHouse URL: {0}")]
    InvalidUrl(String),
    #[error("invalid --advertise-url / STATEHOUSE_ADVERTISE_URL {0}")]
    AdvertiseUrl(String),
    #[error(
        "invalid {what} {value:?}: use letters, digits and underscores, starting with a letter or underscore"
    )]
    Identifier { what: String, value: String },
    #[error(
        "invalid --cluster / STATEHOUSE_CLUSTER {0:?}: use the cluster's name as in system.clusters (letters, digits, _ - . and macros such as {{cluster}})"
    )]
    Cluster(String),
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
    #[error("--claim-ttl must be at least 300ms")]
    ClaimTtl,
    #[error("cannot use the CA file {path}: {reason}")]
    CaFile { path: String, reason: String },
    #[error(transparent)]
    Tokens(#[from] LoadError),
    #[error(
        "refusing to serve {0} without authentication, anyone who reaches it could read and write every state: give tokens with --tokens-file (STATEHOUSE_TOKENS_FILE), or pass --allow-unauthenticated (STATEHOUSE_ALLOW_UNAUTHENTICATED) to serve it as it is"
    )]
    Unauthenticated(std::net::SocketAddr),
    #[error(
        "{0}; set --tls-cert-file and --tls-key-file (STATEHOUSE_TLS_CERT_FILE, STATEHOUSE_TLS_KEY_FILE) to a PEM chain and its key"
    )]
    Tls(#[from] TlsError),
}

impl ConfigError {
    /// The status `serve` exits with: 2 for an open address without
    /// authentication, as the Deployment contract fixes it, so that a
    /// deployment can tell that refusal from a setting that is wrong (1).
    pub fn exit_status(&self) -> u8 {
        match self {
            Self::Unauthenticated(_) => 2,
            _ => 1,
        }
    }
}
