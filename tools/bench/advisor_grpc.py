"""Benchmark: placement decisions through the gRPC API of a real advisor process at 10,000 nodes.

Set-up: a private etcd holding 10,008 node records (556 NVL72 racks) of which `--busy` (70 %)
are bound to running domains; one `cd-placement-advisor` process following that store. Load
comes from client processes (grpcio, requests pre-encoded, answers counted but not decoded, the
way load generators such as ghz work) sending dry-run Place requests: sizes 1-18 (single clique
preferred), some 36/54-node jobs in segments of 18, some requiring one clique.

For each RPC shape (unary `Place`, and `PlaceStream`: one long-lived stream per client
connection, one answer per request), each reported on its own, four phases:
1. single client, one request in flight: the latency of an unloaded service;
2. open loop at `--rate` decisions/s (default 2,000, the target) spread over the clients:
   latency measured from the scheduled send time, so a server that falls behind pays for it;
3. closed loop, many requests in flight: the most decisions/s the service sustains;
4. open loop at `--rate` with reservations, as a scheduler places: the same mix with reserve=true
   (not dry-run), so each decision writes its reservation to etcd (lease and guarded transaction,
   services/advisor/reservations.py) before it answers. The client releases each reservation as
   its answer arrives (untimed; the releases load the same advisor and etcd), so the free nodes
   stay as they were.
The server's CPU time per decision (from /proc) is reported beside the wall-clock figures,
since other processes on the machine inflate wall-clock tails.

Then the kube-scheduler extender (services/advisor/extender.py) of the same process, called as
kube-scheduler calls it: one request at a time, ExtenderArgs JSON with the pod and either the
candidate names (nodeCacheCapable) or whole v1.Node objects. kube-scheduler sends extenders the
feasible nodes it found, by default max(100, 5 %) of the cluster's nodes at this size
(`--extender-candidates`, default 500 of 10,008). Pods belong to ComputeDomains whose nodes are
reserved (a first Filter per domain, untimed, reserves them); the candidates are the domain's
reserved nodes plus a random sample of the others. Filter and Prioritize are timed separately.

etcd keeps its data on disk and fsyncs (tools/bench/simenv.py); the result's ``settings`` says so.

    python -m tools.bench.advisor_grpc [--racks 556] [--rate 2000] [--clients 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import random
import selectors
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libs.gen.computedomain.placement import v1 as pp
from libs.gen.computedomain.state import v1 as pb
from libs.hardware.cluster import ClusterDescription
from libs.state.config import EtcdConfig
from libs.state.store import Store
from services.advisor import wire
from tools.bench.scale_inventory import cpu_seconds
from tools.bench.simenv import etcd_fsync, fs_label, private_etcd, remove_tree, scratch_dir, stop_process

REPO = Path(__file__).resolve().parents[2]
TARGET_P99_MS = 1.0
TARGET_RESERVE_P99_MS = 5.0
TARGET_EXTENDER_P99_MS = 10.0
TARGET_RATE = 2000.0
PLACE = "/computedomain.placement.v1.PlacementAdvisor/Place"
PLACE_STREAM = "/computedomain.placement.v1.PlacementAdvisor/PlaceStream"
RELEASE = "/computedomain.placement.v1.PlacementAdvisor/Release"
OPEN_LOOP_STREAMS = 8
# A reservation outlives its release only if the client dies; then it expires soon.
RESERVATION_TTL_S = 30
NAMESPACE = "bench"


def feasible_nodes_to_find(nodes: int) -> int:
    """How many feasible nodes kube-scheduler looks for (and sends extenders) with its default
    adaptive percentageOfNodesToScore (numFeasibleNodesToFind in pkg/scheduler/schedule_one.go)."""
    if nodes < 100:
        return nodes
    percentage = max(50 - nodes // 125, 5)
    return max(nodes * percentage // 100, 100)


# ---- set-up -----------------------------------------------------------------------------------


async def seed_store(endpoint: str, prefix: str, racks: int, busy: float, seed: int) -> int:
    cluster = ClusterDescription(racks=racks, seed=f"grpc-bench-{seed}")
    rng = random.Random(seed)
    store = Store(EtcdConfig(endpoint=endpoint, prefix=prefix, timeout_s=30.0))
    await store.connect()
    try:
        sem = asyncio.Semaphore(64)

        async def put(key: str, value: Any) -> None:
            async with sem:
                await store.put(key, value)

        writes = []
        for node in cluster.nodes():
            gpus = [
                pb.Gpu(
                    uuid=f"GPU-{node.name}-{i}",
                    index=i,
                    clique_id=node.clique,
                    fabric_state=pb.FabricState.COMPLETED,
                    health=pb.Health.HEALTHY,
                )
                for i in range(4)
            ]
            record = pb.Node(
                name=node.name,
                ip_address=node.address,
                clique_id=node.clique,
                cluster_uuid=node.cluster_uuid,
                gpus=gpus,
                health=pb.Health.HEALTHY,
            )
            writes.append(put(store.keys.node(node.name), record))
        # Busy nodes come in whole jobs of 1-18 nodes inside one rack, as a packed cluster has them.
        bound = 0
        target = int(busy * cluster.node_count)
        racks_order = list(range(racks))
        rng.shuffle(racks_order)
        job = 0
        for rack in racks_order * 2:
            if bound >= target:
                break
            tray = 0
            while tray < 18 and bound < target:
                size = min(rng.choice([1, 2, 4, 4, 8, 8, 9, 16]), 18 - tray, target - bound)
                if rng.random() < 0.3:
                    tray += size  # a hole: free nodes between jobs
                    continue
                for t in range(tray, tray + size):
                    name = f"rack{rack}-tray{t}"
                    writes.append(
                        put(
                            store.keys.node_binding(name),
                            pb.NodeBinding(node_name=name, domain_uid=f"job-{job}"),
                        )
                    )
                bound += size
                tray += size
                job += 1
        await asyncio.gather(*writes)
        return cluster.node_count
    finally:
        await store.close()


@dataclass
class AdvisorProcess:
    proc: subprocess.Popen[bytes]
    port: int
    extender_port: int

    # etcd's process, whose CPU per decision is reported beside the advisor's.
    etcd_pid: int = 0

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)

    def loop_cpu_seconds(self) -> float:
        """CPU of the advisor's main thread, which runs its event loop: every decision needs it."""
        return cpu_seconds(self.proc.pid, self.proc.pid)

    def etcd_cpu_seconds(self) -> float:
        return cpu_seconds(self.etcd_pid) if self.etcd_pid else 0.0


def start_advisor(endpoint: str, prefix: str, log: Path, timeout_s: float = 120.0) -> AdvisorProcess:
    out = log.open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.advisor.main",
            "--etcd-endpoint",
            endpoint,
            "--etcd-prefix",
            prefix,
            "--grpc-host",
            "127.0.0.1",
            "--grpc-port",
            "0",
            "--extender-enabled",
            "true",
            "--extender-host",
            "127.0.0.1",
            "--extender-port",
            "0",
            # The load generator is one holder standing for many schedulers' pods; when the advisor
            # falls behind, its unreleased reservations would pass the per-holder cap (1,024 nodes)
            # and end the phase instead of measuring it.
            "--max-reserved-nodes-per-holder",
            "0",
            "--health-host",
            "127.0.0.1",
            "--health-port",
            "0",
            "--log-format",
            "json",
            "--log-level",
            "info",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=out,
    )
    deadline = time.monotonic() + timeout_s
    port = extender_port = 0
    synced = False
    while time.monotonic() < deadline and not (port and extender_port and synced):
        if proc.poll() is not None:
            raise RuntimeError(f"advisor exited with {proc.returncode}; see {log}")
        for line in log.read_text().splitlines():
            if '"gRPC listening"' in line:
                port = json.loads(line)["port"]
            if '"extender listening"' in line:
                extender_port = json.loads(line)["port"]
            if '"inventory synced"' in line:
                synced = True
        time.sleep(0.2)
    if not (port and extender_port and synced):
        stop_process(proc)
        raise RuntimeError(f"advisor not ready within {timeout_s} s; see {log}")
    return AdvisorProcess(proc, port, extender_port)


def request_mix(count: int, seed: int, reserve: bool = False) -> list[bytes]:
    """The same sizes and modes either way: dry-run decisions, or decisions that reserve."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.05:
            size = rng.choice([36, 54])
            msg = pp.PlaceRequest(num_nodes=size, mode=pp.PlacementMode.ALLOW_SPLIT, segment_size=18)
        elif roll < 0.25:
            msg = pp.PlaceRequest(num_nodes=rng.randint(1, 18))
        else:
            msg = pp.PlaceRequest(
                num_nodes=rng.choice([1, 2, 2, 4, 4, 4, 8, 8, 8, 9, 12, 16, 16, 18]),
                mode=pp.PlacementMode.PREFER_SINGLE_CLIQUE,
            )
        if reserve:
            msg.reserve = True
            msg.reservation_ttl_seconds = RESERVATION_TTL_S
            msg.holder = "bench"
        else:
            msg.dry_run = True
        out.append(bytes(msg))
    return out


def reservation_id_of(answer: bytes) -> str:
    """PlaceResponse.reservation_id (field 8), read with the advisor's own field scanner: the load
    generator shares the cores with the advisor, so it decodes no more than it needs."""
    for number, wire_type, value in wire._fields(answer):
        if number == 8 and wire_type == 2 and isinstance(value, bytes):
            return value.decode()
    return ""


# ---- the scheduler extender (called from this process, as kube-scheduler calls it) --------------


async def seed_domains(endpoint: str, prefix: str, count: int, seed: int) -> list[tuple[str, str]]:
    """`count` ComputeDomains (uid, workload template name) of 2-18 nodes, as the controller
    mirrors them: the extender finds a pod's domain by its claim template."""
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    async with Store(EtcdConfig(endpoint=endpoint, prefix=prefix, timeout_s=30.0)) as store:
        for k in range(count):
            uid, template = f"bench-cd-{k}", f"cd-{k}-channel"
            domain = pb.ComputeDomain(
                uid=uid,
                namespace=NAMESPACE,
                name=f"cd-{k}",
                spec=pb.ComputeDomainSpec(
                    num_nodes=rng.choice([2, 4, 8, 16, 18]),
                    channel=pb.ChannelSpec(resource_claim_template_name=template),
                ),
            )
            await store.put(store.keys.domain(uid), domain)
            out.append((uid, template))
    return out


def pod_object(domain: int, template: str, replica: int) -> dict[str, Any]:
    """A worker pod of a ComputeDomain job as kube-scheduler serialises it (v1.Pod)."""
    name = f"cd-{domain}-worker-{replica}"
    return {
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "uid": f"00000000-0000-4000-8000-{domain:06d}{replica:06d}",
            "labels": {"app": f"cd-{domain}", "job-name": f"cd-{domain}-worker"},
            "annotations": {},
        },
        "spec": {
            "containers": [
                {
                    "name": "worker",
                    "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                    "command": ["torchrun", "--nnodes", "4", "train.py"],
                    "resources": {
                        "limits": {"nvidia.com/gpu": "4"},
                        "claims": [{"name": "imex-channel"}],
                    },
                }
            ],
            "resourceClaims": [{"name": "imex-channel", "resourceClaimTemplateName": template}],
            "schedulerName": "default-scheduler",
            "restartPolicy": "Never",
        },
        "status": {"phase": "Pending"},
    }


def node_object(name: str, clique: str, address: str) -> dict[str, Any]:
    """A GB200 node as kube-scheduler serialises it (v1.Node): labels from the GPU operator's
    feature discovery, capacity, conditions and a short image list."""
    gpu_labels = {
        "nvidia.com/gpu.clique": clique,
        "nvidia.com/gpu.product": "NVIDIA-GB200",
        "nvidia.com/gpu.count": "4",
        "nvidia.com/gpu.memory": "189471",
        "nvidia.com/gpu.family": "blackwell",
        "nvidia.com/gpu.machine": "GB200-NVL72",
        "nvidia.com/cuda.driver-version.full": "570.124.06",
        "nvidia.com/cuda.runtime-version.full": "12.8",
        "nvidia.com/gpu.deploy.driver": "true",
        "nvidia.com/gpu.present": "true",
    }
    conditions = [
        {
            "type": kind,
            "status": "True" if kind == "Ready" else "False",
            "lastHeartbeatTime": "2026-01-01T00:00:00Z",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
            "reason": f"Kubelet{kind}",
            "message": f"kubelet reports {kind}",
        }
        for kind in ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")
    ]
    images = [
        {
            "names": [f"nvcr.io/nvidia/image-{i}@sha256:{i:064x}", f"nvcr.io/nvidia/image-{i}:25.01"],
            "sizeBytes": 10**9,
        }
        for i in range(8)
    ]
    resources = {
        "cpu": "144",
        "memory": "898Gi",
        "pods": "110",
        "ephemeral-storage": "3500Gi",
        "nvidia.com/gpu": "4",
        "hugepages-2Mi": "0",
    }
    return {
        "metadata": {
            "name": name,
            "uid": f"node-{name}",
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "arm64",
                "node.kubernetes.io/instance-type": "gb200-nvl72",
                "topology.kubernetes.io/zone": "zone-a",
                **gpu_labels,
            },
            "annotations": {
                "node.alpha.kubernetes.io/ttl": "0",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
            },
        },
        "spec": {"podCIDR": "10.244.0.0/24", "providerID": f"bench://{name}"},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": address}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": name,
                "kernelVersion": "6.8.0-1021-nvidia-64k",
                "osImage": "Ubuntu 24.04.1 LTS",
                "containerRuntimeVersion": "containerd://1.7.24",
                "kubeletVersion": "v1.33.1",
                "operatingSystem": "linux",
                "architecture": "arm64",
            },
            "images": images,
        },
    }


def _post(conn: http.client.HTTPConnection, path: str, body: bytes) -> bytes:
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"extender {path}: HTTP {resp.status}: {data[:300]!r}")
    return data


def bench_extender(
    advisor: AdvisorProcess, endpoint: str, prefix: str, args: argparse.Namespace
) -> dict[str, Any]:
    """p50/p99 of Filter and Prioritize, for node names and for whole Node objects."""
    port = advisor.extender_port
    cluster = ClusterDescription(racks=args.racks, seed=f"grpc-bench-{args.seed}")
    nodes = {n.name: n for n in cluster.nodes()}
    names = list(nodes)
    candidates = min(args.extender_candidates or feasible_nodes_to_find(len(names)), len(names))
    domains = asyncio.run(seed_domains(endpoint, prefix, args.extender_domains, args.seed))
    rng = random.Random(args.seed)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    # First pod of each domain, untimed: the extender reserves the domain's nodes.
    held: list[list[str]] = []
    for k, (_, template) in enumerate(domains):
        body = json.dumps({"Pod": pod_object(k, template, 0), "Nodes": None, "NodeNames": names}).encode()
        reply = json.loads(_post(conn, "/filter", body))
        if reply["Error"] or not reply["NodeNames"]:
            failed = {**(reply["FailedNodes"] or {}), **(reply["FailedAndUnresolvableNodes"] or {})}
            why = reply["Error"] or next(iter(failed.values()), "no candidate was kept")
            raise RuntimeError(
                f"ComputeDomain cd-{k}: the Filter of its first pod kept no node: {why}. With "
                f"--racks {args.racks} --busy {args.busy} its nodes may not be free in one clique: "
                "lower --busy or add racks"
            )
        held.append(list(reply["NodeNames"]))
    bodies: dict[str, list[bytes]] = {"node_names": [], "nodes": []}
    sizes: dict[str, list[int]] = {"node_names": [], "nodes": []}
    for j in range(args.extender_bodies):
        k = j % len(domains)
        mine = set(held[k])
        others = rng.sample([n for n in names if n not in mine], candidates - len(mine))
        chosen = held[k] + others
        rng.shuffle(chosen)
        pod = pod_object(k, domains[k][1], 1 + j)
        for payload in bodies:
            if payload == "node_names":
                args_obj: dict[str, Any] = {"Pod": pod, "Nodes": None, "NodeNames": chosen}
            else:
                items = [node_object(n, nodes[n].clique, nodes[n].address) for n in chosen]
                args_obj = {"Pod": pod, "Nodes": {"metadata": {}, "items": items}, "NodeNames": None}
            body = json.dumps(args_obj).encode()
            bodies[payload].append(body)
            sizes[payload].append(len(body))
    out: dict[str, Any] = {
        "candidates": candidates,
        "domains": len(domains),
        "calls": args.extender_calls,
        "body_kb": {p: round(statistics.fmean(v) / 1024, 1) for p, v in sizes.items()},
        # Waited for the advisor and etcd to be idle (the gRPC phases' work digested) first.
        "settled_s": wait_quiet(advisor),
    }
    for verb in ("filter", "prioritize"):
        for payload, payload_bodies in bodies.items():
            latencies: list[float] = []
            cpu0 = etcd0 = 0.0
            for call in range(args.extender_calls + 5):
                if call == 5:
                    cpu0, etcd0 = advisor.cpu_seconds(), advisor.etcd_cpu_seconds()
                body = payload_bodies[call % len(payload_bodies)]
                t0 = time.perf_counter()
                reply = _post(conn, f"/{verb}", body)
                elapsed = time.perf_counter() - t0
                if call < 5:
                    continue  # warm-up: the body's first parse, caches
                latencies.append(elapsed)
                if verb == "filter" and b'"Error": ""' not in reply and b'"Error":""' not in reply:
                    raise RuntimeError(f"extender filter answered an error: {reply[:300]!r}")
            out[f"{verb}_{payload}"] = {
                "p50_ms": round(_pct(latencies, 0.50) * 1e3, 3),
                "p99_ms": round(_pct(latencies, 0.99) * 1e3, 3),
                "max_ms": round(max(latencies) * 1e3, 3),
                "mean_ms": round(statistics.fmean(latencies) * 1e3, 3),
                # What the advisor and etcd spent per timed call.
                "advisor_cpu_ms_per_call": round((advisor.cpu_seconds() - cpu0) / len(latencies) * 1e3, 3),
                "etcd_cpu_ms_per_call": round((advisor.etcd_cpu_seconds() - etcd0) / len(latencies) * 1e3, 3),
            }
            print(f"extender {verb} {payload}: {json.dumps(out[f'{verb}_{payload}'])}", file=sys.stderr)
    conn.close()
    return out


# ---- load generation (runs in client processes) --------------------------------------------------


async def _closed_loop(
    port: int, shape: str, requests: list[bytes], inflight: int, until: float
) -> list[float]:
    import grpc

    latencies: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        if shape == "unary":
            call = channel.unary_unary(PLACE)

            async def worker(k: int) -> None:
                i = k
                while time.time() < until:
                    t0 = time.perf_counter()
                    await call(requests[i % len(requests)])
                    latencies.append(time.perf_counter() - t0)
                    i += inflight

        else:
            make = channel.stream_stream(PLACE_STREAM)

            async def worker(k: int) -> None:
                stream = make()
                i = k
                while time.time() < until:
                    t0 = time.perf_counter()
                    await stream.write(requests[i % len(requests)])
                    await stream.read()
                    latencies.append(time.perf_counter() - t0)
                    i += inflight
                await stream.done_writing()

        await asyncio.gather(*(worker(k) for k in range(inflight)))
    return latencies


async def _open_loop(
    port: int,
    shape: str,
    requests: list[bytes],
    rate: float,
    start: float,
    seconds: float,
    lags: list[float],
    from_send: list[float],
    reserved: list[str] | None = None,
) -> list[float]:
    """Send at a fixed rate from `start` (wall clock); latency counts from the scheduled send time.

    `lags` receives how late each request left this process (scheduling plus the write itself):
    when it is large, the load generator, not the service, is the bottleneck. `from_send` gets the
    latency counted from when the request actually started to leave (the generator's lag excluded).
    With `reserved`, each answer's reservation is released once it arrives (untimed) and its id
    recorded there.
    """
    import grpc

    latencies: list[float] = []
    count = int(rate * seconds)
    interval = 1.0 / rate
    releases: list[asyncio.Future[Any]] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        release = channel.unary_unary(RELEASE)

        def settle(answer: bytes) -> None:
            if reserved is None:
                return
            rid = reservation_id_of(answer)
            if rid:
                reserved.append(rid)
                releases.append(asyncio.ensure_future(release(bytes(pp.ReleaseRequest(reservation_id=rid)))))

        await asyncio.sleep(max(0.0, start - time.time()))
        base_wall, base_perf = time.time(), time.perf_counter()
        offset = start - base_wall
        if shape == "unary":
            call = channel.unary_unary(PLACE)

            async def one(i: int, due: float) -> None:
                begun = time.perf_counter()
                lags.append(begun - due)
                answer = await call(requests[i % len(requests)])
                now = time.perf_counter()
                latencies.append(now - due)
                from_send.append(now - begun)
                settle(answer)

            tasks = []
            for i in range(count):
                due = base_perf + offset + i * interval
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i, due)))
            await asyncio.gather(*tasks)
        else:
            # Several streams, each with its own writer pacing its share of the requests (so one slow
            # write does not delay the others) and its own reader; each stream answers in order.
            streams = [channel.stream_stream(PLACE_STREAM)() for _ in range(OPEN_LOOP_STREAMS)]

            async def drive(k: int) -> None:
                stream = streams[k]
                sent: list[float] = []
                begun: list[float] = []

                async def reader(expected: int) -> None:
                    for j in range(expected):
                        answer = await stream.read()
                        now = time.perf_counter()
                        latencies.append(now - sent[j])
                        from_send.append(now - begun[j])
                        settle(answer)

                mine = range(k, count, len(streams))
                read_task = asyncio.create_task(reader(len(mine)))
                for i in mine:
                    due = base_perf + offset + i * interval
                    delay = due - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    sent.append(due)
                    begun.append(time.perf_counter())
                    await stream.write(requests[i % len(requests)])
                    lags.append(time.perf_counter() - due)
                await read_task
                await stream.done_writing()

            await asyncio.gather(*(drive(k) for k in range(len(streams))))
        await asyncio.gather(*releases)
    return latencies


def _fine_timer_loop() -> asyncio.AbstractEventLoop:
    """An event loop whose timers fire within microseconds: epoll, asyncio's default, waits in
    whole milliseconds, so an open loop pacing a request every 0.5 ms sent each one up to 1 ms
    late (its send lag p99 was 1.3-1.4 ms), which the latency from the intended send counts.
    select(2) takes a timeout in microseconds (and this process has few descriptors)."""
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


def _client(job: dict[str, Any]) -> dict[str, Any]:
    """Latencies, first send and last answer (wall clock), and for open loops lags and from-send latencies."""
    requests = job["requests"]
    if job["kind"] == "closed":
        started = time.time()
        latencies = asyncio.run(
            _closed_loop(job["port"], job["shape"], requests, job["inflight"], job["until"])
        )
        return {
            "latencies": latencies,
            "start": started,
            "end": time.time(),
            "lags": [],
            "from_send": latencies,
        }
    lags: list[float] = []
    from_send: list[float] = []
    reserved: list[str] | None = [] if job.get("release") else None
    with asyncio.Runner(loop_factory=_fine_timer_loop) as runner:
        latencies = runner.run(
            _open_loop(
                job["port"],
                job["shape"],
                requests,
                job["rate"],
                job["start"],
                job["seconds"],
                lags,
                from_send,
                reserved,
            )
        )
    return {
        "latencies": latencies,
        "start": job["start"],
        "end": time.time(),
        "lags": lags,
        "from_send": from_send,
        "reserved": len(reserved or []),
    }


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else 0.0


def wait_quiet(
    advisor: AdvisorProcess, busy_below: float = 0.05, window_s: float = 0.5, cap_s: float = 60.0
) -> float:
    """Wait until the advisor and etcd together use less than `busy_below` of a core over
    `window_s` (at most `cap_s`); the seconds waited. A phase that starts while the previous one's
    work is still being digested (a reserving phase's releases and their watch events) would
    measure both."""
    began = time.monotonic()
    while time.monotonic() - began < cap_s:
        before = advisor.cpu_seconds() + advisor.etcd_cpu_seconds()
        time.sleep(window_s)
        if advisor.cpu_seconds() + advisor.etcd_cpu_seconds() - before < busy_below * window_s:
            break
    return round(time.monotonic() - began, 2)


def run_phase(pool: Any, advisor: AdvisorProcess, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    settled_s = wait_quiet(advisor)
    cpu0, etcd0, loop0 = advisor.cpu_seconds(), advisor.etcd_cpu_seconds(), advisor.loop_cpu_seconds()
    started = time.perf_counter()
    results = pool.map(_client, jobs)
    elapsed = time.perf_counter() - started
    cpu = advisor.cpu_seconds() - cpu0
    loop_cpu = advisor.loop_cpu_seconds() - loop0
    etcd_cpu = advisor.etcd_cpu_seconds() - etcd0
    latencies = [x for r in results for x in r["latencies"]]
    lags = [x for r in results for x in r["lags"]]
    from_send = [x for r in results for x in r["from_send"]]
    # Achieved rate: answers over the span from the first send to the last answer.
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {
        "decisions": len(latencies),
        "reservations": sum(r.get("reserved", 0) for r in results),
        "decisions_per_s": round(len(latencies) / span, 1),
        "p50_ms": round(_pct(latencies, 0.50) * 1e3, 3),
        "p99_ms": round(_pct(latencies, 0.99) * 1e3, 3),
        "max_ms": round(max(latencies) * 1e3, 3) if latencies else 0.0,
        "mean_ms": round(statistics.fmean(latencies) * 1e3, 3) if latencies else 0.0,
        "server_cpu_ms_per_decision": round(cpu / max(len(latencies), 1) * 1e3, 4),
        # etcd's share: the reservation writes and the client's releases (dry runs: the watch only).
        "etcd_cpu_ms_per_decision": round(etcd_cpu / max(len(latencies), 1) * 1e3, 4),
        # The event loop's share of the phase: near 1, decisions queue for it whatever the machine.
        "loop_busy": round(loop_cpu / elapsed, 3) if elapsed > 0 else 0.0,
        # What one otherwise idle core could sustain at this CPU cost per decision.
        "per_core_capacity_per_s": round(len(latencies) / cpu, 1) if cpu > 0 else 0.0,
        "elapsed_s": round(elapsed, 2),
        "p99_from_send_ms": round(_pct(from_send, 0.99) * 1e3, 3),
        "client_send_lag_p50_ms": round(_pct(lags, 0.50) * 1e3, 3),
        "client_send_lag_p99_ms": round(_pct(lags, 0.99) * 1e3, 3),
        # How long the phase waited for the advisor and etcd to be idle before it started.
        "settled_s": settled_s,
    }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    base = scratch_dir("advisor-grpc-bench-")
    try:
        return _bench(args, base)
    finally:
        remove_tree(base)  # etcd's data and the advisor's log (CD_BENCH_KEEP=1 keeps them)


def _bench(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    prefix = "/bench/"
    report: dict[str, Any] = {"benchmark": "advisor_grpc", "racks": args.racks, "busy": args.busy}
    with private_etcd(base) as etcd:
        nodes = asyncio.run(seed_store(etcd.endpoint, prefix, args.racks, args.busy, args.seed))
        report["nodes"] = nodes
        advisor = start_advisor(etcd.endpoint, prefix, base / "advisor.log")
        advisor.etcd_pid = etcd.process.pid if etcd.process is not None else 0
        try:
            requests = request_mix(512, args.seed)
            reserving = request_mix(512, args.seed, reserve=True)
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(args.clients) as pool:
                # Warm-up: imports, connections, caches.
                pool.map(
                    _client,
                    [
                        {
                            "kind": "closed",
                            "port": advisor.port,
                            "shape": s,
                            "requests": requests,
                            "inflight": 2,
                            "until": time.time() + 1.0,
                        }
                        for s in ("unary", "stream")
                    ],
                )
                report["loadavg_before"] = os.getloadavg()

                def open_jobs(shape: str, mix: list[bytes], release: bool) -> list[dict[str, Any]]:
                    """One open-loop job per client, starting together in a second."""
                    start = time.time() + 1.0
                    return [
                        {
                            "kind": "open",
                            "port": advisor.port,
                            "shape": shape,
                            "requests": mix,
                            "rate": args.rate / args.clients,
                            "start": start,
                            "seconds": args.seconds,
                            "release": release,
                        }
                        for _ in range(args.clients)
                    ]

                shapes = {}
                for shape in args.shapes.split(","):
                    phases: dict[str, Any] = {}
                    until = time.time() + args.seconds
                    phases["single_client"] = run_phase(
                        pool,
                        advisor,
                        [
                            {
                                "kind": "closed",
                                "port": advisor.port,
                                "shape": shape,
                                "requests": requests,
                                "inflight": 1,
                                "until": until,
                            }
                        ],
                    )
                    phases["open_loop"] = run_phase(pool, advisor, open_jobs(shape, requests, False))
                    phases["open_loop"]["offered_per_s"] = args.rate
                    phases["open_loop_reserve"] = run_phase(pool, advisor, open_jobs(shape, reserving, True))
                    phases["open_loop_reserve"]["offered_per_s"] = args.rate
                    until = time.time() + args.seconds
                    phases["saturation"] = run_phase(
                        pool,
                        advisor,
                        [
                            {
                                "kind": "closed",
                                "port": advisor.port,
                                "shape": shape,
                                "requests": requests,
                                "inflight": args.inflight,
                                "until": until,
                            }
                            for _ in range(args.clients)
                        ],
                    )
                    shapes[shape] = phases
                    print(f"{shape}: {json.dumps(phases)}", file=sys.stderr)
                report["shapes"] = shapes
            if args.extender_calls:
                report["extender"] = bench_extender(advisor, etcd.endpoint, prefix, args)
            report["loadavg_after"] = os.getloadavg()
        finally:
            stop_process(advisor.proc)
    report["cpus"] = os.cpu_count()
    report["settings"] = {
        "etcd_data": fs_label(base),
        "etcd_fsync": etcd_fsync(),
        "nodes": report["nodes"],
        "busy": args.busy,
        "offered_per_s": args.rate,
        "client_processes": args.clients,
        "open_loop_streams_per_client": OPEN_LOOP_STREAMS,
        "phase_seconds": args.seconds,
        "saturation_inflight_per_client": args.inflight,
        "reservation_ttl_s": RESERVATION_TTL_S,
        "max_reserved_nodes_per_holder": "0 (no cap)",
        "extender_candidates": report.get("extender", {}).get("candidates"),
        "extender_calls": args.extender_calls,
        "cpu_count": os.cpu_count(),
    }
    return report


def verdict(report: dict[str, Any]) -> dict[str, Any]:
    """Each shape against each target, on its own."""
    out: dict[str, Any] = {}
    for shape, phases in report["shapes"].items():
        open_loop, reserve, saturation = (
            phases["open_loop"],
            phases["open_loop_reserve"],
            phases["saturation"],
        )
        out[shape] = {
            "p99_at_target_rate_ms": open_loop["p99_ms"],
            "p99_at_target_rate_from_send_ms": open_loop["p99_from_send_ms"],
            "achieved_at_target_rate_per_s": open_loop["decisions_per_s"],
            "max_decisions_per_s": saturation["decisions_per_s"],
            # From the scheduled send time: includes the load generator's own lag.
            "p99_target_met": open_loop["p99_ms"] <= TARGET_P99_MS
            and open_loop["decisions_per_s"] >= 0.97 * TARGET_RATE,
            "rate_target_met": saturation["decisions_per_s"] >= TARGET_RATE,
            "reserve_p99_at_target_rate_ms": reserve["p99_ms"],
            "reserve_achieved_per_s": reserve["decisions_per_s"],
            "reserve_p99_target_met": reserve["p99_ms"] <= TARGET_RESERVE_P99_MS
            and reserve["decisions_per_s"] >= 0.97 * TARGET_RATE,
        }
    extender = report.get("extender")
    if extender:
        for key in ("filter_node_names", "filter_nodes", "prioritize_node_names", "prioritize_nodes"):
            out[f"extender_{key}_p99_target_met"] = extender[key]["p99_ms"] <= TARGET_EXTENDER_P99_MS
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"Placement decisions through gRPC, {report['nodes']:,} nodes ({report['busy'] * 100:.0f} % busy), "
        f"{report['cpus']} CPUs, load average before/after "
        f"{report['loadavg_before'][0]:.1f}/{report['loadavg_after'][0]:.1f}",
        "",
        "| RPC | phase | decisions/s | p50 | p99 | p99 from send | client lag p99 | server CPU per decision "
        "| decisions/s per free core |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = {
        "single_client": "1 client, 1 in flight",
        "open_loop": "open loop at target rate",
        "open_loop_reserve": "open loop at target rate, reserving",
        "saturation": "closed loop, saturated",
    }
    for shape, phases in report["shapes"].items():
        for phase, f in phases.items():
            lines.append(
                f"| {'Place (unary)' if shape == 'unary' else 'PlaceStream'} | {names[phase]} "
                f"| {f['decisions_per_s']:,.0f} | {f['p50_ms']:.2f} ms | {f['p99_ms']:.2f} ms "
                f"| {f['p99_from_send_ms']:.2f} ms | {f['client_send_lag_p99_ms']:.2f} ms "
                f"| {f['server_cpu_ms_per_decision'] * 1000:.0f} µs | {f['per_core_capacity_per_s']:,.0f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="advisor_grpc", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--racks", type=int, default=556, help="NVL72 racks of 18 nodes (556 = 10,008 nodes)")
    parser.add_argument("--busy", type=float, default=0.7, help="fraction of nodes bound to running domains")
    parser.add_argument("--rate", type=float, default=TARGET_RATE, help="open-loop decisions/s")
    parser.add_argument("--clients", type=int, default=1, help="client processes (each its own connection)")
    parser.add_argument(
        "--inflight", type=int, default=16, help="requests in flight per client when saturating"
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each phase")
    parser.add_argument("--shapes", default="stream,unary", help="RPC shapes to measure: stream, unary")
    parser.add_argument(
        "--extender-candidates",
        type=int,
        default=0,
        help="nodes per extender request (default: what kube-scheduler sends at this size, 500 of 10,008)",
    )
    parser.add_argument(
        "--extender-calls",
        type=int,
        default=1000,
        # The p99 of 200 calls is their second slowest: one hiccup of the shared machine set it.
        help="timed calls per extender verb and payload (0 = skip)",
    )
    parser.add_argument("--extender-domains", type=int, default=8, help="ComputeDomains the pods belong to")
    parser.add_argument("--extender-bodies", type=int, default=16, help="distinct request bodies per payload")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the Markdown table here")
    args = parser.parse_args(argv)
    report = bench(args)
    report["verdict"] = verdict(report)
    table = markdown(report)
    print(table)
    print(json.dumps(report["verdict"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    if args.markdown:
        args.markdown.write_text(table)
    met = all(
        value
        for v in report["verdict"].values()
        for key, value in (v.items() if isinstance(v, dict) else [("met", v)])
        if key.endswith("met")
    )
    return 0 if met or not args.check else 1


if __name__ == "__main__":
    raise SystemExit(main())
