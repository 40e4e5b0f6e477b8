//! Keeper out of reach, on a ClickHouse node with a ZooKeeper of its own
//! (killing the shared one would stall every other test's Keeper calls).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use statehouse::domain::StateId;
use statehouse::store::{NewClaim, Outcome, StoreError};
use uuid::Uuid;

use crate::helpers::{free_port, unique_schema};
use crate::keeper_claims::claims_at;

/// A ZooKeeper and a local ClickHouse node on it, both on free ports, both
/// stopped (and their data removed) on drop.
pub struct KeeperNode {
    pub url: String,
    zookeeper_port: u16,
    clickhouse_port: u16,
    data: PathBuf,
}

fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("localch")
        .join(name)
}

impl KeeperNode {
    pub fn start() -> Self {
        let data = std::env::temp_dir().join(format!("statehouse-keeper-{}", Uuid::new_v4()));
        let zookeeper_port = free_port();
        let clickhouse_port = free_port();
        let node = Self {
            url: format!("clickhouse://default@127.0.0.1:{clickhouse_port}/default"),
            zookeeper_port,
            clickhouse_port,
            data,
        };
        node.start_zookeeper();
        let status = Command::new(script("localch"))
            .arg("start")
            .env("LOCALCH_PORT", clickhouse_port.to_string())
            .env("LOCALCH_DATA", node.data.join("engine"))
            .env("LOCALCH_ZOOKEEPER", format!("127.0.0.1:{zookeeper_port}"))
            .env("LOCALCH_TLS_PORT", "")
            .env("LOCALCH_USERS", "")
            .status()
            .expect("localch runs");
        assert!(status.success(), "the local ClickHouse starts");
        node
    }

    fn zookeeper(&self, args: &[&str]) {
        let status = Command::new(script("zookeeper"))
            .args(args)
            .env("ZOOKEEPER_PORT", self.zookeeper_port.to_string())
            .env("ZOOKEEPER_DATA", self.data.join("zookeeper"))
            .status()
            .expect("localch/zookeeper runs");
        assert!(status.success(), "localch/zookeeper {args:?}");
    }

    /// Starts it, or starts it again with the keys it had.
    pub fn start_zookeeper(&self) {
        self.zookeeper(&["start"]);
    }

    /// kill -9, as a crash.
    pub fn kill_zookeeper(&self) {
        self.zookeeper(&["stop", "-9"]);
    }

    /// Another ClickHouse node on this ZooKeeper: its MergeTree tables are
    /// its own, its KeeperMap tables the first node's.
    pub fn start_second_node(&self) -> SecondNode {
        let port = free_port();
        let node = SecondNode {
            url: format!("clickhouse://default@127.0.0.1:{port}/default"),
            port,
            data: self.data.join("engine-b"),
        };
        let status = Command::new(script("localch"))
            .arg("start")
            .env("LOCALCH_PORT", port.to_string())
            .env("LOCALCH_DATA", &node.data)
            .env(
                "LOCALCH_ZOOKEEPER",
                format!("127.0.0.1:{}", self.zookeeper_port),
            )
            .env("LOCALCH_TLS_PORT", "")
            .env("LOCALCH_USERS", "")
            .status()
            .expect("localch runs");
        assert!(status.success(), "the second ClickHouse node starts");
        node
    }
}

/// A second ClickHouse node on a [`KeeperNode`]'s ZooKeeper, stopped on drop.
pub struct SecondNode {
    pub url: String,
    port: u16,
    data: PathBuf,
}

impl Drop for SecondNode {
    fn drop(&mut self) {
        let _ = Command::new(script("localch"))
            .arg("stop")
            .env("LOCALCH_PORT", self.port.to_string())
            .env("LOCALCH_DATA", &self.data)
            .status();
    }
}

impl Drop for KeeperNode {
    fn drop(&mut self) {
        let _ = Command::new(script("localch"))
            .arg("stop")
            .env("LOCALCH_PORT", self.clickhouse_port.to_string())
            .status();
        let _ = Command::new(script("zookeeper"))
            .arg("stop")
            .env("ZOOKEEPER_PORT", self.zookeeper_port.to_string())
            .env("ZOOKEEPER_DATA", self.data.join("zookeeper"))
            .status();
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

#[tokio::test]
async fn keeper_calls_fail_within_the_query_timeout_while_it_is_down_and_a_stray_claim_only_lapses()
{
    let node = KeeperNode::start();
    let claims = claims_at(&node.url, &unique_schema(), Duration::from_secs(2)).await;
    let held = StateId::parse("dev:held".to_owned()).unwrap();
    let mine = NewClaim {
        claim_id: Uuid::new_v4(),
        gateway_id: Uuid::new_v4(),
        advertise_url: "",
        ttl: Duration::from_secs(60),
        tokens: 1,
    };
    assert_eq!(claims.create(&held, &mine).await.unwrap(), Outcome::Done);

    node.kill_zookeeper();
    let stray = StateId::parse("dev:stray".to_owned()).unwrap();
    let late = NewClaim {
        claim_id: Uuid::new_v4(),
        ttl: Duration::from_millis(500),
        ..mine.clone()
    };
    // chDB does not fail a Keeper call while ZooKeeper is away, it waits:
    // only the gateway's own query timeout answers.
    let create = claims.create(&stray, &late).await;
    assert!(matches!(create, Err(StoreError::Timeout(_))), "{create:?}");
    let renew = claims.renew(&held, mine.claim_id, mine.ttl).await;
    assert!(matches!(renew, Err(StoreError::Timeout(_))), "{renew:?}");

    node.start_zookeeper();
    // Until chDB has its ZooKeeper session back, calls time out or fail.
    let mut back = None;
    for _ in 0..60 {
        if let Ok(read) = claims.read(&held).await {
            back = Some(read);
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let back = back.expect("Keeper calls work again once ZooKeeper is back");
    assert_eq!(back.claim.unwrap().holder_claim_id(), mine.claim_id);
    assert_eq!(
        claims.renew(&held, mine.claim_id, mine.ttl).await.unwrap(),
        Outcome::Done
    );

    // The create that gave up may still have landed once ZooKeeper was back:
    // such a claim nobody renews, so it lapses and is taken like any other.
    let rival = NewClaim {
        claim_id: Uuid::new_v4(),
        ..mine.clone()
    };
    for attempt in 0.. {
        assert!(attempt < 200, "the stray claim lapses");
        let read = claims.read(&stray).await.unwrap();
        let outcome = match &read.claim {
            None => claims.create(&stray, &rival).await.unwrap(),
            Some(key) if key.takeable(read.now_ms) => claims
                .take_over(&stray, key.holder_claim_id(), key.last_token, &rival)
                .await
                .unwrap(),
            Some(_) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        assert_eq!(outcome, Outcome::Done);
        break;
    }
    let taken = claims.read(&stray).await.unwrap().claim.unwrap();
    assert_eq!(taken.holder_claim_id(), rival.claim_id);
}

#[tokio::test]
async fn keeper_mode_without_a_reachable_keeper_ends_the_start_naming_the_zookeeper_setting() {
    let node = KeeperNode::start();
    node.kill_zookeeper();
    let schema = unique_schema();
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_statehouse"))
        .args(["serve", "--listen", "127.0.0.1:0", "--schema", &schema])
        .args(["--coordination", "keeper", "--startup-timeout", "5s"])
        .args(["--query-timeout", "2s"])
        .env("STATEHOUSE_CLICKHOUSE_URL", &node.url)
        .env("RUST_LOG", "off")
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the start ends by itself")
        .expect("statehouse runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.contains("did not reach its Keeper for --coordination keeper"),
        "{stderr}"
    );
    assert!(
        stderr.contains("the server setting <zookeeper>"),
        "{stderr}"
    );
}
