"""deploy/kubernetes: both kustomizations (and the examples) render, every
object validates against the Kubernetes 1.31 schemas (strict: no unknown
fields), and the gateway's Deployments keep what the contract asks of them
(design.md, "Deployment"). No cluster is needed."""

import json
import re
import shutil
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kustomize import build, render

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
KUSTOMIZATIONS = ["base", "keeper"]
EXAMPLES = sorted((KUBERNETES / "examples").glob("*.yaml"))
VERSION = "1.31.0"
# The gateway's SIGTERM drain when STATEHOUSE_SHUTDOWN_TIMEOUT is not set.
DEFAULT_SHUTDOWN_SECONDS = 30
UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}


def rendered(name: str) -> list[dict]:
    return render(KUBERNETES / name)


def deployments(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] == "Deployment"]


def env_of(container: dict) -> dict[str, dict]:
    return {var["name"]: var for var in container.get("env", [])}


def seconds(duration: str) -> float:
    """A humantime duration as the manifests write it: `30s`, `1m`, `500ms`."""
    found = re.fullmatch(r"(\d+)(ms|s|m|h)", duration)
    assert found, f"{duration!r}: write durations as <number><ms|s|m|h>"
    return int(found.group(1)) * UNITS[found.group(2)]


def source_env_names() -> set[str]:
    """Every variable the gateway and the commands read (`env = "..."`): the
    runner's connection flags are in `src/client/`, shared with `statehouse wait`."""
    names = set()
    sources = [ROOT / "src" / "config" / "cli.rs"]
    for folder in ("run_lease", "client", "waiter"):
        sources += sorted((ROOT / "src" / folder).glob("*.rs"))
    for path in sources:
        names.update(re.findall(r'env = "(STATEHOUSE_[A-Z0-9_]+)"', path.read_text()))
    return names


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_object_validates_against_kubernetes_1_31(name):
    objects = rendered(name)
    assert objects, f"{name} renders nothing"
    for obj in objects:
        kubernetes_validate.validate(obj, VERSION, strict=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_validates_against_kubernetes_1_31(path):
    for obj in yaml.safe_load_all(path.read_text()):
        if obj:
            kubernetes_validate.validate(obj, VERSION, strict=True)


def test_validation_refuses_a_broken_object():
    """The check above can fail: a probe with a misspelt field does not pass."""
    deployment = deployments(rendered("base"))[0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["httpGet"]["pth"] = container["readinessProbe"]["httpGet"].pop("path")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl to compare the reader with")
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_tests_own_reader_renders_what_kubectl_does(name):
    """Where kubectl is missing the reader renders instead: it must agree."""

    def key(obj):
        return (obj["kind"], obj["metadata"]["name"])

    assert sorted(build(KUBERNETES / name), key=key) == sorted(rendered(name), key=key)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_gateway_deployment_keeps_the_contract(name):
    objects = rendered(name)
    (deployment,) = deployments(objects)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = env_of(container)

    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"

    pod_security = pod["securityContext"]
    security = container["securityContext"]
    assert pod_security["runAsNonRoot"] is True
    assert pod_security["runAsUser"] == 65532
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]

    # Tokens: a file from a Secret volume, so none is in the manifest.
    tokens_file = env["STATEHOUSE_TOKENS_FILE"]["value"]
    mount = next(m for m in container["volumeMounts"] if tokens_file.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert "secret" in volume, f"the tokens file {tokens_file} is not from a Secret"
    assert "STATEHOUSE_TOKENS" not in env, "tokens inline in the manifest"
    # The non-loopback listen address is allowed because tokens are set.
    assert env["STATEHOUSE_LISTEN"]["value"] == "0.0.0.0:8080"
    for secret in ("STATEHOUSE_CLICKHOUSE_URL", "STATEHOUSE_CLICKHOUSE_PASSWORD"):
        assert "secretKeyRef" in env[secret]["valueFrom"], f"{secret} is not from a Secret"

    # A per-pod advertise URL, from the pod's IP, defined before its use.
    names = [var["name"] for var in container["env"]]
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["STATEHOUSE_ADVERTISE_URL"]["value"] == "http://$(POD_IP):8080"
    assert names.index("POD_IP") < names.index("STATEHOUSE_ADVERTISE_URL")

    # SIGTERM comes after the preStop pause; the gateway then drains for its
    # shutdown timeout, all within the grace period.
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    shutdown = DEFAULT_SHUTDOWN_SECONDS
    if "STATEHOUSE_SHUTDOWN_TIMEOUT" in env:
        shutdown = seconds(env["STATEHOUSE_SHUTDOWN_TIMEOUT"]["value"])
    assert pause >= 10, "a preStop pause shorter than a balancer's drain"
    assert pod["terminationGracePeriodSeconds"] > pause + shutdown

    # Several gateways must agree on claims through Keeper.
    if deployment["spec"].get("replicas", 1) > 1:
        assert env.get("STATEHOUSE_COORDINATION", {}).get("value") == "keeper", (
            f"{name}: {deployment['spec']['replicas']} replicas without STATEHOUSE_COORDINATION=keeper"
        )

    unknown = {n for n in names if n.startswith("STATEHOUSE_")} - source_env_names()
    assert not unknown, f"variables the gateway does not read: {sorted(unknown)}"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_services_and_the_budget_select_the_gateways(name):
    objects = rendered(name)
    (deployment,) = deployments(objects)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    assert "clusterIP" not in services["statehouse"]["spec"]
    assert services["statehouse-peers"]["spec"]["clusterIP"] == "None"
    (budget,) = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    for selector in [s["spec"]["selector"] for s in services.values()] + [budget["spec"]["selector"]["matchLabels"]]:
        assert selector.items() <= labels.items()


def test_the_base_runs_one_gateway_and_the_keeper_overlay_three():
    assert deployments(rendered("base"))[0]["spec"]["replicas"] == 1
    assert deployments(rendered("keeper"))[0]["spec"]["replicas"] == 3


def test_the_meltano_cronjob_uses_one_set_of_settings():
    (cronjob,) = [o for o in yaml.safe_load_all((KUBERNETES / "examples" / "meltano-cronjob.yaml").read_text()) if o]
    (container,) = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    env = env_of(container)
    assert container["command"][:2] == ["statehouse", "lock"]
    assert env["MELTANO_STATE_BACKEND_URI"]["value"] == "statehouse://statehouse:8080"
    assert "secretKeyRef" in env["STATEHOUSE_TOKEN"]["valueFrom"]
    # The one set: no runner-only URL, no scheme-specific Meltano token.
    for other in ("STATEHOUSE_URL", "MELTANO_STATE_BACKEND_STATEHOUSE_TOKEN"):
        assert other not in env
    unknown = {n for n in env if n.startswith("STATEHOUSE_")} - source_env_names()
    assert not unknown, f"variables the runner does not read: {sorted(unknown)}"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_gateway_takes_the_clusters_service_account_tokens(name):
    """Workload identity: an issuers file from the ConfigMap, whose issuer's CA
    file and the file itself are mounted where the gateway reads them."""
    objects = rendered(name)
    (deployment,) = deployments(objects)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    path = env_of(container)["STATEHOUSE_JWT_ISSUERS"]["value"]

    def volume_at(file: str) -> dict:
        mount = next(m for m in container["volumeMounts"] if file.startswith(m["mountPath"] + "/"))
        return next(v for v in pod["volumes"] if v["name"] == mount["name"])

    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
    assert volume_at(path)["configMap"]["name"] == config_map["metadata"]["name"]
    issuers = json.loads(config_map["data"][path.rsplit("/", 1)[1]])
    (issuer,) = issuers
    assert issuer["audience"] == "statehouse"
    assert set(issuer["algorithms"]) <= {"RS256", "ES256"}
    assert volume_at(issuer["ca_file"])["configMap"]["name"] == "kube-root-ca.crt"
    assert issuer["bindings"] and all(binding["claims"] for binding in issuer["bindings"])


def test_the_workload_identity_cronjob_presents_a_projected_token():
    objects = [o for o in yaml.safe_load_all((KUBERNETES / "examples" / "meltano-cronjob-workload-identity.yaml").read_text()) if o]
    (cronjob,) = [o for o in objects if o["kind"] == "CronJob"]
    pod = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = env_of(container)
    assert "STATEHOUSE_TOKEN" not in env, "no Secret token: the projected one"
    token_file = env["STATEHOUSE_TOKEN_FILE"]["value"]
    mount = next(m for m in container["volumeMounts"] if token_file.startswith(m["mountPath"] + "/"))
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    (source,) = volume["projected"]["sources"]
    projected = source["serviceAccountToken"]
    assert projected["audience"] == "statehouse"
    assert token_file.endswith("/" + projected["path"])
    (account,) = [o for o in objects if o["kind"] == "ServiceAccount"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    unknown = {n for n in env if n.startswith("STATEHOUSE_")} - source_env_names()
    assert not unknown, f"variables the runner does not read: {sorted(unknown)}"
