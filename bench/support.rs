//! What every bench needs: gateways with production defaults on a database of
//! their own, in the ClickHouse named by STATEHOUSE_BENCH_CLICKHOUSE_URL.

use statehouse::App;
use statehouse::config::Config;

pub struct BenchGateway {
    pub base: String,
    pub config: Config,
}

/// A fresh database name for one bench's gateways.
pub fn new_schema() -> String {
    format!("bench_{}", uuid::Uuid::new_v4().simple())
}

/// A gateway on `schema` with `extra` flags; with `advertise`, on a port of
/// its own that it advertises, so that its peers on the same schema forward to it.
pub async fn start_gateway_in(schema: &str, advertise: bool, extra: &[&str]) -> BenchGateway {
    let url = std::env::var("STATEHOUSE_BENCH_CLICKHOUSE_URL")
        .expect("set STATEHOUSE_BENCH_CLICKHOUSE_URL (bench/run does)");
    let port = if advertise {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port()
    } else {
        0
    };
    let listen = format!("127.0.0.1:{port}");
    let advertise_url = format!("http://{listen}");
    let mut args = vec![
        "--clickhouse-url",
        &url,
        "--listen",
        &listen,
        "--schema",
        schema,
    ];
    if advertise {
        args.extend(["--advertise-url", &advertise_url]);
    }
    args.extend_from_slice(extra);
    let config = Config::from_serve_args(&args).expect("valid configuration");
    let app = App::build(&config).await.expect("gateway starts");
    let base = format!("{}://{}", app.scheme(), app.local_addr());
    tokio::spawn(app.serve(std::future::pending()));
    BenchGateway { base, config }
}
