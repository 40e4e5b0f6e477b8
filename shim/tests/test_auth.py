"""The shim sends its token; a gateway with tokens refuses Meltano without one."""

from __future__ import annotations

import json
import uuid

import pytest

from conftest import make_project, start_gateway, stop_gateway

from statehouse_meltano.client import GatewayClient, GatewayError

TOKEN = "worker-token-0123456789"


@pytest.fixture
def guarded_gateway():
    gw = start_gateway(f"shim_{uuid.uuid4().hex}", {"STATEHOUSE_TOKENS": f"write {TOKEN}"})
    yield gw
    stop_gateway(gw)


def test_meltano_with_the_token_reads_and_writes(tmp_path, guarded_gateway):
    project = make_project(tmp_path / "p", guarded_gateway.uri)
    project.env["MELTANO_STATE_BACKEND_STATEHOUSE_TOKEN"] = TOKEN
    project.meltano("state", "set", "--force", "job", json.dumps({"singer_state": {"n": 1}}))
    assert project.state_get("job") == {"singer_state": {"n": 1}}
    stored = guarded_gateway.session.get(
        f"{guarded_gateway.base}/v1/states/job", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    )
    assert stored.json()["completed"] == {"singer_state": {"n": 1}}


def test_meltano_without_a_token_is_refused(tmp_path, guarded_gateway):
    project = make_project(tmp_path / "p", guarded_gateway.uri)
    result = project.meltano("state", "get", "job", check=False)
    assert result.returncode != 0
    assert "401" in result.stdout + result.stderr


def test_statehouse_token_serves_when_meltanos_token_setting_is_unset(tmp_path, guarded_gateway):
    """The runner's STATEHOUSE_TOKEN is enough: one environment for `statehouse lock` and Meltano."""
    guarded_gateway.session.put(
        f"{guarded_gateway.base}/v1/states/seeded",
        json={"completed": {"singer_state": {"n": 2}}, "partial": {}},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    ).raise_for_status()
    project = make_project(tmp_path / "p", guarded_gateway.uri)
    project.env.pop("MELTANO_STATE_BACKEND_STATEHOUSE_TOKEN", None)
    project.env["STATEHOUSE_TOKEN"] = TOKEN
    assert project.meltano("state", "list").stdout.split() == ["seeded"]


def test_meltanos_token_setting_wins_over_statehouse_token(tmp_path, guarded_gateway):
    project = make_project(tmp_path / "p", guarded_gateway.uri)
    project.env["STATEHOUSE_TOKEN"] = TOKEN
    project.env["MELTANO_STATE_BACKEND_STATEHOUSE_TOKEN"] = "not-a-token-of-this-gateway"
    result = project.meltano("state", "list", check=False)
    assert result.returncode != 0
    assert "401" in result.stdout + result.stderr


def test_a_token_file_is_read_again_for_every_request(tmp_path, guarded_gateway):
    """A platform rotates the token in its file: the client sends the file's token of the moment."""
    token_file = tmp_path / "token"
    token_file.write_text("stale-token-0123456789\n")
    client = GatewayClient(guarded_gateway.base, token_file=str(token_file))
    with pytest.raises(GatewayError, match="401"):
        client.get_state("job")
    token_file.write_text(f"{TOKEN}\n")
    client.put_state("job", {"completed": {"singer_state": {"n": 3}}, "partial": {}}, None)
    token_file.write_text("")  # caught mid-replacement: the last token read is sent
    assert client.get_state("job")["completed"] == {"singer_state": {"n": 3}}
    client.close()


def test_meltano_reads_statehouse_token_file(tmp_path, guarded_gateway):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    project = make_project(tmp_path / "p", guarded_gateway.uri)
    project.env.pop("MELTANO_STATE_BACKEND_STATEHOUSE_TOKEN", None)
    project.env["STATEHOUSE_TOKEN_FILE"] = str(token_file)
    project.meltano("state", "set", "--force", "job", json.dumps({"singer_state": {"n": 4}}))
    assert project.state_get("job") == {"singer_state": {"n": 4}}
