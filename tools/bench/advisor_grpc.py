"""Benchmark: placement decisions through the gRPC API of a real advisor process at 10,000 nodes.

Set-up: a private etcd holding 10,008 node records (556 NVL72 racks) of which `--busy` (70 %)
are bound to running domains; one `cd-placement-advisor` process following that store. Load
comes from client processes (grpcio, requests pre-encoded, answers counted but not decoded, the
way load generators such as ghz work) sending dry-run Place requests: sizes 1-18 (single clique
preferred), some 36/54-node jobs in segments of 18, some requiring one clique.

For each RPC shape (unary `Place`, and `PlaceStream`: one long-lived stream per client
connection, one answer per request), each reported on its own, these phases:
1. single client, one request in flight: the latency of an unloaded service;
2. open loop at `--rate` dry-run decisions/s (default 200: what schedulers make, with room):
   latency measured from the scheduled send time, so a server that falls behind pays for it
   (no coordinated omission);
3. open loop at `--reserve-rate` (default 100/s) with reservations, as a scheduler places: the
   same mix with reserve=true (not dry-run), so each decision writes its reservation to etcd
   (lease and guarded transaction, services/advisor/reservations.py) before it answers. The client
   releases each reservation as its answer arrives (untimed; the releases load the same advisor and
   etcd), so the free nodes stay as they were. Beside it, etcd's own put latency (one put at a
   time from this process, the same etcd): the floor of any write;
4. open loop at `--capacity-rate` (default 2,000/s) dry-run: a capacity report;
5. reserving open loops at each of `--reserve-rates` (default 250 to 2,000/s, 2,000 the capacity
   report): the reserving capacity is the highest rate answered in full (97 %) with p99 within
   `--capacity-p99-ms` (250 ms);
6. closed loop, many requests in flight: the most dry-run decisions/s the service sustains.
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
The load generator is tools/bench/advisor_load.py; the extender's calls, tools/bench/extender_calls.py.

    python -m tools.bench.advisor_grpc [--racks 556] [--rate 200] [--reserve-rate 100] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from libs.gen.computedomain.state import v1 as pb
from libs.state.config import EtcdConfig
from libs.state.store import Store
from tools.bench.advisor_load import (
    OPEN_LOOP_LEAD_S,
    OPEN_LOOP_STREAMS,
    RESERVATION_TTL_S,
    request_mix,
    run_client,
)
from tools.bench.advisor_process import AdvisorProcess, start_advisor, wait_quiet
from tools.bench.extender_calls import bench_extender
from tools.bench.simenv import etcd_fsync, fs_label, private_etcd, remove_tree, scratch_dir
from tools.bench.stats import percentile
from tools.launch import stop_process
from tools.sim.hardware.cluster import ClusterDescription

TARGET_P99_MS = 1.0
TARGET_RATE = 200.0
TARGET_RESERVE_P99_MS = 10.0
TARGET_RESERVE_RATE = 100.0
TARGET_EXTENDER_P99_MS = 10.0
# The reserving capacity: decisions/s answered while p99 stays within this.
CAPACITY_P99_MS = 250.0
CAPACITY_RATE = 2000.0
# An open loop keeps up when it answers at least this share of the rate offered.
KEEPS_UP = 0.97


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


async def etcd_put_latencies(endpoint: str, prefix: str, calls: int) -> list[float]:
    """`calls` puts of a reservation-sized value, one at a time, on the advisor's etcd (s each)."""
    store = Store(EtcdConfig(endpoint=endpoint, prefix=prefix, timeout_s=30.0))
    await store.connect()
    try:
        key = f"{prefix}bench-put-floor".encode()
        value = bytes(512)
        latencies = []
        for _ in range(calls):
            began = time.perf_counter()
            await store.client.put(key, value)
            latencies.append(time.perf_counter() - began)
        await store.client.delete(key)
        return latencies
    finally:
        await store.close()


def etcd_put_floor(advisor: AdvisorProcess, endpoint: str, prefix: str, calls: int) -> dict[str, Any]:
    settled_s = wait_quiet(advisor)
    ms = [x * 1e3 for x in asyncio.run(etcd_put_latencies(endpoint, prefix, calls))]
    return {
        "puts": len(ms),
        "p50_ms": round(percentile(ms, 50), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "max_ms": round(max(ms), 3),
        "settled_s": settled_s,
    }


def keeps_up(phase: dict[str, Any], p99_ms: float) -> bool:
    return bool(phase["decisions_per_s"] >= KEEPS_UP * phase["offered_per_s"] and phase["p99_ms"] <= p99_ms)


def reserve_capacity(ladder: list[dict[str, Any]], p99_ms: float) -> float:
    """The reserving decisions/s of the highest offered rate that was kept up with (0: none)."""
    kept = [phase for phase in ladder if keeps_up(phase, p99_ms)]
    return max((phase["decisions_per_s"] for phase in kept), default=0.0)


def run_phase(pool: Any, advisor: AdvisorProcess, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Run `jobs` in the client processes once the advisor and etcd are idle; the phase's figures."""
    settled_s = wait_quiet(advisor)
    # Timed from here, not from when the jobs were made: the open loops start together, once the
    # clients had time to connect.
    start = time.time() + OPEN_LOOP_LEAD_S
    jobs = [{**job, "start": start} if job["kind"] == "open" else job for job in jobs]
    cpu0, etcd0, loop0 = advisor.cpu_seconds(), advisor.etcd_cpu_seconds(), advisor.loop_cpu_seconds()
    started = time.perf_counter()
    results = pool.map(run_client, jobs)
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
        "p50_ms": round(percentile(latencies, 50) * 1e3, 3),
        "p99_ms": round(percentile(latencies, 99) * 1e3, 3),
        "max_ms": round(max(latencies) * 1e3, 3),
        "mean_ms": round(statistics.fmean(latencies) * 1e3, 3),
        "server_cpu_ms_per_decision": round(cpu / max(len(latencies), 1) * 1e3, 4),
        # etcd's share: the reservation writes and the client's releases (dry runs: the watch only).
        "etcd_cpu_ms_per_decision": round(etcd_cpu / max(len(latencies), 1) * 1e3, 4),
        # The event loop's share of the phase (first send to last answer): near 1, decisions queue
        # for it whatever the machine.
        "loop_busy": round(loop_cpu / span, 3),
        # What one otherwise idle core could sustain at this CPU cost per decision.
        "per_core_capacity_per_s": round(len(latencies) / cpu, 1) if cpu > 0 else 0.0,
        "elapsed_s": round(elapsed, 2),
        "p99_from_send_ms": round(percentile(from_send, 99) * 1e3, 3),
        "client_send_lag_p50_ms": round(percentile(lags, 50) * 1e3, 3) if lags else 0.0,
        "client_send_lag_p99_ms": round(percentile(lags, 99) * 1e3, 3) if lags else 0.0,
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
        advisor = start_advisor(etcd.endpoint, prefix, base / "advisor.log", profile=args.profile_advisor)
        advisor.etcd_pid = etcd.process.pid if etcd.process is not None else 0
        try:
            requests = request_mix(512, args.seed)
            reserving = request_mix(512, args.seed, reserve=True)
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(args.clients) as pool:
                # Warm-up: imports, connections, caches.
                pool.map(
                    run_client,
                    [
                        {
                            "kind": "closed",
                            "port": advisor.port,
                            "shape": s,
                            "requests": requests,
                            "inflight": 2,
                            "seconds": 1.0,
                        }
                        for s in ("unary", "stream")
                    ],
                )
                report["loadavg_before"] = os.getloadavg()

                def open_jobs(
                    shape: str, mix: list[bytes], release: bool, rate: float, seconds: float
                ) -> list[dict[str, Any]]:
                    """One open-loop job per client; run_phase sets their common start."""
                    return [
                        {
                            "kind": "open",
                            "port": advisor.port,
                            "shape": shape,
                            "requests": mix,
                            "rate": rate / args.clients,
                            "seconds": seconds,
                            "release": release,
                        }
                        for _ in range(args.clients)
                    ]

                def open_phase(shape: str, reserve: bool, rate: float, seconds: float) -> dict[str, Any]:
                    mix = reserving if reserve else requests
                    phase = run_phase(pool, advisor, open_jobs(shape, mix, reserve, rate, seconds))
                    phase["offered_per_s"] = rate
                    return phase

                shapes = {}
                for shape in args.shapes.split(","):
                    phases: dict[str, Any] = {}
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
                                "seconds": args.seconds,
                            }
                        ],
                    )
                    phases["open_loop"] = open_phase(shape, False, args.rate, args.target_seconds)
                    phases["open_loop_reserve"] = open_phase(
                        shape, True, args.reserve_rate, args.target_seconds
                    )
                    phases["etcd_put"] = etcd_put_floor(advisor, etcd.endpoint, prefix, args.floor_puts)
                    phases["open_loop_capacity"] = open_phase(shape, False, args.capacity_rate, args.seconds)
                    phases["reserve_ladder"] = [
                        open_phase(shape, True, rate, args.seconds) for rate in args.reserve_rates
                    ]
                    phases["reserve_capacity_per_s"] = reserve_capacity(
                        phases["reserve_ladder"], args.capacity_p99_ms
                    )
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
                                "seconds": args.seconds,
                            }
                            for _ in range(args.clients)
                        ],
                    )
                    shapes[shape] = phases
                    print(f"{shape}: {json.dumps(phases)}", file=sys.stderr, flush=True)
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
        "reserve_offered_per_s": args.reserve_rate,
        "capacity_offered_per_s": args.capacity_rate,
        "reserve_ladder_per_s": args.reserve_rates,
        "capacity_p99_ms": args.capacity_p99_ms,
        "client_processes": args.clients,
        "open_loop_streams_per_client": OPEN_LOOP_STREAMS,
        "target_phase_seconds": args.target_seconds,
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
        open_loop, reserve = phases["open_loop"], phases["open_loop_reserve"]
        out[shape] = {
            "p99_at_target_rate_ms": open_loop["p99_ms"],
            "p99_target_met": keeps_up(open_loop, TARGET_P99_MS),
            "reserve_p99_at_target_rate_ms": reserve["p99_ms"],
            "reserve_p99_target_met": keeps_up(reserve, TARGET_RESERVE_P99_MS),
            "reserve_capacity_per_s": phases["reserve_capacity_per_s"],
            "max_decisions_per_s": phases["saturation"]["decisions_per_s"],
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
    for shape, phases in report["shapes"].items():
        rows = [
            ("1 client, 1 in flight", phases["single_client"]),
            (f"open loop at {phases['open_loop']['offered_per_s']:,.0f}/s", phases["open_loop"]),
            (
                f"open loop at {phases['open_loop_reserve']['offered_per_s']:,.0f}/s, reserving",
                phases["open_loop_reserve"],
            ),
            (
                f"open loop at {phases['open_loop_capacity']['offered_per_s']:,.0f}/s",
                phases["open_loop_capacity"],
            ),
            *((f"open loop at {f['offered_per_s']:,.0f}/s, reserving", f) for f in phases["reserve_ladder"]),
            ("closed loop, saturated", phases["saturation"]),
        ]
        for name, f in rows:
            lines.append(
                f"| {'Place (unary)' if shape == 'unary' else 'PlaceStream'} | {name} "
                f"| {f['decisions_per_s']:,.0f} | {f['p50_ms']:.2f} ms | {f['p99_ms']:.2f} ms "
                f"| {f['p99_from_send_ms']:.2f} ms | {f['client_send_lag_p99_ms']:.2f} ms "
                f"| {f['server_cpu_ms_per_decision'] * 1000:.0f} µs | {f['per_core_capacity_per_s']:,.0f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="advisor_grpc", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--racks", type=int, default=556, help="NVL72 racks of 18 nodes (556 = 10,008 nodes)")
    parser.add_argument("--busy", type=float, default=0.7, help="fraction of nodes bound to running domains")
    parser.add_argument("--rate", type=float, default=TARGET_RATE, help="open-loop dry-run decisions/s")
    parser.add_argument(
        "--reserve-rate", type=float, default=TARGET_RESERVE_RATE, help="open-loop reserving decisions/s"
    )
    parser.add_argument(
        "--capacity-rate",
        type=float,
        default=CAPACITY_RATE,
        help="open-loop dry-run decisions/s reported as capacity",
    )
    parser.add_argument(
        "--reserve-rates",
        type=lambda text: [float(v) for v in text.split(",") if v.strip()],
        default=[250.0, 500.0, 1000.0, 1500.0, 2000.0],
        help="the reserving open loops of the capacity search (comma-separated decisions/s)",
    )
    parser.add_argument(
        "--capacity-p99-ms",
        type=float,
        default=CAPACITY_P99_MS,
        help="p99 a rate must keep to count as capacity",
    )
    parser.add_argument(
        "--target-seconds", type=float, default=20.0, help="length of the phases at the target rates"
    )
    parser.add_argument(
        "--floor-puts", type=int, default=500, help="etcd puts timed beside the reserving phase"
    )
    parser.add_argument("--clients", type=int, default=1, help="client processes (each its own connection)")
    parser.add_argument(
        "--inflight", type=int, default=16, help="requests in flight per client when saturating"
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each capacity phase")
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
    parser.add_argument(
        "--profile-advisor", type=Path, help="run the advisor under cProfile, its stats to this file"
    )
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
