//! Where the gateway is and how the command-line clients reach it
//! (`statehouse lock`, `statehouse wait`): one set of flags and variables,
//! which falls back on Meltano's own state backend settings, resolved to a
//! base URL, a token and the TLS files.

use std::path::PathBuf;

use clap::Args;
use url::Url;

use super::TlsFiles;
use super::bearer::Bearer;

/// The flags that say where the gateway is and how to reach it.
#[derive(Debug, Clone, Args)]
pub struct ConnectionArgs {
    /// The gateway's base URL, http:// or https:// [default: Meltano's
    /// MELTANO_STATE_BACKEND_URI when it is statehouse://HOST:PORT (as
    /// http://) or statehouses://HOST:PORT (as https://), else
    /// http://127.0.0.1:8080]
    #[arg(long, env = "STATEHOUSE_URL", value_parser = GatewayUrl::parse)]
    pub url: Option<GatewayUrl>,

    /// Bearer token for the gateway, when it has tokens (`statehouse lock`
    /// needs a write token; for `statehouse wait` a read token is enough)
    /// [default: Meltano's MELTANO_STATE_BACKEND_STATEHOUSE_TOKEN, or
    /// MELTANO_STATE_BACKEND_STATEHOUSES_TOKEN when MELTANO_STATE_BACKEND_URI
    /// is statehouses://]
    #[arg(long, env = "STATEHOUSE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,

    /// A file holding the bearer token, which then stays out of `ps` and the
    /// environment (surrounding whitespace is ignored). Read again for every
    /// request, so that a token rotated in place (a projected service account
    /// token) keeps a long run going.
    #[arg(long, env = "STATEHOUSE_TOKEN_FILE", conflicts_with = "token")]
    pub token_file: Option<PathBuf>,

    /// Over https://, trust this PEM CA file for the gateway's certificate
    /// instead of the system's CAs.
    #[arg(long, env = "STATEHOUSE_CA_FILE")]
    pub ca_file: Option<PathBuf>,

    /// Over https://, present this PEM client certificate (mTLS), with --client-key-file.
    #[arg(
        long,
        env = "STATEHOUSE_CLIENT_CERT_FILE",
        requires = "client_key_file"
    )]
    pub client_cert_file: Option<PathBuf>,

    /// The key of --client-cert-file, in PEM.
    #[arg(
        long,
        env = "STATEHOUSE_CLIENT_KEY_FILE",
        requires = "client_cert_file"
    )]
    pub client_key_file: Option<PathBuf>,
}

/// Where a client goes and what it presents there: what the flags and the
/// environment resolve to.
#[derive(Clone, Debug)]
pub struct Connection {
    /// The gateway's base URL.
    pub base: GatewayUrl,
    /// The bearer token, if any: from --token-file, read again for each request.
    pub token: Bearer,
    /// The PEM files to trust and present over HTTPS.
    pub tls: TlsFiles,
}

/// The gateway's base URL: `http[s]://host[:port][/path]`, without a trailing slash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatewayUrl(String);

impl GatewayUrl {
    pub fn parse(raw: &str) -> Result<Self, String> {
        let url = Url::parse(raw).map_err(|e| format!("{raw:?} is not a URL: {e}"))?;
        match url.scheme() {
            "http" | "https" => {}
            other => {
                return Err(format!(
                    "unsupported scheme {other:?}: use http://host:port or https://host:port"
                ));
            }
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(format!("{raw:?} names no host"));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err("the URL must not carry credentials: use --token".into());
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err("the URL must be a base URL, without a query".into());
        }
        Ok(Self(url.as_str().trim_end_matches('/').to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The gateway a runner with no URL of its own and no statehouse Meltano
/// backend goes to.
const DEFAULT_URL: &str = "http://127.0.0.1:8080";

/// Meltano's state backend setting, which the shim reads.
const MELTANO_URI: &str = "MELTANO_STATE_BACKEND_URI";

/// Meltano's state backend when MELTANO_STATE_BACKEND_URI names a statehouse.
struct MeltanoBackend<'a> {
    /// `http` or `https`, for `statehouse` or `statehouses`.
    scheme: &'static str,
    /// The URI past `://`: host, port and the path the shim keeps.
    rest: &'a str,
    /// Where Meltano keeps the token: its variables are named after the scheme.
    token_variable: &'static str,
}

impl<'a> MeltanoBackend<'a> {
    fn of(uri: &'a str) -> Option<Self> {
        let (scheme, rest) = uri.split_once("://")?;
        let (scheme, token_variable) = match scheme.to_ascii_lowercase().as_str() {
            "statehouse" => ("http", "MELTANO_STATE_BACKEND_STATEHOUSE_TOKEN"),
            "statehouses" => ("https", "MELTANO_STATE_BACKEND_STATEHOUSES_TOKEN"),
            _ => return None,
        };
        Some(Self {
            scheme,
            rest,
            token_variable,
        })
    }

    /// The gateway's URL as the shim makes it: the scheme swapped, the rest
    /// kept (a trailing `/` dropped).
    fn url(&self) -> Result<GatewayUrl, String> {
        GatewayUrl::parse(&format!("{}://{}", self.scheme, self.rest))
            .map_err(|why| format!("{MELTANO_URI} is no gateway URL: {why}"))
    }
}

impl ConnectionArgs {
    /// The gateway's URL, and its token unless --token-file gives one: the
    /// runner's own settings, else Meltano's state backend (`var` reads the
    /// environment) when it is a statehouse, so that the variables set for
    /// `meltano run` serve the runner too; else the default URL and no token.
    pub fn gateway_settings(
        &self,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<(GatewayUrl, Option<String>), String> {
        let uri = var(MELTANO_URI);
        let meltano = uri.as_deref().and_then(MeltanoBackend::of);
        let url = match (&self.url, &meltano) {
            (Some(url), _) => url.clone(),
            (None, Some(backend)) => backend.url()?,
            (None, None) => GatewayUrl::parse(DEFAULT_URL)?,
        };
        let token = self
            .token
            .clone()
            .filter(|token| !token.is_empty())
            .or_else(|| meltano.and_then(|backend| var(backend.token_variable)));
        Ok((url, token))
    }

    /// The connection the flags and the environment describe: its URL, its
    /// token (read from --token-file, or as [`Self::gateway_settings`] finds
    /// it) and its TLS files.
    pub fn resolve(&self) -> Result<Connection, String> {
        // An empty variable is no setting: a template that left it blank.
        let (base, token) = self
            .gateway_settings(|name| std::env::var(name).ok().filter(|value| !value.is_empty()))?;
        let token = match &self.token_file {
            Some(path) => Bearer::file(path)?,
            None => Bearer::fixed(token),
        };
        Ok(Connection {
            base,
            token,
            tls: TlsFiles {
                ca_file: self.ca_file.clone(),
                client_cert_file: self.client_cert_file.clone(),
                client_key_file: self.client_key_file.clone(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Only {
        #[command(flatten)]
        args: ConnectionArgs,
    }

    fn parse(argv: &[&str]) -> ConnectionArgs {
        Only::try_parse_from(["client"].iter().chain(argv))
            .map(|only| only.args)
            .unwrap()
    }

    #[test]
    fn base_urls_keep_their_path_without_a_trailing_slash() {
        let parse = |raw| GatewayUrl::parse(raw).map(|u| u.as_str().to_owned());
        assert_eq!(parse("http://gw:8080").unwrap(), "http://gw:8080");
        assert_eq!(parse("http://gw:8080/").unwrap(), "http://gw:8080");
        assert_eq!(
            parse("http://gw/statehouse/").unwrap(),
            "http://gw/statehouse"
        );
        assert_eq!(parse("https://gw:8443/").unwrap(), "https://gw:8443");
        assert!(
            parse("ftp://gw")
                .unwrap_err()
                .contains("unsupported scheme")
        );
    }

    #[test]
    fn bad_connection_flags_are_refused() {
        for argv in [
            &["--url=ftp://gw"][..],
            &["--token=t", "--token-file=f"],
            &["--client-cert-file=c.pem"],
            &["--url=gw:8080"],
            &["--url=http://u:p@gw"],
            &["--url=http://gw/?a=b"],
        ] {
            assert!(
                Only::try_parse_from(["client"].iter().chain(argv)).is_err(),
                "{argv:?}"
            );
        }
    }

    /// The URL and token `argv` resolves to in an environment of `env` alone.
    fn settings(argv: &[&str], env: &[(&str, &str)]) -> Result<(String, Option<String>), String> {
        let args = parse(argv);
        let var = |name: &str| {
            env.iter()
                .find(|(key, _)| *key == name)
                .map(|(_, value)| (*value).to_owned())
        };
        let (url, token) = args.gateway_settings(var)?;
        Ok((url.as_str().to_owned(), token))
    }

    fn resolved(url: &str, token: Option<&str>) -> Result<(String, Option<String>), String> {
        Ok((url.to_owned(), token.map(str::to_owned)))
    }

    #[test]
    fn without_settings_of_its_own_it_takes_meltanos_statehouse_backend() {
        const PLAIN: &str = "MELTANO_STATE_BACKEND_STATEHOUSE_TOKEN";
        const TLS: &str = "MELTANO_STATE_BACKEND_STATEHOUSES_TOKEN";
        let both_tokens = [(PLAIN, "plain-token"), (TLS, "tls-token")];
        assert_eq!(
            settings(&[], &both_tokens),
            resolved("http://127.0.0.1:8080", None),
            "no statehouse URI: the default, and no Meltano token"
        );
        let plain = [&both_tokens[..], &[(MELTANO_URI, "statehouse://gw:8080")]].concat();
        assert_eq!(
            settings(&[], &plain),
            resolved("http://gw:8080", Some("plain-token"))
        );
        let tls = [
            &both_tokens[..],
            &[(MELTANO_URI, "statehouses://gw:8443/base/")],
        ]
        .concat();
        assert_eq!(
            settings(&[], &tls),
            resolved("https://gw:8443/base", Some("tls-token")),
            "the path kept, as the shim keeps it"
        );
        for other in ["s3://bucket/state", "systemdb", "postgresql://h/db"] {
            let env = [&both_tokens[..], &[(MELTANO_URI, other)]].concat();
            assert_eq!(
                settings(&[], &env),
                resolved("http://127.0.0.1:8080", None),
                "{other}"
            );
        }
        // The runner's own settings win, each on its own.
        assert_eq!(
            settings(&["--url=http://mine:1"], &plain),
            resolved("http://mine:1", Some("plain-token"))
        );
        assert_eq!(
            settings(&["--token=mine"], &tls),
            resolved("https://gw:8443/base", Some("mine"))
        );
        assert_eq!(
            settings(&["--token="], &tls),
            resolved("https://gw:8443/base", Some("tls-token")),
            "an empty token is none"
        );
        let bad = [(MELTANO_URI, "statehouse://")];
        let err = settings(&[], &bad).unwrap_err();
        assert!(err.contains(MELTANO_URI), "{err}");
        assert!(settings(&["--url=http://mine:1"], &bad).is_ok(), "not read");
    }
}
