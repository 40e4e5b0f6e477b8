"""Renders a kustomization: with `kubectl kustomize` when kubectl is on PATH,
else with `build` below, a reader of exactly the kustomize features the
manifests under deploy/kubernetes use (resources, replicas, inline JSON 6902
patches that add). Anything else in a kustomization is refused,
so a manifest that outgrows the reader fails here instead of rendering wrong.
"""

import copy
import shutil
import subprocess
from pathlib import Path

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "resources", "replicas", "patches"}


def render(directory: Path) -> list[dict]:
    """The objects `directory`'s kustomization produces."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return build(directory)
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)], check=True, capture_output=True, text=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def build(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KNOWN_KEYS
    if unknown:
        raise ValueError(f"{directory}: the test's reader does not do {sorted(unknown)}")
    objects: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        if path.is_dir():
            objects.extend(build(path))
        else:
            objects.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    for replicas in kustomization.get("replicas", []):
        matches = [
            o for o in objects if o["metadata"]["name"] == replicas["name"] and "replicas" in o.get("spec", {})
        ]
        if len(matches) != 1:
            raise ValueError(f"{directory}: replicas for {replicas['name']} match {len(matches)} objects")
        matches[0]["spec"]["replicas"] = replicas["count"]
    for patch in kustomization.get("patches", []):
        if set(patch) != {"target", "patch"}:
            raise ValueError(f"{directory}: the test's reader does only inline patches with a target")
        targets = [o for o in objects if all(_field(o, k) == v for k, v in patch["target"].items())]
        if len(targets) != 1:
            raise ValueError(f"{directory}: patch target {patch['target']} matches {len(targets)} objects")
        for op in yaml.safe_load(patch["patch"]):
            _apply(targets[0], op)
    return objects


def _field(obj: dict, key: str):
    if key == "kind":
        return obj["kind"]
    if key == "name":
        return obj["metadata"]["name"]
    raise ValueError(f"the test's reader does not select patch targets by {key}")


def _apply(obj: dict, op: dict) -> None:
    """One JSON patch (RFC 6902) operation: `add`, to a list's end (`/-`) or a
    mapping's key."""
    if op["op"] != "add":
        raise ValueError(f"the test's reader does not do the patch operation {op['op']}")
    *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in op["path"].split("/")[1:]]
    node = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    value = copy.deepcopy(op["value"])
    if isinstance(node, list):
        if last != "-":
            raise ValueError(f"the test's reader adds to a list's end only, not {op['path']}")
        node.append(value)
    else:
        node[last] = value
