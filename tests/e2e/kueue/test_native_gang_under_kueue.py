"""Kueue queues a ComputeDomain gang, kube-scheduler's own gang and topology scheduling places it.

The way around Kueue's DRA gap that docs/kueue.md suggests: a ClusterQueue whose flavor has no
topology (Kueue admits by quota only and pins no pod), and the gang of
examples/gang-podgroup-indexed-job.yaml (a PodGroup with `gang.minCount` and the clique as its
topology), which kube-scheduler 1.37 places counting the channel claims. With the channel of half
of one clique's nodes taken by another domain, the same situation in which Kueue's TAS bound half
a gang, the gang lands whole in the other clique and its domain turns Ready.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml
from kubernetes_asyncio.client import ApiClient, CustomObjectsApi

from libs.invariants.checker import check_store_invariants
from libs.state.store import Store
from tests.e2e import kube
from tests.e2e.harness import CLIQUE_LABEL, REPO_ROOT, E2EEnvironment
from tests.e2e.kueue.channel_holders import (
    nodes_by_clique,
    take_channels,
    tear_down,
)
from tests.e2e.kueue.manager import QUEUE_LABEL, KueueManager
from tests.e2e.kueue.queued_job import admitted_workload
from tests.e2e.scenario import wait_cd_ready, wait_job_running

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

GANG_EXAMPLE = REPO_ROOT / "examples" / "gang-podgroup-indexed-job.yaml"
PODGROUPS = ("scheduling.k8s.io", "v1beta1", "podgroups")
QUEUE = "gpu-quota"


def quota_queues(namespace: str) -> list[dict[str, Any]]:
    """A flavor without a topology, a ClusterQueue over it and a LocalQueue in `namespace`."""
    return [
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ResourceFlavor",
            "metadata": {"name": QUEUE},
            "spec": {"nodeLabels": {"nvidia.com/gpu.present": "true"}},
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ClusterQueue",
            "metadata": {"name": QUEUE},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [
                    {
                        "coveredResources": ["nvidia.com/gpu"],
                        "flavors": [
                            {"name": QUEUE, "resources": [{"name": "nvidia.com/gpu", "nominalQuota": 32}]}
                        ],
                    }
                ],
            },
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "LocalQueue",
            "metadata": {"name": QUEUE, "namespace": namespace},
            "spec": {"clusterQueue": QUEUE},
        },
    ]


@pytest.fixture
async def quota_namespace(kueue: KueueManager, namespace: str) -> AsyncIterator[str]:
    kueue.apply(quota_queues(namespace))
    yield namespace
    for kind in ("clusterqueue", "resourceflavor"):
        kueue.cp.kubectl(
            "delete", f"{kind}.kueue.x-k8s.io", QUEUE, "--ignore-not-found", "--wait=false", check=False
        )


def queued_gang(namespace: str, pods: int) -> dict[str, dict[str, Any]]:
    """The gang example's objects by kind, sized to `pods`, its Job queued in QUEUE."""
    docs = {d["kind"]: d for d in yaml.safe_load_all(GANG_EXAMPLE.read_text()) if d}
    objects = {k: copy.deepcopy(docs[k]) for k in ("ComputeDomain", "PodGroup", "Job")}
    for obj in objects.values():
        obj["metadata"]["namespace"] = namespace
    objects["ComputeDomain"]["spec"]["numNodes"] = pods
    objects["PodGroup"]["spec"]["schedulingPolicy"]["gang"]["minCount"] = pods
    job = objects["Job"]
    job["spec"]["completions"] = job["spec"]["parallelism"] = pods
    job["metadata"].setdefault("labels", {})[QUEUE_LABEL] = QUEUE
    job["spec"]["template"]["metadata"]["labels"]["e2e-job"] = job["metadata"]["name"]
    return objects


async def test_kueue_admits_by_quota_and_the_native_gang_lands_whole_in_the_clique_with_free_channels(
    e2e_env: E2EEnvironment, kueue: KueueManager, api: ApiClient, e2e_store: Store, quota_namespace: str
) -> None:
    env, namespace = e2e_env, quota_namespace
    cliques = await nodes_by_clique(env, api)
    crowded, free = sorted(cliques)
    taken = cliques[crowded][: env.trays // 2]
    await take_channels(env, api, namespace, taken)

    pods = env.trays
    objects = queued_gang(namespace, pods)
    cd, group, job = objects["ComputeDomain"], objects["PodGroup"], objects["Job"]
    cd_name, job_name = cd["metadata"]["name"], job["metadata"]["name"]
    template = cd["spec"]["channel"]["resourceClaimTemplate"]["name"]
    await kube.create_cd(api, cd)
    await kube.eventually(lambda: kube.get_template(api, namespace, template), f"template {template}")
    await CustomObjectsApi(api).create_namespaced_custom_object(
        *PODGROUPS[:2], namespace, PODGROUPS[2], group
    )
    await kube.create_job(api, job)

    admitted = await kube.eventually(
        lambda: admitted_workload(api, namespace, job_name), f"Kueue to admit the Workload of Job {job_name}"
    )
    assignment = admitted["status"]["admission"]["podSetAssignments"][0]
    assert assignment["count"] == pods and "topologyAssignment" not in assignment, assignment

    formed = await wait_job_running(env, api, namespace, job_name, pods, template)
    labels = await kube.node_labels(api)
    assert {labels[n][CLIQUE_LABEL] for n in formed.nodes} == {free}, (formed.nodes, taken)
    for pod in formed.pods:
        # Kueue's Job webhook and its unsuspending kept the pod template's gang membership.
        assert pod["spec"].get("schedulingGroup") == {"podGroupName": group["metadata"]["name"]}, pod["spec"]
    await wait_cd_ready(env, api, namespace, cd_name, formed.nodes)
    assert await check_store_invariants(e2e_store) == []

    await tear_down(env, api, namespace, job_name, cd_name, taken)
