"""Benchmark: NodePrepareResources / NodeUnprepareResources on a node whose IMEX daemon is already
READY, through the real unix-socket gRPC of a kubelet-plugin (node-agent) process, at the loads
kubelet makes (tools/bench/prepare_load.py), with the floors measured in the same run.

Set-up: a private etcd (unless --etcd-endpoint), a one-rack simulated cluster, the node's two
processes with simulated hardware (the IMEX agent: node record and daemon; the kubelet plugin),
a ComputeDomain and an anchor claim prepared first (the node is a member and its daemon READY).
With ``--claim-source kubernetes`` (the default) the plugin reads each claim as Kubernetes mode
does, a GET of the ResourceClaim from a real kube-apiserver (its etcd fsynced; the claims created
and allocated beforehand, tools/bench/kube_claims.py); ``store`` reads the claim records of
simulation instead. Then, each on claims of its own, every call timed at the client (kubelet's
view):
1. ``--calls`` prepares and unprepares one at a time (4 claims held besides the anchor);
2. ``--bursts`` bursts of 4 prepares sent together, idle ``--idle-s``, their 4 unprepares
   together, idle: per burst the latency of its last call;
3. ``--capacity-calls`` claims prepared and unprepared by 16 callers always in flight over one
   connection: the calls/s the agent sustains (its capacity; latencies reported beside).
Floors, by the same client in the same run: an empty-handler DRA call on the agent's gRPC stack,
one fsynced etcd transaction, and (Kubernetes mode) one GET of a claim from the API server.
Each phase's CPU per call of the plugin, its event-loop thread and etcd is reported beside the
latencies: the loop thread's CPU per call bounds the latency of every call that passes through it.

Production settings: etcd's data on disk with fsync, the kubelet dir (checkpoint) and IMEX work
dir on disk, the checkpoint saved with the agent's shipped durability (``checkpoint_fsync``
false: atomic rename, no fsync; docs/operations.md says why), the CDI root on tmpfs as
``/var/run/cdi`` is on a node (``--cdi-on-disk`` moves it). The result's ``settings`` records each.

    python -m tools.bench.nodeagent_prepare [--calls 500] [--bursts 200] [--capacity-calls 1000]
        [--claim-source kubernetes|store] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpclib.client import Channel

from libs.contract.names import DRIVER_NAME
from libs.contract.store_claims import store_claim
from libs.gen.computedomain.state import v1 as pb
from libs.gen.k8s.io.kubelet.pkg.apis.dra import v1 as dra
from libs.state.config import EtcdConfig
from libs.state.store import Store
from tools import launch
from tools.bench import kube_claims, simenv
from tools.bench import prepare_load as load
from tools.bench.proc_cpu import cpu_seconds
from tools.controlplane.binaries import ensure_binaries
from tools.etcd.server import EtcdServer, etcd_binary
from tools.net_ports import free_port
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.hardware.simulated import prepare_node_dirs

NODE = "rack0-tray0"
NAMESPACE = "bench"
TARGET_P99_MS = 5.0
TARGET_BURST_P99_MS = 10.0
TARGET_CALLS_PER_S = 500.0
# Claims kept prepared besides the anchor while calls go one at a time.
WINDOW = 4
# Pods a GB200 tray starts at once, at most, as a rule (one domain per tray).
BURST_SIZE = 4
# The capacity loop: calls always in flight.
CAPACITY_INFLIGHT = 16


Processes = dict[str, launch.Launched]


def _serving(path: Path, processes: Processes) -> bool:
    for name, started in processes.items():
        if not started.running():
            raise SystemExit(f"{name} exited {started.proc.returncode}:\n{started.tail(4000)}")
    return path.exists()


async def wait_socket(path: Path, processes: Processes, timeout_s: float = 30.0) -> None:
    """Wait for the plugin's DRA socket (served once the IMEX agent registered the node)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _serving(path, processes):
            return
        await asyncio.sleep(0.05)
    raise SystemExit(f"the kubelet plugin did not serve {path} within {timeout_s}s")


@dataclass
class Phases:
    """How many claims each phase uses, in the order they run (the anchor first)."""

    warmup: int
    sequential: int
    bursts: int
    burst_size: int
    capacity: int

    def slices(self) -> dict[str, slice]:
        out: dict[str, slice] = {}
        at = 1
        for name, count in (
            ("warmup", self.warmup),
            ("sequential", self.sequential),
            ("bursts", self.bursts * self.burst_size),
            ("capacity", self.capacity),
        ):
            out[name] = slice(at, at + count)
            at += count
        return out

    @property
    def total(self) -> int:
        return 1 + self.warmup + self.sequential + self.bursts * self.burst_size + self.capacity


async def write_claims(
    args: argparse.Namespace, store: Store, domain_uid: str, kube: kube_claims.ApiServer | None, count: int
) -> list[dra.Claim]:
    """`count` claims allocated the channel of NODE for the domain, where the plugin reads them."""
    names = [f"claim-{i:05d}" for i in range(count)]
    if kube is not None:
        api = await kube_claims.api_client(kube.kubeconfig)
        try:
            uids = await kube_claims.create_allocated_claims(api, NAMESPACE, names, NODE, domain_uid)
        finally:
            await api.close()
    else:
        uids = [str(uuid.uuid4()) for _ in names]
        for uid, name in zip(uids, names, strict=True):
            record = store_claim(uid=uid, namespace=NAMESPACE, name=name, node=NODE, domain_uid=domain_uid)
            await store.put(store.keys.claim(uid), record)
    return [dra.Claim(namespace=NAMESPACE, uid=u, name=n) for u, n in zip(uids, names, strict=True)]


class CpuMeter:
    """CPU time per call of the plugin, its event-loop thread and etcd over a phase (from /proc)."""

    def __init__(self, plugin_pid: int, etcd_pid: int | None) -> None:
        # The plugin's main thread runs its event loop, through which every call passes.
        self.pids: dict[str, tuple[int, int | None]] = {
            "plugin": (plugin_pid, None),
            "plugin_loop": (plugin_pid, plugin_pid),
            **({"etcd": (etcd_pid, None)} if etcd_pid else {}),
        }

    def start(self) -> dict[str, float]:
        return {name: cpu_seconds(*ids) for name, ids in self.pids.items()}

    def per_call(self, before: dict[str, float], calls: int) -> dict[str, float]:
        return {
            name: round((cpu_seconds(*ids) - before[name]) * 1000 / calls, 3)
            for name, ids in self.pids.items()
        }


async def measure(
    args: argparse.Namespace,
    stub: dra.DraPluginStub,
    claims: list[dra.Claim],
    meter: CpuMeter,
    phases: Phases,
) -> dict[str, Any]:
    at = phases.slices()
    await load.sequential(stub, claims[at["warmup"]], WINDOW)
    out: dict[str, Any] = {}

    before = meter.start()
    prepares, unprepares = await load.sequential(stub, claims[at["sequential"]], WINDOW)
    out["sequential"] = {
        "prepare": load.summary(prepares),
        "unprepare": load.summary(unprepares),
        "cpu_ms_per_call": meter.per_call(before, len(prepares) + len(unprepares)),
    }
    print(f"[nodeagent_prepare] 1 in flight: {out['sequential']}", file=sys.stderr, flush=True)

    before = meter.start()
    prepares, unprepares = await load.bursts(stub, claims[at["bursts"]], phases.burst_size, args.idle_s)
    out["burst"] = {
        "size": phases.burst_size,
        "idle_s": args.idle_s,
        "prepare": load.summary(prepares),
        "unprepare": load.summary(unprepares),
        "cpu_ms_per_call": meter.per_call(before, 2 * phases.burst_size * len(prepares)),
    }
    print(f"[nodeagent_prepare] bursts of {phases.burst_size}: {out['burst']}", file=sys.stderr, flush=True)

    before, wall_start = meter.start(), time.perf_counter()
    prepares, unprepares = await load.closed_loop(stub, claims[at["capacity"]], CAPACITY_INFLIGHT)
    wall = time.perf_counter() - wall_start
    calls = len(prepares) + len(unprepares)
    cpu = meter.per_call(before, calls)
    out["capacity"] = {
        "inflight": CAPACITY_INFLIGHT,
        "calls_per_s": round(calls / wall, 1),
        "prepare": load.summary(prepares),
        "unprepare": load.summary(unprepares),
        "cpu_ms_per_call": cpu,
        # Little's law: `inflight` calls always outstanding, each needing this much of the one
        # event-loop thread, so no mean latency (and no p99) can be lower at this CPU per call.
        "loop_floor_ms": round(CAPACITY_INFLIGHT * cpu["plugin_loop"], 3),
    }
    print(
        f"[nodeagent_prepare] {CAPACITY_INFLIGHT} in flight: {out['capacity']}", file=sys.stderr, flush=True
    )
    return out


async def measure_floors(
    args: argparse.Namespace, work: Path, store: Store, kube: kube_claims.ApiServer | None, claim: dra.Claim
) -> dict[str, Any]:
    floors: dict[str, Any] = {}
    floors["dra_call"] = load.summary(await load.dra_call_floor(work, args.floor_calls))
    record = bytes(
        store_claim(uid=claim.uid, namespace=NAMESPACE, name=claim.name, node=NODE, domain_uid=claim.uid)
    )
    floors["etcd_txn"] = load.summary(await load.etcd_txn_floor(store, record, args.floor_calls))
    if kube is not None:
        api = await kube_claims.api_client(kube.kubeconfig)
        try:
            floors["kube_get"] = load.summary(
                await kube_claims.get_floor(api, NAMESPACE, claim.name, args.floor_calls)
            )
        finally:
            await api.close()
    print(f"[nodeagent_prepare] floors: {floors}", file=sys.stderr, flush=True)
    return floors


async def bench(
    args: argparse.Namespace,
    base: Path,
    cdi_root: Path,
    endpoint: str,
    etcd_pid: int | None,
    kube: kube_claims.ApiServer | None,
) -> dict[str, Any]:
    etcd = EtcdConfig(endpoint=endpoint, prefix=f"/bench-{uuid.uuid4().hex[:8]}/")
    cluster = ClusterDescription(racks=1, trays_per_rack=2, seed=f"bench-{base.name}", address_block=199)
    cluster.save(base / "cluster.json")
    prepare_node_dirs(cluster, NODE, base / "nodes")
    kubelet_dir = base / "kubelet"
    hardware = [
        "--node-name", NODE, "--hardware", "simulated",
        "--sim-cluster", str(base / "cluster.json"), "--sim-state-dir", str(base / "nodes"),
    ]  # fmt: skip
    common = [
        "--etcd-endpoint", etcd.endpoint, "--etcd-prefix", etcd.prefix,
        "--health-host", "127.0.0.1", "--log-format", "json", "--log-level", "warning",
    ]  # fmt: skip
    imex_settings = [
        *hardware, *common,
        "--health-port", str(free_port()),
        "--node-ip", cluster.node(NODE).address, "--imex-work-dir", str(base / "imex"),
        "--kubelet-dir", str(kubelet_dir), "--cdi-root", str(cdi_root),
        # The benchmark leaves no daemon behind (on a node they outlive the agent).
        "--stop-daemons-on-exit", "true",
    ]  # fmt: skip
    # With --profile-plugin the plugin runs under cProfile, which writes its stats as it exits.
    profile = ["-m", "cProfile", "-o", str(args.profile_plugin.resolve())] if args.profile_plugin else []
    plugin_settings = [
        *hardware, *common,
        "--health-port", str(free_port()),
        "--kubelet-dir", str(kubelet_dir), "--cdi-root", str(cdi_root),
        "--tombstone-ttl-s", str(args.tombstone_ttl_s),
        *(["--claim-source", "kubernetes", "--kubeconfig", str(kube.kubeconfig)] if kube else []),
    ]  # fmt: skip
    phases = Phases(
        warmup=min(20, args.calls),
        sequential=args.calls,
        bursts=args.bursts,
        burst_size=BURST_SIZE,
        capacity=args.capacity_calls,
    )
    processes: Processes = {}
    for name, service, settings, python_args in (
        ("IMEX agent", "imex-agent", imex_settings, ()),
        ("kubelet plugin", "node-agent", plugin_settings, profile),
    ):
        log_path = base / f"{name.replace(' ', '-').lower()}.log"
        processes[name] = launch.start_service(
            service, settings, log_path, name=name, python_args=python_args
        )
    try:
        socket_path = kubelet_dir / "plugins" / DRIVER_NAME / "dra.sock"
        await wait_socket(socket_path, processes)
        async with Store(etcd) as store:
            domain_uid = str(uuid.uuid4())
            await store.put(
                store.keys.domain(domain_uid),
                # No controller runs here: the mesh mode it would record (plaintext keeps the
                # figure about the kubelet plugin; mesh TLS is measured by the formation benchmark).
                pb.ComputeDomain(
                    uid=domain_uid, namespace=NAMESPACE, name="bench", mesh_mode=pb.MeshMode.PLAINTEXT
                ),
            )
            claims = await write_claims(args, store, domain_uid, kube, phases.total)
            channel = Channel(path=str(socket_path))
            stub = dra.DraPluginStub(channel)
            try:
                await asyncio.wait_for(load.prepare(stub, claims[0]), 60)  # the anchor: the node joins
                meter = CpuMeter(processes["kubelet plugin"].pid, etcd_pid)
                figures = await measure(args, stub, claims, meter, phases)
                floors = await measure_floors(args, base, store, kube, claims[0])
            finally:
                channel.close()
    finally:
        # The plugin first, as on a node where it is upgraded; then the IMEX agent, which stops
        # the daemon.
        for started in reversed(processes.values()):
            started.stop(grace_s=20.0)
    sequential = figures["sequential"]
    return {
        "benchmark": "nodeagent_prepare",
        "description": "NodePrepareResources / NodeUnprepareResources on a node with a READY IMEX daemon over "
        "the DRA unix socket (v1), one claim per call: one call in flight, bursts of "
        f"{BURST_SIZE}, {CAPACITY_INFLIGHT} in flight (capacity); simulated hardware, etcd on loopback, "
        + ("claims read from a kube-apiserver" if kube else "claims read from the store"),
        "settings": {
            "claim_source": "kubernetes (GET from kube-apiserver, its etcd fsynced)" if kube else "store",
            **({"kubernetes": kube.version} if kube else {}),
            "node_dirs": simenv.fs_label(base),
            "checkpoint_fsync": simenv.checkpoint_fsync_default(),
            "cdi_root": simenv.fs_label(cdi_root),
            "mesh": "plaintext",
            "calls_1_in_flight": args.calls,
            "bursts": args.bursts,
            "burst_size": BURST_SIZE,
            "burst_idle_s": args.idle_s,
            "capacity_calls": args.capacity_calls,
            "capacity_inflight": CAPACITY_INFLIGHT,
            "floor_calls": args.floor_calls,
            "tombstone_ttl_s": args.tombstone_ttl_s,
            "cpu_count": os.cpu_count(),
        },
        # One call in flight: the figures of record (prepare_p99_ms, unprepare_p99_ms).
        "prepare": sequential["prepare"],
        "unprepare": sequential["unprepare"],
        **figures,
        "floors": floors,
        "targets": {
            "p99_ms": TARGET_P99_MS,
            "burst_p99_ms": TARGET_BURST_P99_MS,
            "calls_per_s": TARGET_CALLS_PER_S,
        },
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


async def run(args: argparse.Namespace, base: Path, cdi_root: Path) -> dict[str, Any]:
    server: EtcdServer | None = None
    kube: kube_claims.ApiServer | None = None
    # etcd's data on disk, fsynced, as a control plane keeps it (tools/bench/simenv.py).
    etcd_dir = simenv.scratch_dir("nabench-etcd-")
    try:
        if args.claim_source == "kubernetes":
            kube = kube_claims.ApiServer(ensure_binaries(), base / "kube", wait_for_controllers=False)
            await asyncio.to_thread(kube.start)
        endpoint = args.etcd_endpoint
        if not endpoint:
            server = EtcdServer(data_dir=etcd_dir / "etcd", binary=etcd_binary())
            server.start()
            endpoint = server.endpoint
        result = await bench(
            args, base, cdi_root, endpoint, server.process.pid if server and server.process else None, kube
        )
        # What etcd was given is known only for a private one.
        result["settings"]["etcd_data"] = "external" if args.etcd_endpoint else simenv.fs_label(etcd_dir)
        result["settings"]["etcd_fsync"] = "external" if args.etcd_endpoint else simenv.etcd_fsync()
        return result
    finally:
        if server is not None:
            server.destroy()
        if kube is not None:
            kube.stop()
        shutil.rmtree(etcd_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="nodeagent_prepare", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="prepares (and unprepares) one at a time")
    parser.add_argument(
        "--bursts", type=int, default=200, help=f"bursts of {BURST_SIZE} prepares (and unprepares)"
    )
    parser.add_argument("--idle-s", type=float, default=0.1, help="idle time after each burst")
    parser.add_argument(
        "--capacity-calls",
        type=int,
        default=1000,
        help=f"claims prepared and unprepared with {CAPACITY_INFLIGHT} calls in flight",
    )
    parser.add_argument("--floor-calls", type=int, default=500, help="calls of each floor, one at a time")
    parser.add_argument(
        "--claim-source",
        choices=("kubernetes", "store"),
        default="kubernetes",
        help="where the plugin reads claims: a kube-apiserver (as in Kubernetes mode) or the store",
    )
    parser.add_argument(
        "--etcd-endpoint", default="", help="use this etcd (host:port) instead of a private one"
    )
    parser.add_argument(
        "--cdi-on-disk",
        dest="cdi_tmpfs",
        action="store_false",
        help="keep the CDI root on disk, not on tmpfs",
    )
    parser.add_argument(
        "--tombstone-ttl-s",
        type=float,
        default=300.0,
        help="the agent's unprepare tombstone TTL (default: the agent's own; every save of the "
        "checkpoint encodes all live tombstones, and this benchmark unprepares far faster than a node does)",
    )
    parser.add_argument(
        "--profile-plugin", type=Path, help="run the kubelet plugin under cProfile, its stats to this file"
    )
    parser.add_argument("--out", type=Path, help="also write the result as JSON to this file")
    args = parser.parse_args(argv)
    if min(args.calls, args.bursts, args.capacity_calls, args.floor_calls) < 1 or args.idle_s < 0:
        parser.error("--calls, --bursts, --capacity-calls and --floor-calls must be >= 1, --idle-s >= 0")
    # On a node the kubelet dir (checkpoint) and IMEX work dir are on disk, /var/run/cdi on tmpfs.
    base = simenv.scratch_dir("nabench-")
    cdi_root = simenv.shm_dir("nabench-cdi-") if args.cdi_tmpfs else base / "cdi"
    try:
        result = asyncio.run(run(args, base, cdi_root))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(cdi_root, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
