//! `statehouse lock` against a TLS gateway, with the throwaway certificates
//! of `scripts/make-certs`: it trusts the CA it is given and only that one,
//! and presents a client certificate where the gateway requires one.

use std::time::Duration;

use reqwest::StatusCode;

use crate::https::{Certs, spawn_tls};
use crate::run_lease::{STARTS, Scratch, WAIT_FOR_GO, ended, lock, lock_status, until};

#[tokio::test]
async fn over_https_the_runner_holds_the_lease_and_returns_the_commands_status() {
    let certs = Certs::make();
    let app = spawn_tls(&certs, &[]).await;
    let scratch = Scratch::new();
    let ca = certs.path("ca.pem");
    let run = lock(
        &app.base,
        &["--ca-file", &ca],
        "job",
        &scratch.0,
        &format!("{WAIT_FOR_GO}; exit 3"),
    );
    until("the command starts", STARTS, || {
        scratch.path("ready").exists()
    })
    .await;
    assert_eq!(lock_status(&app, "job").await, StatusCode::OK);
    std::fs::write(scratch.path("go"), "").unwrap();
    let (status, stderr) = ended(run, Duration::from_secs(20)).await;
    assert_eq!(status, Some(3), "{stderr}");
    assert_eq!(stderr, "");
    assert_eq!(lock_status(&app, "job").await, StatusCode::NOT_FOUND);

    // The same from the environment, with the token from a file.
    std::fs::write(scratch.path("token"), "some-token\n").unwrap();
    let output = tokio::process::Command::new(crate::run_lease::BIN)
        .args(["lock", "job", "--", "sh", "-c", "touch ran"])
        .current_dir(&scratch.0)
        .env("STATEHOUSE_URL", &app.base)
        .env("STATEHOUSE_CA_FILE", &ca)
        .env("STATEHOUSE_TOKEN_FILE", scratch.path("token"))
        .env_remove("STATEHOUSE_TOKEN")
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(scratch.path("ran").exists());
}

#[tokio::test]
async fn with_client_certificates_required_the_runner_presents_its_own() {
    let certs = Certs::make();
    let ca = certs.path("ca.pem");
    let app = spawn_tls(&certs, &["--tls-client-ca-file", &ca]).await;
    let scratch = Scratch::new();
    let (cert, key) = (certs.path("client.pem"), certs.path("client.key"));
    let run = lock(
        &app.base,
        &[
            "--ca-file",
            &ca,
            "--client-cert-file",
            &cert,
            "--client-key-file",
            &key,
        ],
        "job",
        &scratch.0,
        "touch ran; exit 0",
    );
    let (status, stderr) = ended(run, Duration::from_secs(20)).await;
    assert_eq!(status, Some(0), "{stderr}");
    assert!(scratch.path("ran").exists());

    // Without one, the gateway takes no lease from it: nothing runs.
    std::fs::remove_file(scratch.path("ran")).unwrap();
    let run = lock(
        &app.base,
        &["--ca-file", &ca],
        "job",
        &scratch.0,
        "touch ran",
    );
    let (status, stderr) = ended(run, Duration::from_secs(20)).await;
    assert_eq!(status, Some(1), "{stderr}");
    assert!(stderr.contains("nothing was run"), "{stderr}");
    assert!(!scratch.path("ran").exists());
}

#[tokio::test]
async fn trusting_another_ca_only_it_exits_1_and_runs_nothing() {
    let certs = Certs::make();
    let app = spawn_tls(&certs, &[]).await;
    let scratch = Scratch::new();
    let other = certs.path("other-ca.pem");
    let run = lock(
        &app.base,
        &["--ca-file", &other],
        "job",
        &scratch.0,
        "touch ran",
    );
    let (status, stderr) = ended(run, Duration::from_secs(20)).await;
    assert_eq!(status, Some(1), "{stderr}");
    assert!(stderr.contains("UnknownIssuer"), "{stderr}");
    assert!(!scratch.path("ran").exists());
    assert_eq!(lock_status(&app, "job").await, StatusCode::NOT_FOUND);

    // Files that cannot be used stop it before it asks anything.
    let missing = scratch.path("missing.pem").display().to_string();
    for flags in [
        vec!["--ca-file", missing.as_str()],
        vec!["--token-file", missing.as_str()],
    ] {
        let run = lock(&app.base, &flags, "job", &scratch.0, "touch ran");
        let (status, stderr) = ended(run, Duration::from_secs(20)).await;
        assert_eq!(status, Some(1), "{flags:?}: {stderr}");
        assert!(stderr.contains("missing.pem"), "{stderr}");
        assert!(!scratch.path("ran").exists());
    }
}
