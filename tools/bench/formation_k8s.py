"""Benchmark: a ComputeDomain and an Indexed Job of N pods formed on a real Kubernetes control plane.

Set-up (tools/bench/k8s_env.py): kube-apiserver (auditing every write), kube-scheduler with the
placement advisor's extender, kube-controller-manager; our etcd, a `cd-controller` in Kubernetes
mode and the advisor; the kubelet shim playing kubelet for N nodes of simulated NVL72 racks, whose
IMEX agents and kubelet plugins run in scale-mode hosts in Kubernetes mode (claims read from the
API server, a ResourceSlice and clique label per node). This process plays the user.

One formation:

1. the ComputeDomain (numNodes N) is created and the controller's ResourceClaimTemplate awaited;
2. t0: the Job is created (Indexed, N completions, all in parallel, each pod claiming the
   domain's channel through the template). The Job controller makes the pods, the resourceclaim
   controller their claims, kube-scheduler places them (the extender keeps the domain in as few
   cliques as fit) and allocates each claim a node's channel; the shim calls NodePrepareResources
   on each pod's node and marks the pod Running once it answered;
3. done when every pod is Running (its claim prepared) and the ComputeDomain's status says Ready
   with N nodes, both seen through watches on the API server.

Before each formation, Kubernetes' own time for the same Job without a ComputeDomain (its pods
claim nothing; tools/bench/k8s_floor.py): the floor, and the formation's ratio to it.

Reported: the formation time (t0 to both), the times of its stages, and the API server writes our
components (cd-controller, the node agents) made from the ComputeDomain's creation until the
formation was done and the writes settled, per node (from the audit log; everyone else's beside).
Between repetitions the Job and then the ComputeDomain are deleted and their teardown awaited.

    python -m tools.bench.formation_k8s [--nodes 256 --racks 15] [--reps 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client import ApiClient, BatchV1Api, Configuration, CoreV1Api, CustomObjectsApi
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config import load_kube_config

from libs.gen.computedomain.state import v1 as pb
from libs.kube.resource_api import discover_version, resource_path
from libs.state.config import EtcdConfig
from libs.state.store import Store
from tools.bench import simenv
from tools.bench.audit_log import BENCH_USER_AGENT, AuditReader, stages, summarize
from tools.bench.k8s_env import KubeEnvironment, KubeSettings
from tools.bench.k8s_floor import run_plain_job
from tools.cdsim import proc_scan
from tools.controlplane.binaries import ensure_binaries
from tools.sim.kubeletshim.api_json import read_json, watch_events

TARGET_S = 30.0
TARGET_WRITES_PER_NODE = 2.0
NAMESPACE = "bench"
GROUP, VERSION, PLURAL = "resource.nvidia.com", "v1beta1", "computedomains"
_FORMATION_TIMEOUT_S = 600.0
_TEARDOWN_TIMEOUT_S = 600.0
_REQUEST_TIMEOUT_S = 30.0
# After the formation, our components' last writes (labels, the status's last word) land within this.
_SETTLE_S = 3.0


@dataclass
class Formation:
    formation_s: float  # t0 -> every pod Running and the domain Ready
    prepared_s: float  # t0 -> the last pod Running (its claim prepared)
    ready_s: float  # t0 -> the domain Ready
    scheduled_s: float  # t0 -> the last pod bound to a node
    first_running_s: float
    writes: dict[str, Any]
    teardown_s: float = 0.0
    teardown_writes: dict[str, Any] | None = None
    watch_restarts: int = 0  # the benchmark's own watches resumed after the server ended them
    # The same Job without a ComputeDomain, run just before (tools/bench/k8s_floor.py).
    plain_job: dict[str, Any] | None = None
    # How long the teardown then waited for the advisor's reservations of the domain to expire.
    reservations_expired_after_s: float = 0.0
    # Every component's writes by kind: [first, median, last] seconds after t0, and how many.
    write_stages: dict[str, list[float]] | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in vars(self).items()}


def job_object(name: str, template: str, pods: int) -> dict[str, Any]:
    """An Indexed Job of `pods` pods all at once, each claiming the domain's channel."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "completionMode": "Indexed",
            "completions": pods,
            "parallelism": pods,
            "backoffLimit": 0,
            "template": {
                "metadata": {
                    "labels": {"bench-job": name},
                    # The advisor places the domain's pods knowing its size.
                    "annotations": {"resource.nvidia.com/computeDomainSize": str(pods)},
                },
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "worker",
                            "image": "busybox",
                            "command": ["sleep", "infinity"],
                            "resources": {"claims": [{"name": "imex-channel"}]},
                        }
                    ],
                    "resourceClaims": [{"name": "imex-channel", "resourceClaimTemplateName": template}],
                },
            },
        },
    }


def domain_object(name: str, template: str, nodes: int) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ComputeDomain",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"numNodes": nodes, "channel": {"resourceClaimTemplate": {"name": template}}},
    }


def pod_running(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )


def domain_ready(cd: dict[str, Any], nodes: int) -> bool:
    status = cd.get("status") or {}
    return status.get("status") == "Ready" and len(status.get("nodes") or []) == nodes


class Driver:
    """Plays the user against the API server (its own client, its own user agent)."""

    def __init__(self, api: ApiClient, env: KubeEnvironment, store: Store, timeout_s: float) -> None:
        self.api = api
        self.timeout_s = timeout_s
        self.store = store
        self.env = env
        self.nodes = len(env.node_names)
        self.core: Any = CoreV1Api(api)
        self.batch: Any = BatchV1Api(api)
        self.custom: Any = CustomObjectsApi(api)
        self.audit = AuditReader(env.audit_log)
        self.resource_version = ""
        self.watch_restarts = 0

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            response = await self.api.call_api(
                path, "GET", header_params={"Accept": "application/json"}, auth_settings=["BearerToken"],
                _preload_content=False, _request_timeout=_REQUEST_TIMEOUT_S,
            )  # fmt: skip
            resp = response[0] if isinstance(response, tuple) else response
            try:
                status, body = int(resp.status), await resp.read()
            finally:
                resp.release()
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        if status == 404:
            return None
        if not 200 <= status <= 299:
            raise ApiException(status=status, reason=body.decode(errors="replace")[:300])
        result: dict[str, Any] = json.loads(body)
        return result

    async def ensure_namespace(self) -> None:
        try:
            await self.core.create_namespace(
                {"metadata": {"name": NAMESPACE}}, _request_timeout=_REQUEST_TIMEOUT_S
            )
        except ApiException as exc:
            if exc.status != 409:
                raise
        self.resource_version = await discover_version(self.api)

    async def until(self, what: str, probe: Any, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not await probe():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            await asyncio.sleep(0.1)

    async def why_unbound(self, job: str) -> str:
        """What the scheduler last said about an unbound pod of `job` (for a failed formation)."""
        listing = await self.get(f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=bench-job%3D{job}")
        for pod in (listing or {}).get("items") or []:
            if not (pod.get("spec") or {}).get("nodeName"):
                conditions = (pod.get("status") or {}).get("conditions") or []
                said = [
                    f"{c.get('reason')}: {c.get('message')}"
                    for c in conditions
                    if c.get("type") == "PodScheduled"
                ]
                return f"pod {pod['metadata']['name']} unbound; scheduler: {said or 'nothing yet'}"
        return "every pod is bound"

    async def follow(self, lister: Any, handle: Any) -> None:
        """List, then watch from the list's resourceVersion, as an informer does: a watch the
        server ends is resumed where it stopped, one whose version expired (410) lists again."""
        version = ""
        while True:
            if not version:
                listing = await read_json(lister(_preload_content=False, _request_timeout=_REQUEST_TIMEOUT_S))
                for item in listing.get("items") or []:
                    handle(item)
                version = str(listing["metadata"]["resourceVersion"])
            call = lister(
                watch=True, resource_version=version, allow_watch_bookmarks=True,
                timeout_seconds=int(_FORMATION_TIMEOUT_S), _preload_content=False,
                _request_timeout=_FORMATION_TIMEOUT_S + 30,
            )  # fmt: skip
            try:
                async for event in watch_events(call):
                    obj = event.get("object") or {}
                    version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                    if event.get("type") != "BOOKMARK":
                        handle(obj)
            except ApiException as exc:
                if exc.status != 410:
                    raise
                version = ""
            self.watch_restarts += 1
            await asyncio.sleep(0.05)

    async def form(self, rep: int) -> Formation:
        cd, template, job = f"cd-{rep}", f"cd-{rep}-channel", f"job-{rep}"
        self.watch_restarts = 0
        began = time.time()
        await self.custom.create_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, PLURAL, domain_object(cd, template, self.nodes),
            _request_timeout=_REQUEST_TIMEOUT_S,
        )  # fmt: skip
        rct = resource_path(self.resource_version, "resourceclaimtemplates", NAMESPACE, template)

        async def template_exists() -> bool:
            return await self.get(rct) is not None

        await self.until(f"ResourceClaimTemplate {template}", template_exists, 120.0)
        scheduled: dict[str, float] = {}
        running: dict[str, float] = {}
        ready_at: list[float] = []
        done = asyncio.Event()

        def check() -> None:
            if len(running) >= self.nodes and ready_at:
                done.set()

        def on_pod(pod: dict[str, Any]) -> None:
            name = (pod.get("metadata") or {}).get("name", "")
            now = time.perf_counter()
            if (pod.get("spec") or {}).get("nodeName"):
                scheduled.setdefault(name, now)
            if pod_running(pod):
                running.setdefault(name, now)
            check()

        def on_domain(obj: dict[str, Any]) -> None:
            if not ready_at and domain_ready(obj, self.nodes):
                ready_at.append(time.perf_counter())
                check()

        pods = functools.partial(self.core.list_namespaced_pod, NAMESPACE, label_selector=f"bench-job={job}")
        domains = functools.partial(
            self.custom.list_namespaced_custom_object,
            GROUP,
            VERSION,
            NAMESPACE,
            PLURAL,
            field_selector=f"metadata.name={cd}",
        )
        watchers = [
            asyncio.create_task(self.follow(pods, on_pod)),
            asyncio.create_task(self.follow(domains, on_domain)),
        ]
        try:
            await asyncio.sleep(0.2)  # both watches open before t0
            t0, t0_wall = time.perf_counter(), time.time()
            await self.batch.create_namespaced_job(
                NAMESPACE, job_object(job, template, self.nodes), _request_timeout=_REQUEST_TIMEOUT_S
            )
            finished = asyncio.ensure_future(done.wait())
            try:
                await asyncio.wait(
                    {finished, *watchers}, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                finished.cancel()
            if not done.is_set():
                ended = [
                    f"{name} watch {'failed: ' + repr(w.exception()) if w.exception() else 'ended'}"
                    for name, w in zip(("pod", "ComputeDomain"), watchers, strict=True)
                    if w.done()
                ]
                raise RuntimeError(
                    f"{await self.why_unbound(job)}\n"
                    f"formation {rep} not done: {len(scheduled)}/{self.nodes} pods bound, "
                    f"{len(running)}/{self.nodes} Running, domain {'Ready' if ready_at else 'not Ready'}"
                    f"{' (' + '; '.join(ended) + ')' if ended else ''}"
                )
        finally:
            for w in watchers:
                w.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
        t_prepared, t_ready = max(running.values()), ready_at[0]
        await asyncio.sleep(_SETTLE_S)
        window = self.audit.between(began, time.time())
        writes = summarize(window, self.nodes)
        return Formation(
            formation_s=max(t_prepared, t_ready) - t0,
            prepared_s=t_prepared - t0,
            ready_s=t_ready - t0,
            scheduled_s=max(scheduled.values()) - t0,
            first_running_s=min(running.values()) - t0,
            writes=writes,
            watch_restarts=self.watch_restarts,
            write_stages=stages(window, t0_wall),
        )

    async def teardown(self, rep: int, formation: Formation, another_follows: bool) -> None:
        """Delete the Job (the shim unprepares, pods and claims go), then the domain (its finalizer
        holds it until the controller tore it down); wait until no IMEX daemon runs."""
        cd, job = f"cd-{rep}", f"job-{rep}"
        began_wall, began = time.time(), time.perf_counter()
        await self.batch.delete_namespaced_job(
            job, NAMESPACE, propagation_policy="Background", _request_timeout=_REQUEST_TIMEOUT_S
        )
        pods = f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=bench-job%3D{job}"
        claims = resource_path(self.resource_version, "resourceclaims", NAMESPACE)

        async def released() -> bool:
            left_pods = (await self.get(pods) or {}).get("items") or []
            left_claims = (await self.get(claims) or {}).get("items") or []
            return not left_pods and not left_claims

        await self.until(f"pods and claims of {job} gone", released, _TEARDOWN_TIMEOUT_S)
        await self.custom.delete_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, PLURAL, cd, _request_timeout=_REQUEST_TIMEOUT_S
        )
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}/{cd}"

        async def gone() -> bool:
            daemons = proc_scan.imex_daemons_under(self.env.base)
            return await self.get(path) is None and not daemons

        await self.until(f"ComputeDomain {cd} and its daemons gone", gone, _TEARDOWN_TIMEOUT_S)
        formation.teardown_s = time.perf_counter() - began
        await asyncio.sleep(_SETTLE_S)
        formation.teardown_writes = summarize(self.audit.between(began_wall, time.time()), self.nodes)
        if not another_follows:
            return

        # The extender's reservations for the deleted domain stay until their TTL (300 s): the
        # next domain, on the same nodes, would wait for them.
        async def unreserved() -> bool:
            held, _ = await self.store.list(self.store.keys.reservations(), pb.Reservation)
            return not held

        waited = time.perf_counter()
        await self.until("the advisor's reservations to expire", unreserved, _TEARDOWN_TIMEOUT_S)
        formation.reservations_expired_after_s = time.perf_counter() - waited


async def api_client(kubeconfig: Path) -> ApiClient:
    configuration = Configuration()
    await load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    api = ApiClient(configuration)
    api.user_agent = BENCH_USER_AGENT
    return api


async def drive(env: KubeEnvironment, reps: int, timeout_s: float) -> list[Formation]:
    api = await api_client(env.plane.kubeconfig)
    store = Store(EtcdConfig(endpoint=env.etcd_endpoint, prefix=env.prefix, timeout_s=10.0))
    await store.connect()
    try:
        driver = Driver(api, env, store, timeout_s)
        await driver.ensure_namespace()
        out: list[Formation] = []
        for rep in range(reps):
            # Kubernetes' own time for the same Job without a domain, just before each formation.
            floor = await run_plain_job(driver, NAMESPACE, rep, timeout_s)
            print(
                f"[formation_k8s] #{rep + 1}: plain Job Running {floor.running_s:.2f} s "
                f"(bound {floor.scheduled_s:.2f}, {floor.nodes_used} nodes used)",
                file=sys.stderr,
                flush=True,
            )
            formation = await driver.form(rep)
            formation.plain_job = floor.to_json()
            print(
                f"[formation_k8s] #{rep + 1}: done {formation.formation_s:.2f} s (bound {formation.scheduled_s:.2f}, "
                f"prepared {formation.prepared_s:.2f}, Ready {formation.ready_s:.2f}); our writes "
                f"{formation.writes['ours']} ({formation.writes['ours_per_node']}/node)",
                file=sys.stderr,
                flush=True,
            )
            await driver.teardown(rep, formation, another_follows=rep + 1 < reps)
            out.append(formation)
        return out
    finally:
        await api.close()
        await store.close()


def summarize_runs(formations: list[Formation], nodes: int) -> dict[str, Any]:
    def median(key: str) -> float:
        return round(statistics.median(getattr(f, key) for f in formations), 3)

    per_node = [f.writes["ours_per_node"] for f in formations]
    plain = [float(f.plain_job["running_s"]) for f in formations if f.plain_job]
    job_p50 = round(statistics.median(plain), 3) if plain else None
    return {
        "nodes": nodes,
        "reps": len(formations),
        "formation_p50_s": median("formation_s"),
        # Kubernetes' floor: the same Job without a domain, and the formation's multiple of it.
        **(
            {
                "plain_job_p50_s": job_p50,
                "plain_job_max_s": round(max(plain), 3),
                "ratio_to_plain_job": round(median("formation_s") / job_p50, 3),
            }
            if job_p50
            else {}
        ),
        "formation_max_s": round(max(f.formation_s for f in formations), 3),
        "prepared_p50_s": median("prepared_s"),
        "ready_p50_s": median("ready_s"),
        "scheduled_p50_s": median("scheduled_s"),
        "teardown_p50_s": median("teardown_s"),
        # Writes are counted per formation; the largest count is the one reported.
        "writes_per_node_max": max(per_node),
        "writes_per_node_p50": round(statistics.median(per_node), 3),
        "formations": [f.to_json() for f in formations],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="formation_k8s", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=256, help="pods of the Job = nodes played")
    parser.add_argument("--racks", type=int, default=15, help="racks the nodes are spread over")
    parser.add_argument("--reps", type=int, default=3, help="formations to time (median reported)")
    parser.add_argument("--mesh", default="plaintext", choices=("tls", "plaintext"), help="the IMEX mesh")
    parser.add_argument(
        "--host-processes", type=int, default=os.cpu_count() or 1, help="scale host processes for the nodes"
    )
    parser.add_argument(
        "--client-qps",
        type=int,
        default=100,
        help="kube-controller-manager's and kube-scheduler's client QPS (burst twice that; 0 = their defaults)",
    )
    parser.add_argument(
        "--extender-whole-nodes",
        action="store_true",
        help="configure the extender not nodeCacheCapable (whole Nodes instead of names; shipped: names)",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=_FORMATION_TIMEOUT_S, help="give up on a formation after this long"
    )
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if (
        args.reps < 1
        or args.nodes < 1
        or args.host_processes < 1
        or args.client_qps < 0
        or args.timeout_s <= 0
    ):
        parser.error("--reps, --nodes and --host-processes must be >= 1, --client-qps >= 0, --timeout-s > 0")
    if args.nodes > args.racks * 18:
        parser.error(f"{args.nodes} nodes do not fit in {args.racks} racks of 18")
    settings = KubeSettings(
        racks=args.racks,
        nodes=args.nodes,
        host_processes=min(args.host_processes, args.nodes),
        mesh_tls=args.mesh == "tls",
        client_qps=args.client_qps,
        client_burst=2 * args.client_qps,
        node_cache_capable=not args.extender_whole_nodes,
    )
    binaries = ensure_binaries()
    base = simenv.scratch_dir("fk-")
    load_before = round(os.getloadavg()[0], 2)
    env: KubeEnvironment | None = None
    ok = False
    try:
        with simenv.private_etcd(base) as etcd:
            env = KubeEnvironment(base, binaries, settings, etcd.endpoint, f"/bench-{uuid.uuid4().hex[:8]}/")
            env.start()
            try:
                formations = asyncio.run(drive(env, args.reps, args.timeout_s))
                status = env.host.status() if env.host else {}
            finally:
                env.stop()
        ok = True
    finally:
        leftovers = simenv.kill_leftover_daemons(base)
        if leftovers:
            print(f"warning: {leftovers} IMEX daemons outlived the scale hosts", file=sys.stderr)
        if ok:
            simenv.remove_tree(base)
        else:
            print(f"[formation_k8s] failed; logs kept in {base}", file=sys.stderr, flush=True)
    result: dict[str, Any] = {
        "benchmark": "formation_k8s",
        "settings": {
            **simenv.storage_settings(),
            "kube_etcd_data": simenv.fs_label(base.parent),
            "kube_etcd_fsync": True,
            "kubernetes": binaries.version,
            "nodes": args.nodes,
            "racks": args.racks,
            "reps": args.reps,
            "mesh": args.mesh,
            "host_processes": settings.host_processes,
            "controller_manager_and_scheduler_qps": args.client_qps or "defaults",
            "extender_node_cache_capable": settings.node_cache_capable,
            "scheduler_percentage_of_nodes_to_score": settings.percentage_of_nodes_to_score,
            "kubelet_shim_retry": f"{settings.shim_retry_initial_s}-{settings.shim_retry_cap_s} s",
            "cpu_count": os.cpu_count(),
        },
        "start_s": env.timings if env else {},
        "host": status,
        "load_average_1m": load_before,
        "load_average_1m_end": round(os.getloadavg()[0], 2),
        "targets": {"k8s_formation_s": TARGET_S, "k8s_writes_per_node": TARGET_WRITES_PER_NODE},
        "formation": summarize_runs(formations, args.nodes),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
