"""kube-scheduler's own gang and topology scheduling (Kubernetes 1.37) places a ComputeDomain's pods.

The manifest of examples/gang-podgroup-indexed-job.yaml (a ComputeDomain, a PodGroup with
`gang.minCount` and the clique label as its topology, an Indexed Job whose pods join the PodGroup
by `spec.schedulingGroup.podGroupName`) runs on the real control plane with kube-scheduler's
default configuration: no extender, so nothing of ours steers the placement. A gang that fits
lands whole in one clique and the domain turns Ready; a gang larger than any clique binds no pod
at all, and the domain, its events and the advisor say only that no node has joined.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio.client import ApiClient, CustomObjectsApi

from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import check_store_invariants
from libs.state.store import Store
from tests.e2e import kube
from tests.e2e.harness import CLIQUE_LABEL, REPO_ROOT, E2EEnvironment
from tests.e2e.scenario import (
    delete_cd_and_wait_gone,
    delete_job_and_wait_released,
    wait_cd_ready,
    wait_job_running,
)
from tools.controlplane.cluster import WORKLOAD_SCHEDULING_MINOR

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

EXAMPLE = REPO_ROOT / "examples" / "gang-podgroup-indexed-job.yaml"
SCHEDULING = ("scheduling.k8s.io", "v1beta1", "podgroups")


def fitting(env: E2EEnvironment) -> int:
    """A whole clique: in the session environment's 2 cliques of 4 trays, pods placed without the
    topology constraint would share one clique in 2 * C(4,4) / C(8,4) < 3 % of runs."""
    return env.trays


def gang_objects(path: Path, namespace: str, pods: int) -> dict[str, dict[str, Any]]:
    """The example's ComputeDomain, PodGroup and Job by kind, sized to `pods`, in `namespace`."""
    with open(path) as f:
        docs = {d["kind"]: d for d in yaml.safe_load_all(f) if d}
    cd, group, job = (copy.deepcopy(docs[k]) for k in ("ComputeDomain", "PodGroup", "Job"))
    for obj in (cd, group, job):
        obj["metadata"]["namespace"] = namespace
    cd["spec"]["numNodes"] = pods
    group["spec"]["schedulingPolicy"]["gang"]["minCount"] = pods
    job["spec"]["completions"] = job["spec"]["parallelism"] = pods
    # The kubelet shim's Nodes advertise no nvidia.com/gpu; the channel claim alone gives each pod
    # a node of its own (one channel-0 per node).
    for container in job["spec"]["template"]["spec"]["containers"]:
        container["resources"].pop("limits", None)
    # tests/e2e's helpers find a Job's pods by this label.
    job["spec"]["template"]["metadata"]["labels"]["e2e-job"] = job["metadata"]["name"]
    return {"ComputeDomain": cd, "PodGroup": group, "Job": job}


async def create_gang(api: ApiClient, objects: dict[str, dict[str, Any]]) -> None:
    """CD (and its claim template), then the PodGroup, then the Job, as `kubectl apply` would."""
    cd, group = objects["ComputeDomain"], objects["PodGroup"]
    namespace = cd["metadata"]["namespace"]
    await kube.create_cd(api, cd)
    template = cd["spec"]["channel"]["resourceClaimTemplate"]["name"]
    await kube.eventually(lambda: kube.get_template(api, namespace, template), f"template {template}")
    await CustomObjectsApi(api).create_namespaced_custom_object(
        *SCHEDULING[:2], namespace, SCHEDULING[2], group
    )
    await kube.create_job(api, objects["Job"])


async def get_pod_group(api: ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    group, version, plural = SCHEDULING
    return await kube.raw_get(api, f"/apis/{group}/{version}/namespaces/{namespace}/{plural}/{name}")


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return {}


def explain_gang(env: E2EEnvironment, namespace: str) -> str:
    """The PodGroups' conditions and the scheduler's events in `namespace`, then env.explain()."""
    groups = env.cp.kubectl(
        "get", "podgroups", "-n", namespace, "-o", "jsonpath={.items[*].status.conditions}", check=False
    ).stdout
    events = env.cp.kubectl("get", "events", "-n", namespace, check=False).stdout
    return f"--- podgroups ---\n{groups}\n--- events ---\n{events[-3000:]}\n{env.explain()}"


@pytest.fixture(scope="module")
def native_scheduler(e2e_env: E2EEnvironment) -> Iterator[E2EEnvironment]:
    """The environment with kube-scheduler on its default configuration (no extender) for this
    module; the extender is back for the modules after."""
    if e2e_env.binaries.minor < WORKLOAD_SCHEDULING_MINOR:
        pytest.fail(f"gang scheduling needs Kubernetes 1.{WORKLOAD_SCHEDULING_MINOR}", pytrace=False)
    e2e_env.cp.restart_scheduler(None)
    try:
        yield e2e_env
    finally:
        e2e_env.configure_scheduler()


async def test_a_gang_lands_whole_in_one_clique_and_its_domain_turns_ready(
    native_scheduler: E2EEnvironment, api: ApiClient, e2e_store: Store, namespace: str
) -> None:
    env = native_scheduler
    gang = fitting(env)
    objects = gang_objects(EXAMPLE, namespace, gang)
    cd_name, job = objects["ComputeDomain"]["metadata"]["name"], objects["Job"]["metadata"]["name"]
    template = objects["ComputeDomain"]["spec"]["channel"]["resourceClaimTemplate"]["name"]
    await create_gang(api, objects)

    async def bound() -> bool | None:
        pods = await kube.list_pods(api, namespace, f"e2e-job={job}")
        return True if len(pods) == gang and all(p["spec"].get("nodeName") for p in pods) else None

    await kube.eventually(bound, f"{gang} pods of {job} bound", explain=lambda: explain_gang(env, namespace))
    # Each pod on a node of its own, all in one clique, each with channel-0 of its node.
    formed = await wait_job_running(env, api, namespace, job, gang, template)
    await wait_cd_ready(env, api, namespace, cd_name, formed.nodes)
    for pod in formed.pods:
        assert pod["spec"]["schedulingGroup"] == {"podGroupName": objects["PodGroup"]["metadata"]["name"]}
    group = await get_pod_group(api, namespace, objects["PodGroup"]["metadata"]["name"])
    assert condition(group, "PodGroupInitiallyScheduled").get("status") == "True", group
    assert await check_store_invariants(e2e_store) == []

    await delete_job_and_wait_released(env, api, e2e_store, namespace, job, formed, cd_name)
    await delete_cd_and_wait_gone(env, api, e2e_store, namespace, cd_name, template, formed)


async def test_a_gang_larger_than_any_clique_binds_no_pod_and_nothing_of_ours_says_otherwise(
    native_scheduler: E2EEnvironment, api: ApiClient, e2e_store: Store, namespace: str
) -> None:
    env = native_scheduler
    too_large = env.trays + 1  # every clique has env.trays nodes; the cluster has twice that
    objects = gang_objects(EXAMPLE, namespace, too_large)
    cd_name, job = objects["ComputeDomain"]["metadata"]["name"], objects["Job"]["metadata"]["name"]
    group_name = objects["PodGroup"]["metadata"]["name"]
    await create_gang(api, objects)

    async def refused() -> dict[str, Any] | None:
        cond = condition(await get_pod_group(api, namespace, group_name), "PodGroupInitiallyScheduled")
        return cond if cond.get("status") == "False" else None

    cond = await kube.eventually(refused, f"PodGroup {group_name} found unschedulable", explain=env.explain)
    assert cond["reason"] == "Unschedulable", cond
    # Give the scheduler time for more attempts: still no pod bound, no claim allocated.
    await asyncio.sleep(5)
    pods = await kube.list_pods(api, namespace, f"e2e-job={job}")
    assert len(pods) == too_large
    assert [p["metadata"]["name"] for p in pods if p["spec"].get("nodeName")] == []
    assert all(p["status"].get("phase") == "Pending" for p in pods)
    unschedulable = [condition(p, "PodScheduled") for p in pods]
    assert all(c.get("reason") == "Unschedulable" for c in unschedulable), unschedulable
    claims = await kube.list_claims(api, namespace)
    assert [c["metadata"]["name"] for c in claims if (c.get("status") or {}).get("allocation")] == []
    events = await kube.pod_events(api, namespace, pods[0]["metadata"]["name"])
    messages = [e["message"] for e in events if e.get("reason") == "FailedScheduling"]
    assert messages and all(f"minCount ({too_large}) cannot be satisfied" in m for m in messages), messages

    # The domain: no node joined and it says so; no Ready or failure event; our store agrees.
    cd = await kube.get_cd(api, namespace, cd_name)
    assert cd is not None
    status = cd.get("status") or {}
    assert (status.get("status"), status.get("nodes") or [], status.get("nodeCount", 0)) == (
        "NotReady",
        [],
        0,
    )
    ready = condition(cd, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "WaitingForNodes"), ready
    assert ready["message"] == f"0 of {too_large} node(s) joined", ready
    cd_events = await kube.raw_get(
        api,
        f"/api/v1/namespaces/{namespace}/events?fieldSelector=involvedObject.kind=ComputeDomain,"
        f"involvedObject.name={cd_name}",
    )
    told = [(e["type"], e["reason"]) for e in (cd_events or {}).get("items") or []]
    assert all(kind == "Normal" and reason != "Ready" for kind, reason in told), told
    uid = cd["metadata"]["uid"]
    members, _ = await e2e_store.list(e2e_store.keys.members(uid), pb.Member)
    assert members == []
    # Nothing went through the advisor, so it holds no node for anyone.
    reservations, _ = await e2e_store.list(e2e_store.keys.reservations(), pb.Reservation)
    assert reservations == [], [r.key for r in reservations]
    labels = await kube.node_labels(api)
    assert all("resource.nvidia.com/computeDomain" not in ls for ls in labels.values())
    assert len({ls.get(CLIQUE_LABEL) for ls in labels.values()}) == env.racks

    await kube.delete_job(api, namespace, job)
    await kube.delete_cd(api, namespace, cd_name)

    async def gone() -> bool | None:
        return True if await kube.get_cd(api, namespace, cd_name) is None else None

    await kube.eventually(gone, f"ComputeDomain {namespace}/{cd_name} deleted", explain=env.explain)
