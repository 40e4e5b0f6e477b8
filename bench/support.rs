//! What every bench needs: a gateway with production defaults on a database of
//! its own, in the ClickHouse named by STATEHOUSE_BENCH_CLICKHOUSE_URL.

use statehouse::App;
use statehouse::config::Config;

pub struct BenchGateway {
    pub base: String,
    pub config: Config,
}

pub async fn start_gateway() -> BenchGateway {
    let url = std::env::var("STATEHOUSE_BENCH_CLICKHOUSE_URL")
        .expect("set STATEHOUSE_BENCH_CLICKHOUSE_URL (bench/run does)");
    let schema = format!("bench_{}", uuid::Uuid::new_v4().simple());
    let config = Config::from_serve_args(&[
        "--clickhouse-url",
        &url,
        "--listen",
        "127.0.0.1:0",
        "--schema",
        &schema,
    ])
    .expect("valid configuration");
    let app = App::build(&config).await.expect("gateway starts");
    let base = format!("http://{}", app.local_addr());
    tokio::spawn(app.serve(std::future::pending()));
    BenchGateway { base, config }
}
