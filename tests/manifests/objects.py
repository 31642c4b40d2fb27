"""Looking things up in rendered manifests: objects, containers, their flags and mounts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = REPO_ROOT / "manifests"
TREES = {
    "base": MANIFESTS / "base",
    "production": MANIFESTS / "overlays" / "production",
    "sim": MANIFESTS / "overlays" / "sim",
}
NAMESPACE = "compute-domains-system"
IMAGE = "ghcr.io/example/computedomains:dev"
# Each workload's priority class: workloads never preempt the node programs or the control side.
PRIORITY_CLASSES = {
    "cd-controller": "system-cluster-critical",
    "cd-placement-advisor": "system-cluster-critical",
    "cd-node-agent": "system-node-critical",
    "cd-imex-agent": "system-node-critical",
}

Obj = dict[str, Any]


def find(objects: list[Obj], kind: str, name: str) -> Obj:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def pod_spec(workload: Obj) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: Obj, name: str | None = None) -> dict[str, Any]:
    containers = pod_spec(workload)["containers"]
    if name is None:
        assert len(containers) == 1, f"{workload['metadata']['name']} has {len(containers)} containers"
        result: dict[str, Any] = containers[0]
        return result
    return next(c for c in containers if c["name"] == name)


_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def env_values(c: dict[str, Any]) -> dict[str, str]:
    """Env as kubelet would see it: literal values, and `<fieldPath>` for downward-API fields."""
    values = {}
    for var in c.get("env") or []:
        if "value" in var:
            values[var["name"]] = str(var["value"])
        elif "fieldRef" in (var.get("valueFrom") or {}):
            values[var["name"]] = f"<{var['valueFrom']['fieldRef']['fieldPath']}>"
        else:
            values[var["name"]] = f"<{var['name']}>"
    return values


def undefined_references(c: dict[str, Any]) -> list[str]:
    """`$(VAR)` references in command/args with no such env var (kubelet leaves them literal)."""
    defined = env_values(c)
    words = list(c.get("command") or []) + list(c.get("args") or [])
    return sorted({m for w in words for m in _VAR_REF.findall(w) if m not in defined})


def flags(c: dict[str, Any]) -> dict[str, str]:
    """`--name=value` args of a container, `$(VAR)` expanded; every flag must appear once."""
    defined = env_values(c)
    result: dict[str, str] = {}
    for arg in c.get("args") or []:
        assert arg.startswith("--") and "=" in arg, f"flag {arg!r} is not in --name=value form"
        name, _, value = arg.partition("=")
        assert name not in result, f"flag {name} given twice"
        result[name] = _VAR_REF.sub(lambda m: defined.get(m.group(1), m.group(0)), value)
    return result


def mounts(workload: Obj, c: dict[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """mountPath -> (volumeMount, volume)."""
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes") or []}
    for claim in workload["spec"].get("volumeClaimTemplates") or []:
        volumes[claim["metadata"]["name"]] = {"name": claim["metadata"]["name"], "volumeClaimTemplate": claim}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in c.get("volumeMounts") or []}


def host_path_mounts(workload: Obj, c: dict[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """host path -> (volumeMount, volume) for hostPath volumes."""
    return {
        volume["hostPath"]["path"]: (mount, volume)
        for mount, volume in mounts(workload, c).values()
        if "hostPath" in volume
    }
