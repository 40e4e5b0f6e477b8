//! Where the store's ClickHouse is, and the names it splices into SQL.

use rustls::pki_types::CertificateDer;

/// Where and how to reach ClickHouse, resolved from the URI and its overrides.
#[derive(Clone, PartialEq, Eq)]
pub struct ClickHouseTarget {
    pub secure: bool,
    pub host: String,
    pub port: u16,
    pub database: String,
    pub user: String,
    pub password: String,
    /// Extra trusted roots for TLS, beyond the system's.
    pub extra_roots: Vec<CertificateDer<'static>>,
}

impl std::fmt::Debug for ClickHouseTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClickHouseTarget")
            .field("endpoint", &self.endpoint())
            .field("database", &self.database)
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}

impl ClickHouseTarget {
    /// The HTTP(S) endpoint, without credentials: safe to log.
    pub fn endpoint(&self) -> String {
        let scheme = if self.secure { "https" } else { "http" };
        format!("{scheme}://{}:{}", self.host, self.port)
    }
}

/// A ClickHouse identifier the service splices into DDL and queries; only
/// plain names are accepted so no quoting rules can be got wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identifier(String);

/// A name that is not a plain identifier.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a plain identifier")]
pub struct InvalidIdentifier(pub String);

impl Identifier {
    pub fn parse(raw: &str) -> Result<Self, InvalidIdentifier> {
        let mut chars = raw.chars();
        let valid = raw.len() <= 128
            && chars
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if valid {
            Ok(Self(raw.to_owned()))
        } else {
            Err(InvalidIdentifier(raw.to_owned()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}
