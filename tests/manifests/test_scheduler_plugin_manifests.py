"""cd-scheduler's deployment: manifests/components/scheduler-plugin and the chart's
schedulerPlugin values render the same objects; the chart renders none by default; the
component's configuration is the one tests/e2e/test_scheduler_plugin.py runs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from tests.manifests.helm import render
from tests.manifests.objects import NAMESPACE, REPO_ROOT, Obj

COMPONENT = REPO_ROOT / "manifests" / "components" / "scheduler-plugin" / "cd-scheduler.yaml"
CHART_IMAGE = "ghcr.io/example/computedomains-scheduler:dev"


def component() -> list[Obj]:
    return [d for d in yaml.safe_load_all(COMPONENT.read_text()) if d]


def key(obj: Obj) -> tuple[str, str, str]:
    return (obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"])


def comparable(obj: Obj) -> dict[str, Any]:
    """An object without what only one side sets: Helm's labels, the pull policy, the image name
    (the component's is replaced by its kustomization's `images:`)."""
    out = {k: copy.deepcopy(v) for k, v in obj.items() if k != "metadata"}
    if obj["kind"] == "Deployment":
        for c in out["spec"]["template"]["spec"]["containers"]:
            c.pop("imagePullPolicy", None)
            c.pop("image", None)
    if obj["kind"] == "ConfigMap":
        out["data"] = {k: yaml.safe_load(v) for k, v in out["data"].items()}
    return out


def test_the_chart_renders_the_components_objects(helm: Path, tmp_path: Path) -> None:
    rendered = render(helm, NAMESPACE, {"schedulerPlugin": {"enabled": True}}, tmp_path)
    ours = {
        key(o): o
        for o in rendered
        if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "scheduler"
    }
    wanted = {key(o): o for o in component()}
    assert sorted(ours) == sorted(wanted)
    for k, obj in wanted.items():
        assert comparable(ours[k]) == comparable(obj), k
    deployment = ours[("Deployment", NAMESPACE, "cd-scheduler")]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == CHART_IMAGE


def test_the_chart_renders_no_scheduler_by_default(helm: Path) -> None:
    rendered = render(helm, NAMESPACE)
    assert [key(o) for o in rendered if "cd-scheduler" in o["metadata"]["name"]] == []


def test_the_scheduler_is_a_client_the_advisors_network_policy_admits() -> None:
    policy = yaml.safe_load(
        (REPO_ROOT / "manifests" / "base" / "placement-advisor-networkpolicy.yaml").read_text()
    )
    grpc_rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == "grpc")
    admitted = grpc_rule["from"][0]["podSelector"]["matchLabels"]
    deployment = next(o for o in component() if o["kind"] == "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert admitted.items() <= labels.items()
    config = yaml.safe_load(next(o for o in component() if o["kind"] == "ConfigMap")["data"]["config.yaml"])
    args = config["profiles"][0]["pluginConfig"][0]["args"]
    assert args["advisorAddress"] == f"cd-placement-advisor.{NAMESPACE}.svc:50051"
