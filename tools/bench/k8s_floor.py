"""Kubernetes' own time for a Job: the floor of the formation benchmark (tools/bench/formation_k8s.py).

The same Indexed Job of N pods on the same control plane, scheduler (its extender included, as
shipped: kube-scheduler asks it about every pod) and kubelet shim nodes, but without a
ComputeDomain: its pods claim nothing. From creating the Job until every pod is Running (seen
through a watch), then the Job is deleted and its pods' end awaited. A formation cannot take less
than this; the ratio of the two is the cost of the ComputeDomain.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tools.bench.audit_log import stages

if TYPE_CHECKING:
    from tools.bench.formation_k8s import Driver


@dataclass
class PlainJob:
    running_s: float  # t0 -> every pod Running
    scheduled_s: float  # t0 -> the last pod bound to a node
    nodes_used: int  # distinct nodes the pods landed on
    # When each kind of API write happened (from the audit log), as for the formation.
    write_stages: dict[str, list[float]]
    teardown_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in vars(self).items()}


def plain_job_object(name: str, namespace: str, pods: int) -> dict[str, Any]:
    """The formation's Indexed Job (all pods at once) without its claim."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "completionMode": "Indexed",
            "completions": pods,
            "parallelism": pods,
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {"bench-job": name}},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "worker", "image": "busybox", "command": ["sleep", "infinity"]}],
                },
            },
        },
    }


async def run_plain_job(driver: Driver, namespace: str, rep: int, timeout_s: float) -> PlainJob:
    """Create the plain Job, wait for all its pods Running, delete it and wait for its pods' end."""
    from tools.bench.formation_k8s import pod_running

    job = f"plain-{rep}"
    pods_wanted = driver.nodes
    scheduled: dict[str, float] = {}
    running: dict[str, float] = {}
    nodes: set[str] = set()
    done = asyncio.Event()

    def on_pod(pod: dict[str, Any]) -> None:
        name = (pod.get("metadata") or {}).get("name", "")
        now = time.perf_counter()
        node = (pod.get("spec") or {}).get("nodeName")
        if node:
            scheduled.setdefault(name, now)
            nodes.add(node)
        if pod_running(pod):
            running.setdefault(name, now)
        if len(running) >= pods_wanted:
            done.set()

    lister = functools.partial(driver.core.list_namespaced_pod, namespace, label_selector=f"bench-job={job}")
    watcher = asyncio.create_task(driver.follow(lister, on_pod))
    try:
        await asyncio.sleep(0.2)  # the watch open before t0
        t0, t0_wall = time.perf_counter(), time.time()
        await driver.batch.create_namespaced_job(
            namespace, plain_job_object(job, namespace, pods_wanted), _request_timeout=30
        )
        finished = asyncio.ensure_future(done.wait())
        try:
            await asyncio.wait({finished, watcher}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            finished.cancel()
        if not done.is_set():
            raise RuntimeError(
                f"{await driver.why_unbound(job)}\nplain Job {rep} not done: "
                f"{len(scheduled)}/{pods_wanted} pods bound, {len(running)}/{pods_wanted} Running"
            )
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    result = PlainJob(
        running_s=max(running.values()) - t0,
        scheduled_s=max(scheduled.values()) - t0,
        nodes_used=len(nodes),
        write_stages=stages(driver.audit.between(t0_wall, time.time()), t0_wall),
    )
    began = time.perf_counter()
    await driver.batch.delete_namespaced_job(
        job, namespace, propagation_policy="Background", _request_timeout=30
    )
    pods = f"/api/v1/namespaces/{namespace}/pods?labelSelector=bench-job%3D{job}"

    async def gone() -> bool:
        return not ((await driver.get(pods) or {}).get("items") or [])

    await driver.until(f"pods of {job} gone", gone, timeout_s)
    result.teardown_s = time.perf_counter() - began
    return result
