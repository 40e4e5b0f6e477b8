//! A gateway as its own process (the release binary `bench/run` builds), for
//! benches that watch its memory.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct GatewayProcess {
    pub base: String,
    child: Child,
}

impl GatewayProcess {
    /// Starts `statehouse serve` on a free loopback port and a database of
    /// its own, with `extra` flags, and waits until it is ready.
    pub async fn start(url: &str, extra: &[&str]) -> Self {
        Self::start_with_env(url, extra, &[]).await
    }

    /// As [`Self::start`], with the variables of `env` set.
    pub async fn start_with_env(url: &str, extra: &[&str], env: &[(&str, &str)]) -> Self {
        let binary =
            std::env::var("STATEHOUSE_BIN").unwrap_or_else(|_| "target/release/statehouse".into());
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let schema = format!("bench_{}", uuid::Uuid::new_v4().simple());
        let child = Command::new(binary)
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--schema",
                &schema,
            ])
            .args(extra)
            .env("STATEHOUSE_CLICKHOUSE_URL", url)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stderr(Stdio::null())
            .spawn()
            .expect("the release binary exists (bench/run builds it)");
        let gateway = Self {
            base: format!("http://127.0.0.1:{port}"),
            child,
        };
        let http = reqwest::Client::new();
        let ready_by = Instant::now() + Duration::from_secs(30);
        while http
            .get(format!("{}/readyz", gateway.base))
            .send()
            .await
            .map(|r| r.status() != 200)
            .unwrap_or(true)
        {
            assert!(Instant::now() < ready_by, "gateway not ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        gateway
    }

    /// Resident memory now, in KiB.
    pub fn rss_kib(&self) -> u64 {
        self.status_kib("VmRSS:")
    }

    /// Starts the peak (`VmHWM`) over from the memory resident now
    /// (Linux 4.0 and later), so that the next peak is of what follows.
    pub fn reset_peak(&self) {
        std::fs::write(format!("/proc/{}/clear_refs", self.child.id()), "5")
            .expect("the gateway's peak RSS can be reset");
    }

    /// The most resident memory the process has had so far, in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        self.status_kib("VmHWM:")
    }

    fn status_kib(&self, field: &str) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .ok()
            .and_then(|status| {
                status
                    .lines()
                    .find(|l| l.starts_with(field))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            })
            .unwrap_or(0)
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
