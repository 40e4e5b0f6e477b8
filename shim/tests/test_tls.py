"""statehouses://: Meltano over HTTPS to a TLS gateway, with the CA and
client certificate settings, whatever REQUESTS_CA_BUNDLE says."""

from __future__ import annotations

import uuid

import pytest

from conftest import Certs, Gateway, Project, make_project, start_gateway, stop_gateway

JOB = "dev:tap-tiny-to-target-tiny"


@pytest.fixture
def certs(tmp_path) -> Certs:
    return Certs.make(tmp_path / "certs")


@pytest.fixture
def tls_gateway(certs: Certs):
    gw = start_gateway(f"shim_{uuid.uuid4().hex}", certs=certs)
    yield gw
    stop_gateway(gw)


@pytest.fixture
def mtls_gateway(certs: Certs):
    gw = start_gateway(f"shim_{uuid.uuid4().hex}", certs=certs, client_ca=True)
    yield gw
    stop_gateway(gw)


def tls_project(root, gateway: Gateway, certs: Certs) -> Project:
    project = make_project(root, gateway.uri)
    # A bundle that does not hold the gateway's CA, as on a machine whose
    # environment points requests at the system's CAs.
    project.env["REQUESTS_CA_BUNDLE"] = certs.path("other-ca.pem")
    project.env["MELTANO_STATE_BACKEND_STATEHOUSES_REQUEST_TIMEOUT"] = "5"
    return project


def last_id(gateway: Gateway) -> int:
    return gateway.state(JOB)["completed"]["singer_state"]["bookmarks"]["numbers"]["last_id"]


def test_meltano_runs_over_statehouses_with_the_ca_file_whatever_requests_ca_bundle_says(
    tmp_path, tls_gateway: Gateway, certs: Certs
):
    assert tls_gateway.uri.startswith("statehouses://")
    project = tls_project(tmp_path / "p", tls_gateway, certs)
    project.env["MELTANO_STATE_BACKEND_STATEHOUSES_CA_FILE"] = certs.path("ca.pem")
    project.meltano("run", "tap-tiny", "target-tiny", extra_env={"TAP_TINY_COUNT": "4"})
    assert last_id(tls_gateway) == 4
    assert project.state_get(JOB)["singer_state"]["bookmarks"]["numbers"]["last_id"] == 4


def test_without_the_ca_file_the_run_fails_naming_the_certificate_and_the_setting(
    tmp_path, tls_gateway: Gateway, certs: Certs
):
    project = tls_project(tmp_path / "p", tls_gateway, certs)
    result = project.meltano("run", "tap-tiny", "target-tiny", check=False, extra_env={"TAP_TINY_COUNT": "2"})
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "certificate" in output, output
    assert "state_backend.statehouses.ca_file" in output, output
    assert tls_gateway.state(JOB) is None


def test_a_client_certificate_setting_works_against_a_gateway_that_requires_one(
    tmp_path, mtls_gateway: Gateway, certs: Certs
):
    project = tls_project(tmp_path / "p", mtls_gateway, certs)
    project.env["MELTANO_STATE_BACKEND_STATEHOUSES_CA_FILE"] = certs.path("ca.pem")
    refused = project.meltano("state", "get", JOB, check=False)
    assert refused.returncode != 0
    output = refused.stdout + refused.stderr
    assert "403" in output, output
    assert "state_backend.statehouses.client_cert_file" in output, output

    project.env["MELTANO_STATE_BACKEND_STATEHOUSES_CLIENT_CERT_FILE"] = certs.path("client.pem")
    project.env["MELTANO_STATE_BACKEND_STATEHOUSES_CLIENT_KEY_FILE"] = certs.path("client.key")
    project.meltano("run", "tap-tiny", "target-tiny", extra_env={"TAP_TINY_COUNT": "3"})
    assert last_id(mtls_gateway) == 3


def test_the_runners_tls_variables_serve_when_meltanos_settings_are_unset(
    tmp_path, mtls_gateway: Gateway, certs: Certs
):
    """STATEHOUSE_CA_FILE and STATEHOUSE_CLIENT_{CERT,KEY}_FILE, as `statehouse lock` reads them."""
    project = tls_project(tmp_path / "p", mtls_gateway, certs)
    project.env["STATEHOUSE_CA_FILE"] = certs.path("ca.pem")
    project.env["STATEHOUSE_CLIENT_CERT_FILE"] = certs.path("client.pem")
    project.env["STATEHOUSE_CLIENT_KEY_FILE"] = certs.path("client.key")
    project.meltano("run", "tap-tiny", "target-tiny", extra_env={"TAP_TINY_COUNT": "2"})
    assert last_id(mtls_gateway) == 2
