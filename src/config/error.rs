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
        "{0}; set --tls-cert-file and --tls-key-file (STATEHOUSE_TLS_CERT_FILE, STATEHOUSE_TLS_KEY_FILE) to a PEM chain and its key"
    )]
    Tls(#[from] TlsError),
}
