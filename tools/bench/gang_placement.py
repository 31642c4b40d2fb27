"""Benchmark: one trace of ComputeDomain gangs placed by kube-scheduler's own gang and topology
scheduling, then by the placement advisor (through the scheduler extender, and through cd-scheduler's
plugin), on a real control plane.

Set-up (tools/bench/k8s_env.py): kube-apiserver, kube-controller-manager and kube-scheduler 1.37
(scheduling.k8s.io/v1beta1 with GenericWorkload and TopologyAwareWorkloadScheduling on), our
etcd, a `cd-controller` and a `cd-placement-advisor`, the kubelet shim playing kubelet for two
racks of 18 simulated NVL72 trays (two cliques), whose IMEX agents and kubelet plugins run in
scale-mode hosts in Kubernetes mode (a ResourceSlice with one channel per node). This process
plays the users.

One trace (tools/bench/gang_trace.py: seeded; gangs of 1 to 18 nodes arriving and leaving, at times
wanting more nodes than are free) is replayed once per mode, each time in a fresh namespace:

- native: kube-scheduler's default configuration (no extender); each gang is a PodGroup
  (`gang.minCount` = its size, topology `nvidia.com/gpu.clique`) whose pods join it by
  `spec.schedulingGroup.podGroupName`;
- advisor: kube-scheduler with the advisor's extender (as manifests/README.md configures it); no
  PodGroup: the advisor reserves the gang's nodes in one clique (best fit) at its first pod;
- plugin: cd-scheduler (integrations/scheduler-plugin, the shipped configuration of
  manifests/components/scheduler-plugin) beside kube-scheduler (default configuration, no
  extender); the pods name its schedulerName, no PodGroup: its plugin asks the advisor once per
  gang (Place, then Reserve: best fit, one clique) and binds the pods on the reserved nodes;
- plugin-gang: the same, each gang also a PodGroup (`gang.minCount` = its size) that cd-scheduler,
  run with the gang scheduling gates, schedules as one.

Every gang is a ComputeDomain (numNodes = its size, created before the replay) and an Indexed Job
of that many pods, each claiming the domain's channel (so one pod per node). A Job is created at
its gang's arrival; once all its pods are bound, the gang holds its nodes for its hold time, then
its Job, PodGroup and ComputeDomain are deleted. The cluster is sampled every tick (pods listed
from the API server): per gang, the time from its Job's creation to all its pods bound; per
sample, free nodes per clique (no pod of ours on them), from which gang_trace.Tally counts
stranded nodes and the largest free block.

    python -m tools.bench.gang_placement [--gangs 40 --seed 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio.client import ApiClient, BatchV1Api, CoreV1Api, CustomObjectsApi

from libs.kube.resource_api import discover_version, resource_path
from tools import cd_scheduler, launch
from tools.bench import simenv
from tools.bench.formation_k8s import api_client
from tools.bench.gang_trace import MAX_GANG, Gang, Tally, fewer_stranded, make_trace
from tools.bench.k8s_env import KubeEnvironment, KubeSettings
from tools.controlplane.binaries import ensure_binaries
from tools.controlplane.cluster import WORKLOAD_SCHEDULING_MINOR, workload_scheduling_args
from tools.net_ports import free_port
from tools.sim.kubeletshim.nodes import CLIQUE_LABEL

TARGET_FEWER_STRANDED = 0.30
MODES = ("native", "advisor", "plugin", "plugin-gang")
# The mode placement_stranded_vs_native measures: cd-scheduler, the integration users of managed
# clusters can deploy (the extender needs the default scheduler's configuration changed).
METRIC_MODE = "plugin"
PLUGIN_SCHEDULER = "computedomain-scheduler"
CD_GROUP, CD_VERSION, CD_PLURAL = "resource.nvidia.com", "v1beta1", "computedomains"
PG_GROUP, PG_VERSION, PG_PLURAL = "scheduling.k8s.io", "v1beta1", "podgroups"
GANG_LABEL = "bench-gang"
SIZE_ANNOTATION = "resource.nvidia.com/computeDomainSize"
_TICK_S = 0.25
_REQUEST_TIMEOUT_S = 30.0
_SETUP_TIMEOUT_S = 180.0
_DRAIN_TIMEOUT_S = 300.0


def domain_object(gang: Gang, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{CD_GROUP}/{CD_VERSION}",
        "kind": "ComputeDomain",
        "metadata": {"name": gang.name, "namespace": namespace},
        "spec": {
            "numNodes": gang.size,
            "channel": {"resourceClaimTemplate": {"name": f"{gang.name}-channel"}},
        },
    }


@dataclass(frozen=True)
class Mode:
    """How a replay's gangs are scheduled."""

    name: str
    pod_group: bool  # each gang a PodGroup its pods join
    topology: bool  # the PodGroup asks kube-scheduler for one clique
    plugin: bool  # the pods name cd-scheduler
    extender: bool  # kube-scheduler calls the advisor's extender


MODE_SETTINGS = {
    "native": Mode("native", pod_group=True, topology=True, plugin=False, extender=False),
    "advisor": Mode("advisor", pod_group=False, topology=False, plugin=False, extender=True),
    "plugin": Mode("plugin", pod_group=False, topology=False, plugin=True, extender=False),
    "plugin-gang": Mode("plugin-gang", pod_group=True, topology=False, plugin=True, extender=False),
}


def pod_group_object(gang: Gang, namespace: str, topology: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = {"schedulingPolicy": {"gang": {"minCount": gang.size}}}
    if topology:
        spec["schedulingConstraints"] = {"topology": [{"key": CLIQUE_LABEL}]}
    return {
        "apiVersion": f"{PG_GROUP}/{PG_VERSION}",
        "kind": "PodGroup",
        "metadata": {"name": gang.name, "namespace": namespace},
        "spec": spec,
    }


def job_object(gang: Gang, namespace: str, mode: Mode) -> dict[str, Any]:
    """An Indexed Job of the gang's pods, each claiming the domain's channel; grouped by its
    PodGroup, named for cd-scheduler, or carrying the size hint the advisor's extender reads, as
    the mode wants."""
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 0,
        "containers": [
            {
                "name": "worker",
                "image": "busybox",
                "command": ["sleep", "infinity"],
                "resources": {"claims": [{"name": "imex-channel"}]},
            }
        ],
        "resourceClaims": [{"name": "imex-channel", "resourceClaimTemplateName": f"{gang.name}-channel"}],
    }
    metadata: dict[str, Any] = {"labels": {GANG_LABEL: gang.name}}
    if mode.pod_group:
        pod_spec["schedulingGroup"] = {"podGroupName": gang.name}
    if mode.plugin:
        pod_spec["schedulerName"] = PLUGIN_SCHEDULER  # it reads the size from spec.numNodes
    if mode.extender:
        metadata["annotations"] = {SIZE_ANNOTATION: str(gang.size)}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": gang.name, "namespace": namespace},
        "spec": {
            "completionMode": "Indexed",
            "completions": gang.size,
            "parallelism": gang.size,
            "backoffLimit": 0,
            "template": {"metadata": metadata, "spec": pod_spec},
        },
    }


@dataclass
class GangRun:
    gang: Gang
    submitted_s: float | None = None
    bound_s: float | None = None
    left_s: float | None = None
    cliques: int = 0  # cliques its pods were bound in

    def to_json(self) -> dict[str, Any]:
        wait = (
            None
            if self.bound_s is None or self.submitted_s is None
            else round(self.bound_s - self.submitted_s, 2)
        )
        return {
            "gang": self.gang.name,
            "size": self.gang.size,
            "arrive_s": self.gang.arrive_s,
            "bind_s": wait,
            "cliques": self.cliques,
        }


class Replay:
    """Replays the trace in one namespace against whatever scheduler configuration is running."""

    def __init__(self, api: ApiClient, env: KubeEnvironment, namespace: str, mode: Mode) -> None:
        self.api, self.env, self.namespace, self.mode = api, env, namespace, mode
        self.core: Any = CoreV1Api(api)
        self.batch: Any = BatchV1Api(api)
        self.custom: Any = CustomObjectsApi(api)
        self.clique_of = {n: env.cluster.node(n).clique for n in env.node_names}
        self.clique_sizes: dict[str, int] = {}
        for clique in self.clique_of.values():
            self.clique_sizes[clique] = self.clique_sizes.get(clique, 0) + 1

    async def get(self, path: str) -> dict[str, Any]:
        response = await self.api.call_api(
            path, "GET", header_params={"Accept": "application/json"}, auth_settings=["BearerToken"],
            _preload_content=False, _request_timeout=_REQUEST_TIMEOUT_S,
        )  # fmt: skip
        resp = response[0] if isinstance(response, tuple) else response
        try:
            status, body = int(resp.status), await resp.read()
        finally:
            resp.release()
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status}: {body.decode(errors='replace')[:300]}")
        result: dict[str, Any] = json.loads(body)
        return result

    async def pods(self) -> list[dict[str, Any]]:
        listing = await self.get(f"/api/v1/namespaces/{self.namespace}/pods?labelSelector={GANG_LABEL}")
        return list(listing.get("items") or [])

    async def prepare(self, trace: list[Gang]) -> None:
        """The namespace, every gang's ComputeDomain (and PodGroup), their claim templates made."""
        await self.core.create_namespace(
            {"metadata": {"name": self.namespace}}, _request_timeout=_REQUEST_TIMEOUT_S
        )
        for gang in trace:
            await self.custom.create_namespaced_custom_object(
                CD_GROUP, CD_VERSION, self.namespace, CD_PLURAL, domain_object(gang, self.namespace)
            )
            if self.mode.pod_group:
                await self.custom.create_namespaced_custom_object(
                    PG_GROUP,
                    PG_VERSION,
                    self.namespace,
                    PG_PLURAL,
                    pod_group_object(gang, self.namespace, self.mode.topology),
                )
        templates = resource_path(await discover_version(self.api), "resourceclaimtemplates", self.namespace)
        deadline = time.monotonic() + _SETUP_TIMEOUT_S
        while len((await self.get(templates)).get("items") or []) < len(trace):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the controller made fewer than {len(trace)} claim templates in time")
            await asyncio.sleep(0.5)

    async def leave(self, gang: Gang) -> None:
        await self.batch.delete_namespaced_job(gang.name, self.namespace, propagation_policy="Background")
        await self.custom.delete_namespaced_custom_object(
            CD_GROUP, CD_VERSION, self.namespace, CD_PLURAL, gang.name
        )
        if self.mode.pod_group:
            await self.custom.delete_namespaced_custom_object(
                PG_GROUP, PG_VERSION, self.namespace, PG_PLURAL, gang.name
            )

    async def run(self, trace: list[Gang], deadline_s: float) -> tuple[list[GangRun], Tally]:
        runs = {g.name: GangRun(g) for g in trace}
        tally = Tally()
        t0 = time.monotonic()
        last = 0.0
        while True:
            now = time.monotonic() - t0
            for run in runs.values():
                if run.submitted_s is None and run.gang.arrive_s <= now:
                    run.submitted_s = time.monotonic() - t0
                    await self.batch.create_namespaced_job(
                        self.namespace, job_object(run.gang, self.namespace, self.mode)
                    )
            pods = await self.pods()
            now = time.monotonic() - t0
            bound: dict[str, int] = {}
            cliques: dict[str, set[str]] = {}
            used: dict[str, int] = {}
            for pod in pods:
                node = (pod.get("spec") or {}).get("nodeName")
                if node:
                    gang_name = pod["metadata"]["labels"][GANG_LABEL]
                    bound[gang_name] = bound.get(gang_name, 0) + 1
                    cliques.setdefault(gang_name, set()).add(self.clique_of[node])
                    used[self.clique_of[node]] = used.get(self.clique_of[node], 0) + 1
            partial = 0
            for run in runs.values():
                if run.submitted_s is None or run.bound_s is not None:
                    continue
                count = bound.get(run.gang.name, 0)
                if count >= run.gang.size:
                    run.bound_s = now
                    run.cliques = len(cliques[run.gang.name])
                else:
                    partial += count
            for run in runs.values():
                if run.bound_s is not None and run.left_s is None and now >= run.bound_s + run.gang.hold_s:
                    await self.leave(run.gang)
                    run.left_s = now
            free = {c: size - used.get(c, 0) for c, size in self.clique_sizes.items()}
            waiting = [r.gang.size for r in runs.values() if r.submitted_s is not None and r.bound_s is None]
            tally.sample(now, now - last, free, waiting, partial)
            last = now
            if all(r.left_s is not None for r in runs.values()) or now > deadline_s:
                return list(runs.values()), tally
            await asyncio.sleep(_TICK_S)

    async def drain(self) -> None:
        """Delete what is left of the replay and wait until no pod of it is bound and no claim of it
        allocated (unbound pods may linger, their Job's finalizer not yet removed: they hold nothing)."""
        await self.batch.delete_collection_namespaced_job(self.namespace, propagation_policy="Background")
        await self.custom.delete_collection_namespaced_custom_object(
            CD_GROUP, CD_VERSION, self.namespace, CD_PLURAL
        )
        if self.mode.pod_group:
            await self.custom.delete_collection_namespaced_custom_object(
                PG_GROUP, PG_VERSION, self.namespace, PG_PLURAL
            )
        claims = resource_path(await discover_version(self.api), "resourceclaims", self.namespace)
        deadline = time.monotonic() + _DRAIN_TIMEOUT_S
        while any((p.get("spec") or {}).get("nodeName") for p in await self.pods()) or any(
            (c.get("status") or {}).get("allocation") for c in (await self.get(claims)).get("items") or []
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"pods or claims of {self.namespace} still there after {_DRAIN_TIMEOUT_S:.0f} s"
                )
            await asyncio.sleep(0.5)


def summarize(runs: list[GangRun], tally: Tally) -> dict[str, Any]:
    waits = sorted(
        r.bound_s - r.submitted_s for r in runs if r.bound_s is not None and r.submitted_s is not None
    )

    def pct(q: float) -> float | None:
        return round(waits[min(len(waits) - 1, int(q * len(waits)))], 2) if waits else None

    return {
        "gangs": len(runs),
        "placed": len(waits),
        "bind_p50_s": round(statistics.median(waits), 2) if waits else None,
        "bind_p90_s": pct(0.9),
        "bind_p99_s": pct(0.99),
        "bind_max_s": round(waits[-1], 2) if waits else None,
        "bind_mean_s": round(statistics.fmean(waits), 2) if waits else None,
        # Placed gangs whose pods were bound in more than one clique.
        "split": sum(1 for r in runs if r.cliques > 1),
        **tally.summary(),
        "per_gang": [r.to_json() for r in runs],
        "timeline": tally.timeline,
    }


def scheduler_config(env: KubeEnvironment, extender: bool) -> Path:
    """kube-scheduler's configuration for a mode: the environment's (with the extender) or the
    same without it."""
    path = env.base / "kube-scheduler.yaml"
    if extender:
        return path
    config = yaml.safe_load(path.read_text())
    config.pop("extenders", None)
    native_path = env.base / "kube-scheduler-native.yaml"
    native_path.write_text(yaml.safe_dump(config))
    return native_path


class PluginScheduler:
    """cd-scheduler beside the environment's kube-scheduler, with the shipped configuration and
    the client rate kube-scheduler has here; `gang_gates` turns on kube-scheduler's own gang
    scheduling in it (for PodGroups)."""

    def __init__(self, env: KubeEnvironment, gang_gates: bool) -> None:
        self.env, self.gang_gates = env, gang_gates
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = self.env
        env.plane.kubectl(
            "apply", "--server-side", "-f", "-",
            input=yaml.safe_dump_all(cd_scheduler.plugin_reads("bench-cd-scheduler-as-kube-scheduler")),
        )  # fmt: skip
        kube_config = yaml.safe_load((env.base / "kube-scheduler.yaml").read_text())
        config = cd_scheduler.config(
            {PLUGIN_SCHEDULER: f"127.0.0.1:{env.advisor_grpc_port}"},
            env.plane.scheduler_kubeconfig,
            scheduler_settings={"percentageOfNodesToScore": kube_config.get("percentageOfNodesToScore")},
        )
        config["clientConnection"] = kube_config["clientConnection"]
        work = env.base / "cd-scheduler"
        work.mkdir(exist_ok=True)
        config_path = work / "config.yaml"
        config_path.write_text(yaml.safe_dump(config))
        port = free_port()
        gates = tuple(workload_scheduling_args(env.binaries.minor)[1]) if self.gang_gates else ()
        argv = cd_scheduler.command(
            cd_scheduler.cd_scheduler_binary(),
            config_path,
            env.plane.scheduler_kubeconfig,
            port,
            work / "certs",
            gates,
        )
        started = launch.spawn("cd-scheduler", argv, env.log("cd-scheduler"), append=True)
        self.process = started.proc
        started.wait_healthy(lambda: cd_scheduler.healthy(port), _SETUP_TIMEOUT_S, "healthy", max_poll_s=1.0)

    def stop(self) -> None:
        if self.process is not None:
            launch.stop_process(self.process)
            self.process = None


async def replay_modes(
    env: KubeEnvironment, trace: list[Gang], deadline_s: float, modes: list[str]
) -> dict[str, Any]:
    api = await api_client(env.plane.kubeconfig)
    out: dict[str, Any] = {}
    try:
        for name in modes:
            mode = MODE_SETTINGS[name]
            env.plane.restart_scheduler(scheduler_config(env, mode.extender))
            plugin = PluginScheduler(env, gang_gates=mode.pod_group) if mode.plugin else None
            if plugin is not None:
                plugin.start()
            try:
                replay = Replay(api, env, f"gangs-{name}", mode)
                await replay.prepare(trace)
                began = time.monotonic()
                runs, tally = await replay.run(trace, deadline_s)
                out[name] = {**summarize(runs, tally), "replay_s": round(time.monotonic() - began, 1)}
                print(
                    f"[gang_placement] {name}: placed {out[name]['placed']}/{len(trace)}, bind p50 "
                    f"{out[name]['bind_p50_s']} s, split {out[name]['split']}, stranded "
                    f"{out[name]['stranded_node_s']} node-s, held by part of a gang {out[name]['partial_node_s']} "
                    f"node-s, largest free block mean {out[name]['largest_free_block_mean']}",
                    file=sys.stderr,
                    flush=True,
                )
                # Every figure of the mode at once, should a later mode not finish.
                figures = {k: v for k, v in out[name].items() if k not in ("per_gang", "timeline")}
                print(f"[gang_placement] {name} figures: {json.dumps(figures)}", file=sys.stderr, flush=True)
                await replay.drain()
            finally:
                if plugin is not None:
                    plugin.stop()
    finally:
        await api.close()
    return out


def compare_with_native(modes: dict[str, Any]) -> dict[str, Any]:
    """Each of our modes against the native one: the fraction of native's stranded node-seconds it
    avoids (free nodes only), and of its unusable ones (stranded plus held by part of a gang: the
    metric); the metric's mode's also under the unsuffixed names."""
    out: dict[str, Any] = {}
    native = modes.get("native")
    if native is None:
        return out
    for name, ours in modes.items():
        if name == "native":
            continue
        out[f"stranded_vs_native_{name}"] = fewer_stranded(native["stranded_node_s"], ours["stranded_node_s"])
        out[f"unusable_vs_native_{name}"] = fewer_stranded(native["unusable_node_s"], ours["unusable_node_s"])
        out[f"bind_p50_vs_native_{name}"] = ratio(ours["bind_p50_s"], native["bind_p50_s"])
    if METRIC_MODE in modes:
        out["stranded_vs_native"] = out[f"stranded_vs_native_{METRIC_MODE}"]
        out["unusable_vs_native"] = out[f"unusable_vs_native_{METRIC_MODE}"]
    return out


def ratio(ours: float | None, native: float | None) -> float | None:
    """ours / native (None when either is missing or native is 0)."""
    if ours is None or not native:
        return None
    return round(ours / native, 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gang_placement", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--gangs", type=int, default=40, help="gangs in the trace")
    parser.add_argument("--seed", type=int, default=7, help="the trace's seed")
    parser.add_argument("--mean-gap-s", type=float, default=4.0, help="mean time between arrivals")
    parser.add_argument("--hold-min-s", type=float, default=10.0, help="shortest time a gang holds its nodes")
    parser.add_argument("--hold-max-s", type=float, default=30.0, help="longest time a gang holds its nodes")
    parser.add_argument("--racks", type=int, default=2, help="racks (cliques) of 18 trays")
    parser.add_argument(
        "--trays", type=int, default=MAX_GANG, help="trays used per rack (the largest gang too)"
    )
    parser.add_argument(
        "--drain-s", type=float, default=300.0, help="after the last arrival, stop after this long"
    )
    parser.add_argument("--modes", default=",".join(MODES), help="which replays, in order (default: all)")
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    modes_wanted = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes_wanted or set(modes_wanted) - set(MODES):
        parser.error(f"--modes takes {' and/or '.join(MODES)}, comma-separated")
    if args.racks < 2 or not 1 <= args.trays <= MAX_GANG or args.gangs < 1:
        parser.error(f"--racks must be >= 2, --trays in [1, {MAX_GANG}], --gangs >= 1")
    trace = make_trace(args.seed, args.gangs, args.mean_gap_s, (args.hold_min_s, args.hold_max_s), args.trays)
    binaries = ensure_binaries()
    if binaries.minor < WORKLOAD_SCHEDULING_MINOR:
        parser.error(
            f"native gang scheduling needs Kubernetes 1.{WORKLOAD_SCHEDULING_MINOR}, not {binaries.version}"
        )
    nodes = args.racks * args.trays
    settings = KubeSettings(
        racks=args.racks, nodes=nodes, host_processes=min(os.cpu_count() or 1, 2), mesh_tls=False,
        client_qps=100, client_burst=200,
    )  # fmt: skip
    base = simenv.scratch_dir("gp-")
    ok = False
    env: KubeEnvironment | None = None
    try:
        with simenv.private_etcd(base) as etcd:
            env = KubeEnvironment(base, binaries, settings, etcd.endpoint, f"/bench-{uuid.uuid4().hex[:8]}/")
            env.start()
            try:
                modes = asyncio.run(replay_modes(env, trace, trace[-1].arrive_s + args.drain_s, modes_wanted))
            finally:
                env.stop()
        ok = True
    finally:
        simenv.kill_leftover_daemons(base)
        if ok:
            simenv.remove_tree(base)
        else:
            print(f"[gang_placement] failed; logs kept in {base}", file=sys.stderr, flush=True)
    result: dict[str, Any] = {
        "benchmark": "gang_placement",
        "settings": {
            "kubernetes": binaries.version,
            "racks": args.racks,
            "trays_per_rack": args.trays,
            "nodes": nodes,
            "seed": args.seed,
            "gangs": args.gangs,
            "mean_gap_s": args.mean_gap_s,
            "hold_s": [args.hold_min_s, args.hold_max_s],
            "tick_s": _TICK_S,
            "log_level": simenv.log_level(),
            "cpu_count": os.cpu_count(),
        },
        "start_s": env.timings if env else {},
        "trace": {
            "sizes": [g.size for g in trace],
            "demand_node_s": round(sum(g.size * g.hold_s for g in trace), 1),
        },
        "modes": modes,
        "metric_mode": METRIC_MODE,
        "target": TARGET_FEWER_STRANDED,
    }
    result.update(compare_with_native(modes))
    text = json.dumps(result, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "modes"}, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
