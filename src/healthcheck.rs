//! `statehouse healthcheck`: one GET to the gateway on this machine, so the
//! container image needs no curl. Over HTTPS it is the client of
//! `statehouse lock` (`crate::client`), on the same TLS files.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::client::{TlsFiles, error_chain};
use crate::config::HealthcheckArgs;

/// Answers whether the gateway said 200, or why it could not be asked.
pub fn probe(args: &HealthcheckArgs) -> Result<(), String> {
    let mut addr = args.listen;
    // A wildcard listen address is reached on loopback.
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => addr.set_ip(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        IpAddr::V6(ip) if ip.is_unspecified() => addr.set_ip(IpAddr::V6(Ipv6Addr::LOCALHOST)),
        _ => {}
    }
    let (url, builder) = match &args.ca_file {
        None => (
            format!("http://{addr}{}", args.path),
            reqwest::Client::builder(),
        ),
        Some(_) => {
            let tls = TlsFiles {
                ca_file: args.ca_file.clone(),
                client_cert_file: args.client_cert_file.clone(),
                client_key_file: args.client_key_file.clone(),
            };
            // The certificate is checked for --server-name, which is
            // reached at the listen address whatever DNS says.
            let url = format!("https://{}:{}{}", args.server_name, addr.port(), args.path);
            (
                url,
                crate::client::builder(&tls)?.resolve(&args.server_name, addr),
            )
        }
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start: {e}"))?;
    // reqwest's client takes its timers from the runtime it is built in.
    let status = runtime.block_on(async {
        let client = builder
            .timeout(args.timeout)
            .user_agent("statehouse-healthcheck")
            .build()
            .map_err(|e| format!("cannot set up the HTTP client: {}", error_chain(&e)))?;
        client
            .get(&url)
            .send()
            .await
            .map(|answer| answer.status())
            .map_err(|e| {
                let what = if e.is_connect() {
                    "cannot connect to"
                } else {
                    "no answer from"
                };
                format!("{what} {addr}: {}", error_chain(&e))
            })
    })?;
    if status == reqwest::StatusCode::OK {
        Ok(())
    } else {
        Err(format!("{addr}{} answered {}", args.path, status.as_u16()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpListener};
    use std::time::Duration;

    fn serve_once(answer: &'static str) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut buf = [0u8; 1024];
            let _ = conn.read(&mut buf);
            conn.write_all(answer.as_bytes()).unwrap();
        });
        addr
    }

    fn args(listen: SocketAddr) -> HealthcheckArgs {
        HealthcheckArgs {
            listen,
            path: "/readyz".into(),
            timeout: Duration::from_secs(2),
            ca_file: None,
            client_cert_file: None,
            client_key_file: None,
            server_name: "localhost".into(),
        }
    }

    #[test]
    fn healthy_only_on_200() {
        assert_eq!(probe(&args(serve_once("HTTP/1.1 200 OK\r\n\r\n"))), Ok(()));
        let err = probe(&args(serve_once(
            "HTTP/1.1 503 Service Unavailable\r\n\r\n",
        )))
        .unwrap_err();
        assert!(err.contains("503"), "{err}");
    }

    #[test]
    fn nothing_listening_is_unhealthy() {
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let err = probe(&args(addr)).unwrap_err();
        assert!(err.contains("cannot connect"), "{err}");
    }

    #[test]
    fn wildcard_addresses_are_probed_on_loopback() {
        let port = serve_once("HTTP/1.1 200 OK\r\n\r\n").port();
        assert_eq!(probe(&args(SocketAddr::from(([0, 0, 0, 0], port)))), Ok(()));
    }
}
