"""Benchmark: NodePrepareResources / NodeUnprepareResources latency on a node whose IMEX daemon
is already READY, through the real unix-socket gRPC of a kubelet-plugin (node-agent) process.

Set-up: a private etcd (unless --etcd-endpoint), a one-rack simulated cluster, the node's two
processes with simulated hardware (the IMEX agent: node record and daemon; the kubelet plugin),
a ComputeDomain and an anchor claim prepared first (the node is a member and its daemon READY).
Then `--calls` distinct claims are prepared and unprepared again by `--inflight` concurrent
callers over one connection (default 16: kubelet sends one call per pod with its claims, pods
starting together), each caller unpreparing its previous claim after preparing the next; every
call is timed at the client (kubelet's view). `--inflight 1` is the sequential shape (4 claims
held). Each process's CPU per call (plugin, etcd, this client) is reported beside the latencies,
since other processes on a shared machine inflate wall-clock tails, and so is the plugin's
event-loop thread's: every call needs that one thread, so with `--inflight` calls always
outstanding no latency's mean can be below `inflight` x its CPU per call (``loop_floor_ms``,
Little's law), however idle the machine.

Production settings: etcd's data on disk with fsync, the kubelet dir (checkpoint) and IMEX work
dir on disk, the checkpoint saved with the agent's shipped durability (``checkpoint_fsync``
false: atomic rename, no fsync; docs/operations.md says why), the CDI root on tmpfs as
``/var/run/cdi`` is on a node (``--cdi-on-disk`` moves it). The result's ``settings`` records each.

    python -m tools.bench.nodeagent_prepare [--calls 1000] [--inflight 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from grpclib.client import Channel

from libs.contract.names import DRIVER_NAME
from libs.contract.storeclaims import store_claim
from libs.gen.computedomain.state import v1 as pb
from libs.gen.k8s.io.kubelet.pkg.apis.dra import v1 as dra
from libs.hardware.cluster import ClusterDescription
from libs.hardware.simulated import prepare_node_dirs
from libs.state.config import EtcdConfig
from libs.state.store import Store
from tools.bench import simenv
from tools.bench.proccpu import cpu_seconds
from tools.bench.stats import percentile
from tools.etcd.server import EtcdServer, etcd_binary
from tools.netports import free_port

REPO = Path(__file__).resolve().parents[2]
NODE = "rack0-tray0"
TARGET_P99_MS = 5.0
# Claims kept prepared besides the anchor while the benchmark runs.
WINDOW = 4


def summary(latencies_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in latencies_s]
    return {
        "calls": len(ms),
        "p50_ms": round(percentile(ms, 50), 3),
        "p90_ms": round(percentile(ms, 90), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "max_ms": round(max(ms), 3),
        "mean_ms": round(statistics.fmean(ms), 3),
    }


async def drive(
    stub: dra.DraPluginStub, claims: list[dra.Claim], inflight: int
) -> tuple[list[float], list[float]]:
    """Prepare every claim and unprepare it again, `inflight` calls at a time, as kubelet sends
    them: one call per pod with its claim, pods starting concurrently over one connection.

    Each of the `inflight` callers (a pod slot) prepares its next claim, then unprepares the one
    it prepared before, so the node holds between `inflight` and 2 x `inflight` claims besides
    the anchor (one caller: sequential calls, WINDOW claims held). Returns the latencies (s)."""
    prepare: list[float] = []
    unprepare: list[float] = []
    hold = WINDOW if inflight == 1 else 1

    async def call_prepare(claim: dra.Claim) -> None:
        start = time.perf_counter()
        reply = await stub.node_prepare_resources(dra.NodePrepareResourcesRequest(claims=[claim]), timeout=30)
        prepare.append(time.perf_counter() - start)
        if reply.claims[claim.uid].error:
            raise SystemExit(f"prepare of {claim.uid} failed: {reply.claims[claim.uid].error}")

    async def call_unprepare(claim: dra.Claim) -> None:
        start = time.perf_counter()
        done = await stub.node_unprepare_resources(
            dra.NodeUnprepareResourcesRequest(claims=[claim]), timeout=30
        )
        unprepare.append(time.perf_counter() - start)
        if done.claims[claim.uid].error:
            raise SystemExit(f"unprepare of {claim.uid} failed: {done.claims[claim.uid].error}")

    async def caller(mine: list[dra.Claim]) -> None:
        held: list[dra.Claim] = []
        for claim in mine:
            await call_prepare(claim)
            held.append(claim)
            if len(held) > hold:
                await call_unprepare(held.pop(0))
        for claim in held:
            await call_unprepare(claim)

    await asyncio.gather(*(caller(claims[i::inflight]) for i in range(inflight)))
    return prepare, unprepare


def claim_record(uid: str, domain_uid: str) -> pb.Claim:
    return store_claim(uid=uid, namespace="bench", name=f"claim-{uid[:8]}", node=NODE, domain_uid=domain_uid)


Processes = dict[str, tuple[subprocess.Popen[bytes], Path]]  # name -> (process, its log)


def _serving(path: Path, processes: Processes) -> bool:
    for name, (proc, log) in processes.items():
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited {proc.returncode}:\n{log.read_text()[-4000:]}")
    return path.exists()


async def wait_socket(path: Path, processes: Processes, timeout_s: float = 30.0) -> None:
    """Wait for the plugin's DRA socket (served once the IMEX agent registered the node)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _serving(path, processes):
            return
        await asyncio.sleep(0.05)
    raise SystemExit(f"the kubelet plugin did not serve {path} within {timeout_s}s")


def start_agent(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(
            argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)}
        )


def stop_agent(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


async def bench(
    args: argparse.Namespace, base: Path, cdi_root: Path, endpoint: str, etcd_pid: int | None
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
    imex_argv = [
        sys.executable, "-m", "services.imexagent.main", *hardware, *common,
        "--health-port", str(free_port()),
        "--node-ip", cluster.node(NODE).address, "--imex-work-dir", str(base / "imex"),
        "--kubelet-dir", str(kubelet_dir), "--cdi-root", str(cdi_root),
        # The benchmark leaves no daemon behind (on a node they outlive the agent).
        "--stop-daemons-on-exit", "true",
    ]  # fmt: skip
    plugin_argv = [
        sys.executable, "-m", "services.nodeagent.main", *hardware, *common,
        "--health-port", str(free_port()),
        "--kubelet-dir", str(kubelet_dir), "--cdi-root", str(cdi_root),
        "--tombstone-ttl-s", str(args.tombstone_ttl_s),
    ]  # fmt: skip
    processes: Processes = {}
    for name, argv in (("IMEX agent", imex_argv), ("kubelet plugin", plugin_argv)):
        log_path = base / f"{name.replace(' ', '-').lower()}.log"
        processes[name] = (start_agent(argv, log_path), log_path)
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
                    uid=domain_uid, namespace="bench", name="bench", mesh_mode=pb.MeshMode.PLAINTEXT
                ),
            )
            uids = [str(uuid.uuid4()) for _ in range(args.calls + 1)]
            for uid in uids:
                await store.put(store.keys.claim(uid), claim_record(uid, domain_uid))
        claims = [dra.Claim(namespace="bench", uid=u, name=f"claim-{u[:8]}") for u in uids]
        channel = Channel(path=str(socket_path))
        stub = dra.DraPluginStub(channel)
        try:
            anchor = await stub.node_prepare_resources(
                dra.NodePrepareResourcesRequest(claims=claims[:1]), timeout=60
            )
            if anchor.claims[uids[0]].error:
                raise SystemExit(f"anchor claim failed: {anchor.claims[uids[0]].error}")
            plugin_pid = processes["kubelet plugin"][0].pid
            # The plugin's main thread runs its event loop, through which every call passes.
            pids: dict[str, tuple[int, int | None]] = {
                "plugin": (plugin_pid, None),
                "plugin_loop": (plugin_pid, plugin_pid),
                **({"etcd": (etcd_pid, None)} if etcd_pid else {}),
            }
            cpu_before = {name: cpu_seconds(*ids) for name, ids in pids.items()}
            client_before, wall_start = time.process_time(), time.perf_counter()
            prepare, unprepare = await drive(stub, claims[1:], args.inflight)
            wall = time.perf_counter() - wall_start
            # CPU per call (prepare and unprepare alike) of each process over the timed calls:
            # what the figures cost, independent of how busy the machine was.
            calls = len(prepare) + len(unprepare)
            cpu_ms = {
                name: round((cpu_seconds(*ids) - cpu_before[name]) * 1000 / calls, 3)
                for name, ids in pids.items()
            }
            cpu_ms["client"] = round((time.process_time() - client_before) * 1000 / calls, 3)
        finally:
            channel.close()
    finally:
        # The plugin first, as on a node where it is upgraded; then the IMEX agent, which stops
        # the daemon.
        for proc, _ in reversed(processes.values()):
            stop_agent(proc)
    prepare_stats, unprepare_stats = summary(prepare), summary(unprepare)
    return {
        "benchmark": "nodeagent_prepare",
        "description": "NodePrepareResources / NodeUnprepareResources on a node with a READY IMEX daemon, "
        + (
            f"sequential calls over the DRA unix socket (v1), {WINDOW} claims held besides the anchor, "
            if args.inflight == 1
            else f"{args.inflight} calls in flight over one connection to the DRA unix socket (v1), one "
            f"claim each, {args.inflight}-{2 * args.inflight} claims held besides the anchor, "
        )
        + "simulated hardware, etcd on loopback",
        "settings": {
            "node_dirs": simenv.fs_label(base),
            "checkpoint_fsync": simenv.checkpoint_fsync_default(),
            "cdi_root": simenv.fs_label(cdi_root),
            "mesh": "plaintext",
            "calls": args.calls,
            "inflight": args.inflight,
            "claims_held_besides_anchor": WINDOW
            if args.inflight == 1
            else f"{args.inflight}-{2 * args.inflight}",
            "tombstone_ttl_s": args.tombstone_ttl_s,
            "cpu_count": os.cpu_count(),
        },
        "prepare": prepare_stats,
        "unprepare": unprepare_stats,
        "calls_per_s": round(calls / wall, 1),
        "cpu_ms_per_call": cpu_ms,
        # Little's law: `inflight` calls always outstanding, each needing this much of the one
        # event-loop thread, so no mean latency (and no p99) can be lower at this CPU per call.
        "loop_floor_ms": round(args.inflight * cpu_ms["plugin_loop"], 3),
        "target_p99_ms": TARGET_P99_MS,
        "meets_target": prepare_stats["p99_ms"] <= TARGET_P99_MS
        and unprepare_stats["p99_ms"] <= TARGET_P99_MS,
        "tombstone_ttl_s": args.tombstone_ttl_s,
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


async def run(args: argparse.Namespace, base: Path, cdi_root: Path) -> dict[str, Any]:
    server: EtcdServer | None = None
    # etcd's data on disk, fsynced, as a control plane keeps it (tools/bench/simenv.py).
    etcd_dir = simenv.scratch_dir("nabench-etcd-")
    try:
        endpoint = args.etcd_endpoint
        if not endpoint:
            server = EtcdServer(data_dir=etcd_dir / "etcd", binary=etcd_binary())
            server.start()
            endpoint = server.endpoint
        result = await bench(
            args, base, cdi_root, endpoint, server.process.pid if server and server.process else None
        )
        # What etcd was given is known only for a private one.
        result["settings"]["etcd_data"] = "external" if args.etcd_endpoint else simenv.fs_label(etcd_dir)
        result["settings"]["etcd_fsync"] = "external" if args.etcd_endpoint else simenv.etcd_fsync()
        return result
    finally:
        if server is not None:
            server.destroy()
        shutil.rmtree(etcd_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="nodeagent_prepare", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000, help="prepare (and unprepare) calls to time")
    parser.add_argument(
        "--inflight",
        type=int,
        default=16,
        help="calls in flight at once, one claim each, as kubelet sends them for pods starting "
        "together (1: sequential calls)",
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
    parser.add_argument("--out", type=Path, help="also write the result as JSON to this file")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error("--calls must be >= 1")
    if not 1 <= args.inflight <= args.calls:
        parser.error(f"--inflight must be between 1 and --calls ({args.calls}), not {args.inflight}")
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
