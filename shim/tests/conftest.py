"""Fixtures: a real statehouse gateway on the local ClickHouse, a Meltano
project pointed at it, and the real `meltano` CLI to drive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import pytest
import requests
from balancer import Balancer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
import gateway_process  # noqa: E402  (shared with the browser suite)
from gateway_process import free_port  # noqa: E402

PLUGINS = Path(__file__).resolve().parent / "plugins"
MELTANO = Path(sys.executable).parent / "meltano"


def statehouse_bin() -> Path:
    """The gateway's binary, which `statehouse lock` is too (scripts/test sets STATEHOUSE_BIN)."""
    return Path(os.environ.get("STATEHOUSE_BIN", ROOT / "target" / "debug" / "statehouse"))


def lock_prefix(base: str, state_id: str, *flags: str) -> list[str]:
    """`statehouse lock --url BASE FLAGS... STATE_ID --`, to put before a command."""
    return [str(statehouse_bin()), "lock", "--url", base, *flags, state_id, "--"]


@dataclass
class Certs:
    """Throwaway certificates from scripts/make-certs: ca.pem, gateway.*, client.*, other-ca.pem."""

    dir: Path

    @classmethod
    def make(cls, root: Path) -> Certs:
        subprocess.run([str(ROOT / "scripts" / "make-certs"), str(root)], check=True)
        return cls(root)

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def serve_args(self, *, client_ca: bool = False) -> tuple[str, ...]:
        args = ("--tls-cert-file", self.path("gateway.pem"), "--tls-key-file", self.path("gateway.key"))
        return args + (("--tls-client-ca-file", self.path("ca.pem")) if client_ca else ())


@dataclass
class Gateway:
    base: str
    schema: str
    process: subprocess.Popen
    session: requests.Session = field(default_factory=requests.Session)

    @property
    def tls(self) -> dict:
        """Per request: REQUESTS_CA_BUNDLE overrides a Session's own `verify`."""
        return {"verify": self.session.verify}

    @property
    def uri(self) -> str:
        if self.base.startswith("https://"):
            return "statehouses://" + self.base.removeprefix("https://")
        return "statehouse://" + self.base.removeprefix("http://")

    def state(self, state_id: str) -> dict | None:
        response = self.session.get(f"{self.base}/v1/states/{quote(state_id, safe='')}", timeout=10, **self.tls)
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json()

    def state_ids(self, pattern: str = "*") -> list[str]:
        response = self.session.get(
            f"{self.base}/v1/states", params={"pattern": pattern, "limit": 1000}, timeout=10, **self.tls
        )
        response.raise_for_status()
        return [s["state_id"] for s in response.json()["states"]]

    def put(self, state_id: str, document: dict) -> None:
        response = self.session.put(
            f"{self.base}/v1/states/{quote(state_id, safe='')}", json=document, timeout=10, **self.tls
        )
        response.raise_for_status()


def start_gateway(
    schema: str,
    extra_env: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
    advertise: bool = False,
    certs: Certs | None = None,
    client_ca: bool = False,
) -> Gateway:
    """A gateway process; with `advertise`, peers can forward to it (--advertise-url);
    with `certs`, it serves HTTPS (requiring client certificates with `client_ca`)."""
    clickhouse = os.environ.get("STATEHOUSE_TEST_CLICKHOUSE_URL")
    if not clickhouse:
        pytest.fail("STATEHOUSE_TEST_CLICKHOUSE_URL is not set: run the tests with scripts/test")
    env = {**os.environ, "STATEHOUSE_CLICKHOUSE_URL": clickhouse, "RUST_LOG": "warn,statehouse=info", **(extra_env or {})}
    scheme = "https" if certs else "http"
    session = requests.Session()
    tls_args: tuple[str, ...] = ()
    if certs:
        tls_args = certs.serve_args(client_ca=client_ca)
        session.verify = certs.path("ca.pem")
        session.cert = (certs.path("client.pem"), certs.path("client.key"))

    def command(port: int) -> list[str]:
        args = [str(statehouse_bin()), "serve", "--listen", f"127.0.0.1:{port}", "--schema", schema, "--claim-settle", "200ms"]
        if advertise:
            args += ["--advertise-url", f"{scheme}://127.0.0.1:{port}"]
        return [*args, *tls_args, *extra_args]

    try:
        process, port = gateway_process.spawn(command, env)
        base = f"{scheme}://127.0.0.1:{port}"
        gateway_process.await_readyz(process, f"{base}/readyz", session.get, verify=session.verify)
    except gateway_process.NotReady as err:
        pytest.fail(str(err))
    return Gateway(base=base, schema=schema, process=process, session=session)


@pytest.fixture
def gateway():
    gw = start_gateway(f"shim_{uuid.uuid4().hex}")
    yield gw
    stop_gateway(gw)


@dataclass
class Cluster:
    """Gateways on one schema behind a per-request round-robin balancer."""

    gateways: list[Gateway]
    balancer: Balancer

    @property
    def uri(self) -> str:
        return "statehouse://" + self.balancer.base.removeprefix("http://")

    def requests_served(self, gateway: Gateway) -> int:
        """API requests one gateway answered, by its own /metrics."""
        metrics = gateway.session.get(f"{gateway.base}/metrics", timeout=10).text
        return sum(
            int(float(line.rsplit(" ", 1)[1]))
            for line in metrics.splitlines()
            if line.startswith("statehouse_http_requests_total{") and 'route="/v1/' in line
        )


def start_cluster(size: int) -> Cluster:
    schema = f"shim_{uuid.uuid4().hex}"
    gateways = [start_gateway(schema, advertise=True) for _ in range(size)]
    return Cluster(gateways=gateways, balancer=Balancer([g.base for g in gateways]))


def stop_gateway(gateway: Gateway) -> None:
    gateway.process.terminate()
    gateway.process.wait(timeout=30)


@pytest.fixture
def cluster():
    three = start_cluster(3)
    yield three
    three.balancer.stop()
    for gateway in three.gateways:
        stop_gateway(gateway)


@dataclass
class Project:
    root: Path
    env: dict[str, str]

    def meltano(
        self,
        *args: str,
        check: bool = True,
        timeout: float = 180,
        extra_env: dict | None = None,
        prefix: tuple[str, ...] | list[str] = (),
    ):
        """Runs `meltano ARGS...`, after `prefix` (e.g. a `statehouse lock ... --`) if given."""
        result = subprocess.run(
            [*prefix, str(MELTANO), *args],
            cwd=self.root,
            env={**self.env, **(extra_env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            pytest.fail(f"meltano {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result

    def popen(
        self, *args: str, extra_env: dict | None = None, prefix: tuple[str, ...] | list[str] = ()
    ) -> subprocess.Popen:
        return subprocess.Popen(
            [*prefix, str(MELTANO), *args],
            cwd=self.root,
            env={**self.env, **(extra_env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def state_get(self, state_id: str) -> dict:
        return json.loads(self.meltano("state", "get", state_id).stdout.strip().splitlines()[-1])


MELTANO_YML = """\
default_environment: dev
project_id: {project_id}
send_anonymous_usage_stats: false
environments:
- name: dev
plugins:
  extractors:
  - name: tap-tiny
    namespace: tap_tiny
    executable: {tap}
    capabilities: [state]
  loaders:
  - name: target-tiny
    namespace: target_tiny
    executable: {target}
"""


def make_project(root: Path, uri: str) -> Project:
    root.mkdir(parents=True, exist_ok=True)
    (root / "meltano.yml").write_text(
        MELTANO_YML.format(
            project_id=uuid.uuid4(),
            tap=PLUGINS / "tap_tiny.py",
            target=PLUGINS / "target_tiny.py",
        )
    )
    env = {
        **os.environ,
        "MELTANO_STATE_BACKEND_URI": uri,
        "MELTANO_SEND_ANONYMOUS_USAGE_STATS": "false",
        "TAP_TINY_LOG": str(root / "tap.log"),
        "TARGET_TINY_OUTPUT": str(root / "records.jsonl"),
    }
    return Project(root=root, env=env)


@pytest.fixture
def project(tmp_path: Path, gateway: Gateway) -> Project:
    return make_project(tmp_path / "project", gateway.uri)
