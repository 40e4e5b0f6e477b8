//! The container image and compose file, checked without a Docker engine:
//! `docker-compose config` validates the compose file, the Dockerfile is read
//! for the properties the image must have, and the health check the image
//! runs is run here against a real gateway.

use std::process::Command;

use crate::helpers::{ClosedPort, spawn_app};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// `docker-compose config` of `file` (relative to the project root).
fn compose_config(file: &str, password: Option<&str>) -> std::process::Output {
    compose_config_of(&[file], password)
}

/// `docker-compose config` of `files` merged, each overriding the ones before.
fn compose_config_of(files: &[&str], password: Option<&str>) -> std::process::Output {
    let mut command = Command::new("docker-compose");
    for file in files {
        command.args(["--file", &format!("{ROOT}/{file}")]);
    }
    command.arg("config").env_remove("CLICKHOUSE_PASSWORD");
    if let Some(password) = password {
        command.env("CLICKHOUSE_PASSWORD", password);
    }
    command
        .output()
        .expect("docker-compose is installed (scripts/test installs it)")
}

#[test]
fn compose_file_is_valid_and_wires_the_gateway_to_a_healthy_clickhouse() {
    let output = compose_config("docker-compose.yml", Some("s3cret"));
    let rendered = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let config: serde_yaml::Value = serde_yaml::from_str(&rendered).unwrap();
    let services = &config["services"];
    let image = services["clickhouse"]["image"].as_str().unwrap();
    let tag = image
        .strip_prefix("clickhouse/clickhouse-server:")
        .expect("the official image");
    assert!(
        tag.chars().next().unwrap().is_ascii_digit(),
        "pinned to a version, not {tag}"
    );
    assert!(
        services["clickhouse"]["volumes"][0]
            .as_str()
            .unwrap()
            .contains("/var/lib/clickhouse")
    );
    let gateway = &services["statehouse"];
    assert_eq!(
        gateway["depends_on"]["clickhouse"]["condition"],
        "service_healthy"
    );
    let env = &gateway["environment"];
    assert_eq!(
        env["STATEHOUSE_CLICKHOUSE_URL"],
        "clickhouse://statehouse@clickhouse:8123/default"
    );
    // Apart from the URL, where @ or / in it would break the URL.
    assert_eq!(env["STATEHOUSE_CLICKHOUSE_PASSWORD"], "s3cret");
    assert_eq!(env["STATEHOUSE_LISTEN"], "0.0.0.0:8080");
    assert!(
        env["STATEHOUSE_TOKENS_FILE"].as_str().is_some(),
        "exposed, so it authenticates"
    );
    assert!(rendered.contains("8080"), "the API port is published");
}

#[test]
fn compose_refuses_to_run_without_a_clickhouse_password() {
    for file in ["docker-compose.yml", TWO_GATEWAYS] {
        let output = compose_config(file, None);
        assert!(!output.status.success(), "{file}");
        assert!(String::from_utf8_lossy(&output.stderr).contains("CLICKHOUSE_PASSWORD"));
    }
}

const TWO_GATEWAYS: &str = "deploy/two-gateways/compose.yml";

#[test]
fn the_two_gateway_example_puts_gateways_that_advertise_themselves_behind_a_balancer() {
    let output = compose_config(TWO_GATEWAYS, Some("s3cret"));
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let config: serde_yaml::Value = serde_yaml::from_slice(&output.stdout).unwrap();
    let services = &config["services"];
    let nginx_conf =
        std::fs::read_to_string(format!("{ROOT}/deploy/two-gateways/nginx.conf")).unwrap();
    for name in ["statehouse-a", "statehouse-b"] {
        let env = &services[name]["environment"];
        assert_eq!(
            env["STATEHOUSE_ADVERTISE_URL"],
            format!("http://{name}:8080").as_str(),
            "{name} advertises the address its peers reach it at"
        );
        assert_eq!(
            env["STATEHOUSE_CLICKHOUSE_URL"],
            "clickhouse://statehouse@clickhouse:8123/default"
        );
        assert_eq!(env["STATEHOUSE_CLICKHOUSE_PASSWORD"], "s3cret");
        assert_eq!(env["STATEHOUSE_SCHEMA"], "meltano", "one schema for both");
        assert_eq!(env["STATEHOUSE_LISTEN"], "0.0.0.0:8080");
        assert!(env["STATEHOUSE_TOKENS_FILE"].as_str().is_some());
        assert!(
            services[name]["ports"].is_null(),
            "{name} is reached through the balancer only"
        );
        assert!(
            nginx_conf.contains(&format!("server {name}:8080;")),
            "the balancer sends to {name}"
        );
    }
    let balancer = &services["balancer"];
    assert!(
        balancer["volumes"][0]
            .as_str()
            .unwrap()
            .ends_with("/nginx.conf:/etc/nginx/nginx.conf:ro")
    );
    assert_eq!(balancer["ports"][0]["target"], 8080);
    assert!(
        nginx_conf.contains("proxy_read_timeout 330s;"),
        "outlasts the longest lock wait"
    );
}

#[test]
fn the_tls_variants_serve_https_check_their_own_health_over_it_and_peers_advertise_https() {
    let rendered = |files: &[&str]| {
        let output = compose_config_of(files, Some("s3cret"));
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        serde_yaml::from_slice::<serde_yaml::Value>(&output.stdout).unwrap()
    };
    let mounts_certs = |service: &serde_yaml::Value| {
        service["volumes"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|v| v.as_str().unwrap().ends_with(":/etc/statehouse/tls:ro"))
    };
    let single = rendered(&["docker-compose.yml", "docker-compose.tls.yml"]);
    let gateway = &single["services"]["statehouse"];
    let env = &gateway["environment"];
    assert_eq!(
        env["STATEHOUSE_TLS_CERT_FILE"],
        "/etc/statehouse/tls/gateway.pem"
    );
    assert_eq!(
        env["STATEHOUSE_TLS_KEY_FILE"],
        "/etc/statehouse/tls/gateway.key"
    );
    assert_eq!(
        env["STATEHOUSE_HEALTHCHECK_CA_FILE"],
        "/etc/statehouse/tls/ca.pem"
    );
    // The health check probes loopback: the name must be one the certificate has.
    assert_eq!(env["STATEHOUSE_HEALTHCHECK_SERVER_NAME"], "localhost");
    assert!(
        env["STATEHOUSE_TOKENS_FILE"].as_str().is_some(),
        "kept from the base file"
    );
    assert!(mounts_certs(gateway));

    let two = rendered(&[TWO_GATEWAYS, "deploy/two-gateways/compose.tls.yml"]);
    let nginx_conf =
        std::fs::read_to_string(format!("{ROOT}/deploy/two-gateways/nginx.tls.conf")).unwrap();
    assert!(
        nginx_conf.contains("stream {"),
        "TLS passes through nginx undecrypted"
    );
    for name in ["statehouse-a", "statehouse-b"] {
        let service = &two["services"][name];
        let env = &service["environment"];
        assert_eq!(
            env["STATEHOUSE_ADVERTISE_URL"],
            format!("https://{name}:8080").as_str()
        );
        assert_eq!(env["STATEHOUSE_PEER_CA_FILE"], "/etc/statehouse/tls/ca.pem");
        assert_eq!(env["STATEHOUSE_HEALTHCHECK_SERVER_NAME"], "localhost");
        assert_eq!(
            env["STATEHOUSE_TLS_CERT_FILE"],
            "/etc/statehouse/tls/gateway.pem"
        );
        assert!(mounts_certs(service), "{name}");
        assert!(nginx_conf.contains(&format!("server {name}:8080;")));
    }
    let balancer = &two["services"]["balancer"];
    assert!(
        balancer["volumes"][0]
            .as_str()
            .unwrap()
            .ends_with("/nginx.tls.conf:/etc/nginx/nginx.conf:ro")
    );
}

#[test]
fn dockerfile_builds_locked_and_runs_small_non_root_and_checks_its_own_health() {
    let dockerfile = std::fs::read_to_string(format!("{ROOT}/Dockerfile")).unwrap();
    let from: Vec<&str> = dockerfile
        .lines()
        .filter(|l| l.starts_with("FROM "))
        .collect();
    assert_eq!(from.len(), 2, "multi-stage: {from:?}");
    assert!(from[0].ends_with(" AS build"));
    assert!(from[1].contains("distroless"), "small runtime: {}", from[1]);
    assert!(dockerfile.contains("cargo build --release --locked"));
    assert!(dockerfile.contains("COPY --from=build"));
    assert!(dockerfile.lines().any(|l| l == "USER nonroot"));
    assert!(
        dockerfile.contains(r#"ENTRYPOINT ["/usr/local/bin/statehouse"]"#),
        "exec form"
    );
    assert!(dockerfile.contains(r#"CMD ["/usr/local/bin/statehouse", "healthcheck"]"#));
}

#[tokio::test]
async fn the_images_health_check_passes_on_a_ready_gateway_and_fails_without_one() {
    let app = spawn_app().await;
    let listen = app.base.trim_start_matches("http://").to_owned();
    let healthcheck = |listen: String| {
        tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_statehouse"))
                .args(["healthcheck", "--listen", &listen])
                .output()
                .unwrap()
        })
    };
    let healthy = healthcheck(listen).await.unwrap();
    assert!(
        healthy.status.success(),
        "{}",
        String::from_utf8_lossy(&healthy.stderr)
    );
    let closed = ClosedPort::bind();
    let nobody = healthcheck(format!("127.0.0.1:{}", closed.port()))
        .await
        .unwrap();
    assert_eq!(nobody.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&nobody.stderr).contains("cannot connect"));
}
