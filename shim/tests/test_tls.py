"""statehouses://: Meltano over HTTPS to a TLS gateway, with the CA and
client certificate settings, or the system's trust store; never requests'
own bundles (REQUESTS_CA_BUNDLE, certifi)."""

from __future__ import annotations

import uuid

import pytest
import truststore

from conftest import Certs, Gateway, Project, make_project, start_gateway, stop_gateway
from statehouse_meltano.client import SystemTrustAdapter

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
    # requests would trust this bundle; the shim must not.
    project.env["REQUESTS_CA_BUNDLE"] = certs.path("other-ca.pem")
    # The system store is the host's own, which never holds a test CA, unless
    # a test points OpenSSL's SSL_CERT_FILE at one.
    for name in ("SSL_CERT_FILE", "SSL_CERT_DIR", "STATEHOUSE_CA_FILE"):
        project.env.pop(name, None)
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


def test_a_ca_only_the_system_store_holds_is_trusted_without_a_ca_file(
    tmp_path, tls_gateway: Gateway, certs: Certs
):
    """SSL_CERT_FILE stands in for a CA installed on the host: OpenSSL's system
    store honours it, as truststore on Linux does; requests' certifi does not."""
    project = tls_project(tmp_path / "p", tls_gateway, certs)
    # Trusted by requests, not by the shim: the run fails without the system's CA.
    project.env["REQUESTS_CA_BUNDLE"] = certs.path("ca.pem")
    refused = project.meltano("run", "tap-tiny", "target-tiny", check=False, extra_env={"TAP_TINY_COUNT": "2"})
    assert refused.returncode != 0
    assert "certificate" in refused.stdout + refused.stderr
    assert tls_gateway.state(JOB) is None

    project.env["SSL_CERT_FILE"] = certs.path("ca.pem")
    project.meltano("run", "tap-tiny", "target-tiny", extra_env={"TAP_TINY_COUNT": "2"})
    assert last_id(tls_gateway) == 2


def test_a_ca_file_is_the_only_ca_trusted_even_over_the_system_store(tmp_path, tls_gateway: Gateway, certs: Certs):
    project = tls_project(tmp_path / "p", tls_gateway, certs)
    project.env["SSL_CERT_FILE"] = certs.path("ca.pem")
    project.env["MELTANO_STATE_BACKEND_STATEHOUSES_CA_FILE"] = certs.path("other-ca.pem")
    refused = project.meltano("state", "list", check=False)
    assert refused.returncode != 0
    output = refused.stdout + refused.stderr
    assert "certificate" in output, output


def test_the_system_store_holds_through_an_https_proxy_too():
    adapter = SystemTrustAdapter()
    proxied = adapter.proxy_manager_for("http://127.0.0.1:3128")
    assert proxied.connection_pool_kw["ssl_context"] is adapter.poolmanager.connection_pool_kw["ssl_context"]
    assert isinstance(proxied.connection_pool_kw["ssl_context"], truststore.SSLContext)
