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
The load generator is tools/bench/advisor_load.py; the extender's calls, tools/bench/extender_calls.py.

    python -m tools.bench.advisor_grpc [--racks 556] [--rate 2000] [--clients 1] [--out FILE]
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
from libs.hardware.cluster import ClusterDescription
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
from tools.bench.simenv import etcd_fsync, fs_label, private_etcd, remove_tree, scratch_dir, stop_process
from tools.bench.stats import percentile

TARGET_P99_MS = 1.0
TARGET_RESERVE_P99_MS = 5.0
TARGET_EXTENDER_P99_MS = 10.0
TARGET_RATE = 2000.0


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
        advisor = start_advisor(etcd.endpoint, prefix, base / "advisor.log")
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

                def open_jobs(shape: str, mix: list[bytes], release: bool) -> list[dict[str, Any]]:
                    """One open-loop job per client; run_phase sets their common start."""
                    return [
                        {
                            "kind": "open",
                            "port": advisor.port,
                            "shape": shape,
                            "requests": mix,
                            "rate": args.rate / args.clients,
                            "seconds": args.seconds,
                            "release": release,
                        }
                        for _ in range(args.clients)
                    ]

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
                    phases["open_loop"] = run_phase(pool, advisor, open_jobs(shape, requests, False))
                    phases["open_loop"]["offered_per_s"] = args.rate
                    phases["open_loop_reserve"] = run_phase(pool, advisor, open_jobs(shape, reserving, True))
                    phases["open_loop_reserve"]["offered_per_s"] = args.rate
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
