"""Job-level gang scheduling (`spec.scheduling`, gate WorkloadWithJob, alpha in 1.37) on a control
plane that opts in: the job controller makes the Workload and PodGroup itself, and it does so for
every Job, which is why tools/controlplane leaves the gate off unless asked."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.polling import wait_until
from tools.controlplane.binaries import Binaries
from tools.controlplane.cluster import WORKLOAD_SCHEDULING_MINOR, ControlPlane
from tools.sim.kubeletshim.nodes import CLIQUE_LABEL

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def with_job(
    control_plane_binaries: Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    if control_plane_binaries.minor < WORKLOAD_SCHEDULING_MINOR:
        pytest.fail(f"WorkloadWithJob needs Kubernetes 1.{WORKLOAD_SCHEDULING_MINOR}", pytrace=False)
    cp = ControlPlane(
        control_plane_binaries, tmp_path_factory.mktemp("workload-with-job"), workload_with_job=True
    )
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


def job(name: str, scheduling: dict[str, Any] | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": 4,
        "parallelism": 4,
        "template": {
            "spec": {"restartPolicy": "Never", "containers": [{"name": "w", "image": "busybox"}]},
        },
    }
    if scheduling is not None:
        spec["scheduling"] = scheduling
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def items(cp: ControlPlane, kind: str) -> list[dict[str, Any]]:
    return list(json.loads(cp.kubectl("get", kind, "-n", "default", "-o", "json").stdout)["items"])


def owned_by(objs: list[dict[str, Any]], job_name: str) -> list[dict[str, Any]]:
    return [o for o in objs if any(r["name"] == job_name for r in o["metadata"].get("ownerReferences") or [])]


def test_the_job_controller_makes_a_pod_group_for_every_job_and_gangs_the_ones_that_ask(
    with_job: ControlPlane, tmp_path: Path
) -> None:
    cp = with_job
    gang = {
        "schedulingPolicy": {"gang": {"minCount": 4}},
        "schedulingConstraints": {"topology": [{"key": CLIQUE_LABEL}]},
    }
    manifest = tmp_path / "jobs.yaml"
    manifest.write_text(yaml.safe_dump_all([job("ganged", gang), job("plain", None)]))
    cp.kubectl("apply", "-f", str(manifest))

    def settled() -> bool:
        pods = items(cp, "pods")
        return len(pods) == 8 and all(
            (p["spec"].get("schedulingGroup") or {}).get("podGroupName") for p in pods
        )

    wait_until(settled, "8 pods, each in a scheduling group", 60, explain=lambda: str(items(cp, "pods")))

    groups = items(cp, "podgroups")
    (ganged,) = owned_by(groups, "ganged")
    assert ganged["spec"]["schedulingPolicy"] == {"gang": {"minCount": 4}}
    assert ganged["spec"]["schedulingConstraints"] == {"topology": [{"key": CLIQUE_LABEL}]}
    # A Job that asked for nothing gets a PodGroup too (basic policy: pod by pod).
    (plain,) = owned_by(groups, "plain")
    assert plain["spec"]["schedulingPolicy"] == {"basic": {}}
    assert len(owned_by(items(cp, "workloads"), "ganged")) == 1
    for pod in items(cp, "pods"):
        group = ganged if pod["metadata"]["name"].startswith("ganged-") else plain
        assert pod["spec"]["schedulingGroup"] == {"podGroupName": group["metadata"]["name"]}
