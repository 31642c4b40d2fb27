"""The soak's jobs in Kubernetes mode: a ComputeDomain and an Indexed Job claiming its channel,
applied through the API server as a user does, watched through the API server and the store.

A job is formed when every one of its pods runs (no deletion pending) and its domain's record is
Ready; its workload then imports memory between the members (`tools.cdsim.workload`), which
invariant 6 checks while it runs. Deleting it deletes the Job (its pods and their claims follow)
and the ComputeDomain; it is gone when the API server has neither and the store no domain record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from tests.e2e import kube
from tests.e2e.harness import example_compute_domain
from tools.cdsim.job_book import Importer

JOB_LABEL = "e2e-job"
# Pods tolerate a not-ready or unreachable node as long as upstream's default (300 s), not the
# environment's shortened default: a kubelet or API server restart must not evict them. A node
# lost for good is declared so by the out-of-service taint, which evicts at once.
TOLERATION_S = 300
# The Job replaces evicted pods (each eviction counts as a failure) this often at most.
BACKOFF_LIMIT = 6


@dataclass
class KubeJob:
    name: str
    namespace: str
    size: int
    state: str = "forming"  # forming | running | deleting | gone
    cd_uid: str = ""
    pods: dict[str, str] = field(default_factory=dict)  # pod uid -> node, when it formed
    claim_uids: set[str] = field(default_factory=set)  # every claim it prepared, replacements too
    importers: tuple[Importer, ...] = ()
    armed_s: float = 0.0  # since when faults count against its imports
    exempt: str = ""  # the fault that may have broken its imports since armed_s

    @property
    def template(self) -> str:
        return f"{self.name}-channel"

    def describe(self) -> str:
        return f"{self.namespace}/{self.name} ({self.size} pods)"


def manifests(job: KubeJob) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ComputeDomain (numNodes = the job's size) and the Indexed Job of `job`."""
    cd = example_compute_domain("imex-compute-domain.yaml", job.name, job.template, job.namespace)
    cd["spec"]["numNodes"] = job.size
    batch = kube.indexed_job(job.name, job.namespace, job.template, pods=job.size, size_hint=job.size)
    batch["spec"]["backoffLimit"] = BACKOFF_LIMIT
    batch["spec"]["template"]["spec"]["tolerations"] = [
        {"key": taint, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": TOLERATION_S}
        for taint in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
    ]
    return cd, batch


async def submit(api: ApiClient, job: KubeJob) -> None:
    """Create the ComputeDomain, wait for its claim template, create the Job. Idempotent: a call
    again after an error keeps what the first one created."""
    cd, batch = manifests(job)
    if not job.cd_uid:
        try:
            job.cd_uid = (await kube.create_cd(api, cd))["metadata"]["uid"]
        except ApiException as exc:
            existing = await kube.get_cd(api, job.namespace, job.name) if exc.status == 409 else None
            if existing is None:
                raise
            job.cd_uid = existing["metadata"]["uid"]
    await kube.eventually(
        lambda: kube.get_template(api, job.namespace, job.template),
        f"ResourceClaimTemplate of {job.describe()}",
    )
    try:
        await kube.create_job(api, batch)
    except ApiException as exc:
        if exc.status != 409:
            raise


async def running_pods(api: ApiClient, job: KubeJob) -> list[dict[str, Any]]:
    """The job's pods that run and are not being deleted."""
    pods = await kube.list_pods(api, job.namespace, f"{JOB_LABEL}={job.name}")
    return [p for p in pods if kube.is_running(p) and not p["metadata"].get("deletionTimestamp")]


async def domain_ready(store: Store, cd_uid: str) -> bool:
    found = await store.get(store.keys.domain(cd_uid), pb.ComputeDomain)
    return found is not None and found.value.status.status == pb.Readiness.READY


async def formed(api: ApiClient, store: Store, job: KubeJob) -> dict[str, str] | None:
    """Pod uid -> node when every pod of the job runs and its domain is Ready; else None. The
    claims of the running pods are added to the job's."""
    pods = await running_pods(api, job)
    if len(pods) != job.size or not await domain_ready(store, job.cd_uid):
        return None
    for pod in pods:
        for status in pod["status"].get("resourceClaimStatuses") or []:
            claim = await kube.get_claim(api, job.namespace, status["resourceClaimName"])
            if claim is not None:
                job.claim_uids.add(claim["metadata"]["uid"])
    return {p["metadata"]["uid"]: p["spec"]["nodeName"] for p in pods}


async def delete(api: ApiClient, job: KubeJob) -> None:
    """Delete the Job (its pods in the background) and the ComputeDomain."""
    try:
        await kube.delete_job(api, job.namespace, job.name)
    except ApiException as exc:
        if exc.status != 404:
            raise
    await kube.delete_cd(api, job.namespace, job.name)


async def gone(api: ApiClient, store: Store, job: KubeJob) -> bool:
    """No pod, no ComputeDomain in the API server, no domain record in the store."""
    if await kube.list_pods(api, job.namespace, f"{JOB_LABEL}={job.name}"):
        return False
    if await kube.get_cd(api, job.namespace, job.name) is not None:
        return False
    return await store.get(store.keys.domain(job.cd_uid), pb.ComputeDomain) is None
