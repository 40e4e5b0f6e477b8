//! The two URLs the gateway is given: ClickHouse's and the one peers reach it at.

use percent_encoding::percent_decode_str;
use url::Url;

use super::error::ConfigError;
use crate::store::ClickHouseTarget;

/// An `http://` or `https://` base URL peers can reach; no path, query or credentials.
pub(super) fn parse_advertise_url(raw: &str) -> Result<String, ConfigError> {
    let bad = |why: &str| ConfigError::AdvertiseUrl(format!("{raw:?}: {why}"));
    let url = Url::parse(raw).map_err(|e| bad(&e.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(bad(
            "peers speak HTTP or HTTPS to each other: use http:// or https://",
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(bad("it needs a host"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(bad("it must not carry credentials"));
    }
    if url.path() != "/" || url.query().is_some() || url.fragment().is_some() {
        return Err(bad("it must be a base URL, without a path or query"));
    }
    Ok(url.as_str().trim_end_matches('/').to_owned())
}

pub(super) fn default_port(secure: bool) -> u16 {
    if secure { 8443 } else { 8123 }
}

/// Parses the seed plugin's URI form; http(s):// is taken too, for people who
/// paste ClickHouse's own HTTP address.
pub fn parse_clickhouse_url(raw: &str) -> Result<ClickHouseTarget, ConfigError> {
    let invalid = |why: &str| {
        ConfigError::InvalidUrl(format!(
            "{why} (expected clickhouse://user:password@host:8123/database)"
        ))
    };
    let url = Url::parse(raw).map_err(|e| invalid(&e.to_string()))?;
    let secure = match url.scheme() {
        "clickhouse" | "http" => false,
        "clickhouses" | "https" => true,
        other => return Err(invalid(&format!("unsupported scheme {other:?}"))),
    };
    let host = url
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| invalid("no host"))?
        .to_owned();
    let decode = |part: &str| {
        percent_decode_str(part)
            .decode_utf8()
            .map(|s| s.into_owned())
            .map_err(|_| invalid("user or password is not valid UTF-8 once percent-decoded"))
    };
    let user = match url.username() {
        "" => "default".to_owned(),
        u => decode(u)?,
    };
    let password = decode(url.password().unwrap_or(""))?;
    let database = match url.path().trim_start_matches('/') {
        "" => "default".to_owned(),
        db if db.contains('/') => return Err(invalid("the path must be a single database name")),
        db => decode(db)?,
    };
    Ok(ClickHouseTarget {
        secure,
        port: url.port().unwrap_or(default_port(secure)),
        host,
        database,
        user,
        password,
        extra_roots: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_seed_uri_form_with_percent_encoded_credentials() {
        let t = parse_clickhouse_url("clickhouse://us%3Aer:p%40ss%2Fw@ch.example:9000/analytics")
            .unwrap();
        assert_eq!(
            t,
            ClickHouseTarget {
                secure: false,
                host: "ch.example".into(),
                port: 9000,
                database: "analytics".into(),
                user: "us:er".into(),
                password: "p@ss/w".into(),
                extra_roots: Vec::new(),
            }
        );
    }

    #[test]
    fn defaults_port_user_and_database_and_knows_tls() {
        let t = parse_clickhouse_url("clickhouse://localhost").unwrap();
        assert_eq!(
            (t.port, t.user.as_str(), t.database.as_str()),
            (8123, "default", "default")
        );
        let t = parse_clickhouse_url("clickhouses://h/db").unwrap();
        assert!(t.secure);
        assert_eq!(t.endpoint(), "https://h:8443");
    }

    #[test]
    fn rejects_malformed_uris() {
        for raw in [
            "",
            "localhost:8123",
            "postgres://h/db",
            "clickhouse:///db",
            "clickhouse://h/a/b",
        ] {
            assert!(parse_clickhouse_url(raw).is_err(), "{raw}");
        }
    }

    #[test]
    fn advertise_urls_are_http_or_https_base_urls() {
        assert_eq!(
            parse_advertise_url("https://gw-a.internal:8080/").unwrap(),
            "https://gw-a.internal:8080"
        );
        assert_eq!(
            parse_advertise_url("http://10.0.0.5:8080").unwrap(),
            "http://10.0.0.5:8080"
        );
        for bad in ["ftp://h:1", "https://h:1/path", "https://u:p@h:1"] {
            assert!(parse_advertise_url(bad).is_err(), "{bad}");
        }
    }
}
