"""The ComputeDomain and Job of integrations/kueue/computedomain-job.yaml as a test submits them, and
what Kueue made of the Job (its Workload)."""

from __future__ import annotations

import copy
from typing import Any

import yaml
from kubernetes_asyncio.client import ApiClient

from tests.e2e import kube
from tests.e2e.harness import REPO_ROOT

EXAMPLE = REPO_ROOT / "integrations" / "kueue" / "computedomain-job.yaml"
WORKLOADS = "/apis/kueue.x-k8s.io/v1beta2/namespaces/{namespace}/workloads"


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
