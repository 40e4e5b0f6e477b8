//! Which ClickHouse failures no retry can fix. ClickHouse's exception code
//! decides, not the HTTP status: versions and proxies disagree on statuses,
//! the codes are ClickHouse's contract.

use std::error::Error;

use super::error::{StoreError, causes};

/// Why ClickHouse cannot be used as configured, however long one waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blocker {
    /// Unknown user or wrong password.
    Credentials,
    /// The user may not create the databases or tables.
    Permission,
    /// The server's TLS certificate is not one the gateway trusts.
    UntrustedCertificate,
    /// The endpoint does not speak ClickHouse's HTTP interface (nor TLS, when asked to).
    NotClickHouse,
    /// KeeperMap is off: the server has no `keeper_map_path_prefix`.
    NoKeeperMapPrefix,
    /// The server has no `<zookeeper>` (or `<keeper>`) section to reach Keeper through.
    NoKeeper,
}

const UNKNOWN_USER: u32 = 192;
const WRONG_PASSWORD: u32 = 193;
const REQUIRED_PASSWORD: u32 = 194;
const AUTHENTICATION_FAILED: u32 = 516;
const READONLY: u32 = 164;
const ACCESS_DENIED: u32 = 497;
const BAD_ARGUMENTS: u32 = 36;
const NO_ELEMENTS_IN_CONFIG: u32 = 139;
const NO_ZOOKEEPER: u32 = 225;

impl StoreError {
    /// ClickHouse's exception code, from the `X-ClickHouse-Exception-Code`
    /// header or the `Code: N.` that opens its error text.
    pub fn exception_code(&self) -> Option<u32> {
        let Self::ClickHouse(clickhouse::error::Error::BadResponse(text)) = self else {
            return None;
        };
        let digits = text.trim_start().strip_prefix("Code:")?.trim_start();
        let end = digits
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(digits.len());
        digits[..end].parse().ok()
    }

    /// Whether ClickHouse's error text holds `words`.
    fn names(&self, words: &str) -> bool {
        matches!(self, Self::ClickHouse(clickhouse::error::Error::BadResponse(text)) if text.contains(words))
    }

    /// What makes this failure permanent, if anything: `None` for what may
    /// pass (refused connections, timeouts, a 5xx, any other exception).
    pub fn blocker(&self) -> Option<Blocker> {
        match self {
            Self::Timeout(_)
            | Self::Corrupt { .. }
            | Self::Abandoned
            | Self::Stale
            | Self::MembershipLapsed => None,
            Self::InBatch(err) => err.blocker(),
            Self::Unrecognized { status, .. } => {
                // A proxy answers 5xx for a ClickHouse that is not up yet.
                (!(500..600).contains(status)).then_some(Blocker::NotClickHouse)
            }
            Self::ClickHouse(err) => match self.exception_code() {
                Some(UNKNOWN_USER | WRONG_PASSWORD | REQUIRED_PASSWORD | AUTHENTICATION_FAILED) => {
                    Some(Blocker::Credentials)
                }
                Some(ACCESS_DENIED | READONLY) => Some(Blocker::Permission),
                Some(BAD_ARGUMENTS) if self.names("keeper_map_path_prefix") => {
                    Some(Blocker::NoKeeperMapPrefix)
                }
                Some(NO_ZOOKEEPER) => Some(Blocker::NoKeeper),
                Some(NO_ELEMENTS_IN_CONFIG) if self.names("Zookeeper configuration") => {
                    Some(Blocker::NoKeeper)
                }
                Some(_) => None,
                None => causes(err).find_map(transport_blocker),
            },
        }
    }
}

fn transport_blocker(cause: &(dyn Error + 'static)) -> Option<Blocker> {
    if let Some(tls) = cause.downcast_ref::<rustls::Error>() {
        return match tls {
            rustls::Error::InvalidCertificate(_) => Some(Blocker::UntrustedCertificate),
            // What a plain HTTP server sends back to a TLS hello.
            rustls::Error::InvalidMessage(_) => Some(Blocker::NotClickHouse),
            _ => None,
        };
    }
    let http = cause.downcast_ref::<hyper::Error>()?;
    http.is_parse().then_some(Blocker::NotClickHouse)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clickhouse_said(text: &str) -> StoreError {
        StoreError::ClickHouse(clickhouse::error::Error::BadResponse(text.to_owned()))
    }

    #[test]
    fn the_exception_code_decides_not_the_status() {
        for (text, code, blocker) in [
            (
                "Code: 516. DB::Exception: default: Authentication failed: password is incorrect, or there is no user with such name. (AUTHENTICATION_FAILED)",
                Some(516),
                Some(Blocker::Credentials),
            ),
            ("Code: 192", Some(192), Some(Blocker::Credentials)),
            (
                "Code: 497. DB::Exception: reader: Not enough privileges. (ACCESS_DENIED)",
                Some(497),
                Some(Blocker::Permission),
            ),
            (
                "Code: 164. DB::Exception: readonly",
                Some(164),
                Some(Blocker::Permission),
            ),
            (
                "Code: 81. DB::Exception: Database x does not exist. (UNKNOWN_DATABASE)",
                Some(81),
                None,
            ),
            (
                "Code: 241. DB::Exception: Memory limit exceeded",
                Some(241),
                None,
            ),
            (
                "Code: 36. DB::Exception: KeeperMap is disabled because 'keeper_map_path_prefix' config is not defined. (BAD_ARGUMENTS)",
                Some(36),
                Some(Blocker::NoKeeperMapPrefix),
            ),
            (
                "Code: 36. DB::Exception: Bad arguments of something else. (BAD_ARGUMENTS)",
                Some(36),
                None,
            ),
            (
                "Code: 139. DB::Exception: There is no Zookeeper configuration in server config. (NO_ELEMENTS_IN_CONFIG)",
                Some(139),
                Some(Blocker::NoKeeper),
            ),
            (
                "Code: 225. DB::Exception: Cannot use ZooKeeper without a ZooKeeper section. (NO_ZOOKEEPER)",
                Some(225),
                Some(Blocker::NoKeeper),
            ),
            (
                "Code: 999. DB::Exception: All connection tries failed while connecting to ZooKeeper. (KEEPER_EXCEPTION)",
                Some(999),
                None,
            ),
            ("503 Service Unavailable", None, None),
        ] {
            let err = clickhouse_said(text);
            assert_eq!(err.exception_code(), code, "{text}");
            assert_eq!(err.blocker(), blocker, "{text}");
        }
    }

    #[test]
    fn an_answer_without_a_code_is_a_stranger_unless_it_is_a_5xx() {
        let answer = |status| StoreError::Unrecognized {
            status,
            excerpt: "<html>".to_owned(),
        };
        assert_eq!(answer(404).blocker(), Some(Blocker::NotClickHouse));
        assert_eq!(answer(200).blocker(), Some(Blocker::NotClickHouse));
        assert_eq!(answer(502).blocker(), None);
        assert_eq!(answer(503).blocker(), None);
        assert_eq!(
            StoreError::Timeout(std::time::Duration::from_secs(5)).blocker(),
            None
        );
    }

    #[test]
    fn tls_errors_are_found_inside_io_errors() {
        let wrapped = std::io::Error::other(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        ));
        let err = StoreError::ClickHouse(clickhouse::error::Error::Network(Box::new(wrapped)));
        assert_eq!(err.blocker(), Some(Blocker::UntrustedCertificate));
        assert!(err.to_string().contains("UnknownIssuer"), "{err}");
    }
}
