"""What the Kueue tests submit: the queues of integrations/kueue/queues.yaml, the ComputeDomain and
Job of integrations/kueue/computedomain-job.yaml; and what Kueue made of the Job (its Workload)."""

from __future__ import annotations

import copy
from typing import Any

import yaml
from kubernetes_asyncio.client import ApiClient

from tests.e2e import kube
from tests.e2e.harness import REPO_ROOT

QUEUES = REPO_ROOT / "integrations" / "kueue" / "queues.yaml"
EXAMPLE = REPO_ROOT / "integrations" / "kueue" / "computedomain-job.yaml"
WORKLOADS = "/apis/kueue.x-k8s.io/v1beta2/namespaces/{namespace}/workloads"


def queue_objects() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(QUEUES.read_text()) if d]


def cluster_queue_objects() -> list[dict[str, Any]]:
    """Topology, ResourceFlavor and ClusterQueue (the LocalQueue is per namespace)."""
    return [o for o in queue_objects() if o["kind"] != "LocalQueue"]


def local_queue(namespace: str) -> dict[str, Any]:
    queue = next(o for o in queue_objects() if o["kind"] == "LocalQueue")
    queue["metadata"]["namespace"] = namespace
    return queue


def queued_job(namespace: str, pods: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The example's ComputeDomain and Job in `namespace`, sized to `pods`."""
    docs = {d["kind"]: d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d}
    cd, job = copy.deepcopy(docs["ComputeDomain"]), copy.deepcopy(docs["Job"])
    for obj in (cd, job):
        obj["metadata"]["namespace"] = namespace
    cd["spec"]["numNodes"] = pods
    job["spec"]["completions"] = job["spec"]["parallelism"] = pods
    # tests/e2e's helpers find a Job's pods by this label.
    job["spec"]["template"]["metadata"]["labels"]["e2e-job"] = job["metadata"]["name"]
    return cd, job


async def submit(api: ApiClient, cd: dict[str, Any], job: dict[str, Any]) -> None:
    """The ComputeDomain (and its claim template), then the Job, as `kubectl apply` would."""
    namespace = cd["metadata"]["namespace"]
    await kube.create_cd(api, cd)
    template = cd["spec"]["channel"]["resourceClaimTemplate"]["name"]
    await kube.eventually(lambda: kube.get_template(api, namespace, template), f"template {template}")
    await kube.create_job(api, job)


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return {}


async def job_workload(api: ApiClient, namespace: str, job: str) -> dict[str, Any] | None:
    """Kueue's Workload owned by Job `job` (None while there is none)."""
    listing = await kube.raw_get(api, WORKLOADS.format(namespace=namespace))
    for workload in (listing or {}).get("items") or []:
        owners = workload["metadata"].get("ownerReferences") or []
        if any(o.get("kind") == "Job" and o.get("name") == job for o in owners):
            return dict(workload)
    return None


async def admitted_workload(api: ApiClient, namespace: str, job: str) -> dict[str, Any] | None:
    workload = await job_workload(api, namespace, job)
    return workload if condition(workload, "Admitted").get("status") == "True" else None


def assigned_pods(topology_assignment: dict[str, Any]) -> dict[tuple[str, ...], int]:
    """Kueue v1beta2's compressed TopologyAssignment as {domain (one value per level): pod count}.

    Each slice lists `domainCount` domains; per level its values are either one `universal` value
    or `individual` ones (`prefix` + root + `suffix`); its pod counts are one `universal` count or
    `individual` ones. Pure."""
    levels = topology_assignment.get("levels") or []
    result: dict[tuple[str, ...], int] = {}
    for piece in topology_assignment.get("slices") or []:
        count = int(piece["domainCount"])
        columns = []
        for values in piece["valuesPerLevel"]:
            if "universal" in values:
                columns.append([values["universal"]] * count)
            else:
                each = values["individual"]
                prefix, suffix = each.get("prefix", ""), each.get("suffix", "")
                columns.append([f"{prefix}{root}{suffix}" for root in each["roots"]])
        counts = piece["podCounts"]
        pods = (
            [int(counts["universal"])] * count
            if "universal" in counts
            else [int(c) for c in counts["individual"]]
        )
        if len(columns) != len(levels) or any(len(c) != count for c in [*columns, pods]):
            raise ValueError(f"malformed topology assignment slice {piece} for levels {levels}")
        for i in range(count):
            domain = tuple(column[i] for column in columns)
            result[domain] = result.get(domain, 0) + pods[i]
    return result
