//! `statehouse healthcheck`: one HTTP/1.1 GET over std's TcpStream (inside
//! rustls's blocking stream for HTTPS), so the container image needs no curl
//! and the binary no HTTP client.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpStream};
use std::sync::Arc;

use rustls::pki_types::ServerName;

use crate::config::HealthcheckArgs;
use crate::tls::{Identity, client_config};

/// Answers whether the gateway said 200, or why it could not be asked.
pub fn probe(args: &HealthcheckArgs) -> Result<(), String> {
    let mut addr = args.listen;
    // A wildcard listen address is reached on loopback.
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => addr.set_ip(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        IpAddr::V6(ip) if ip.is_unspecified() => addr.set_ip(IpAddr::V6(Ipv6Addr::LOCALHOST)),
        _ => {}
    }
    let fail = |what: &str, err: std::io::Error| format!("{what} {addr}: {err}");
    let mut stream = TcpStream::connect_timeout(&addr, args.timeout)
        .map_err(|e| fail("cannot connect to", e))?;
    stream
        .set_read_timeout(Some(args.timeout))
        .and_then(|()| stream.set_write_timeout(Some(args.timeout)))
        .map_err(|e| fail("cannot configure the connection to", e))?;
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nUser-Agent: statehouse-healthcheck\r\n\r\n",
        args.path
    );
    let mut head = [0u8; 12];
    let mut exchange = |conn: &mut dyn ReadWrite| {
        conn.write_all(request.as_bytes())
            .map_err(|e| fail("cannot send to", e))?;
        conn.read_exact(&mut head)
            .map_err(|e| fail("no answer from", e))
    };
    match &args.ca_file {
        None => exchange(&mut stream)?,
        Some(ca_file) => {
            let roots = crate::tls::read_certificates(ca_file)
                .map_err(|e| format!("cannot use the CA file {}: {e}", ca_file.display()))?;
            let identity = match (&args.client_cert_file, &args.client_key_file) {
                (Some(cert), Some(key)) => Some(Arc::new(
                    Identity::load(cert, key).map_err(|e| e.to_string())?,
                )),
                _ => None,
            };
            let name = ServerName::try_from(args.server_name.clone())
                .map_err(|e| format!("invalid --server-name {:?}: {e}", args.server_name))?;
            let conn = rustls::ClientConnection::new(client_config(&roots, identity), name)
                .map_err(|e| format!("cannot start TLS to {addr}: {e}"))?;
            exchange(&mut rustls::StreamOwned::new(conn, stream))?;
        }
    }
    let status_line = String::from_utf8_lossy(&head);
    match status_line.split_whitespace().nth(1) {
        Some("200") => Ok(()),
        Some(status) => Err(format!("{addr}{} answered {status}", args.path)),
        None => Err(format!("{addr} did not answer HTTP")),
    }
}

trait ReadWrite: Read + Write {}

impl<T: Read + Write> ReadWrite for T {}

#[cfg(test)]
mod tests {
    use super::*;
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
        assert!(probe(&args(addr)).is_err());
    }

    #[test]
    fn wildcard_addresses_are_probed_on_loopback() {
        let port = serve_once("HTTP/1.1 200 OK\r\n\r\n").port();
        assert_eq!(probe(&args(SocketAddr::from(([0, 0, 0, 0], port)))), Ok(()));
    }
}
