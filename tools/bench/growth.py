"""Benchmark: how cost grows. Formation time against nodes, controller CPU per store event against domains.

1. Formation in simulation (tools/bench/formation.py's set-up: private etcd, one `cd-controller`,
   scale-mode hosts, a simulated IMEX daemon process per node) of one job of 18, 72, 256 and
   1,008 nodes (1, 4, 15 and 56 racks: one IMEX clique per rack); per size the median over its
   repetitions of submit -> Ready.
2. One `cd-controller` process over stores of 100, 1,000 and 5,000 formed domains of 4 members
   (tools/bench/controller_churn.py's population, with 25 % more nodes than members): once it has
   converged, 32 drivers churn the domains (deleted and formed again) for a while; the
   controller's CPU time (user + system, /proc) from the start of the churn until it caught up,
   divided by the store events it handled meanwhile (its own counter).

Each curve is fitted by least squares on log-log axes: value ~ size^k; beside it the slope between
the two largest sizes (the fit over all sizes is pulled down by the small sizes' fixed costs).
Formation grows linearly or better when both are <= 1; the controller's total work grows linearly
with the events (or better) when its CPU per event does not grow, both <= 0. A small tolerance
(0.1) absorbs the noise of a shared machine; the verdict states it.

    python -m tools.bench.growth [--nodes 18,72,256,1008] [--domains 100,1000,5000] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from libs.state.config import EtcdConfig
from libs.state.store import Store
from tools.bench import controller_churn as churn
from tools.bench import formation, simenv
from tools.bench.fit import TOLERANCE, fit_exponent, top_exponent, verdict
from tools.bench.proc_cpu import cpu_seconds
from tools.etcd.server import EtcdServer, etcd_binary

TARGET_1008_S = 30.0
TRAYS_PER_RACK = 18
_CONVERGE_TIMEOUT_S = 900.0


def racks_for(nodes: int) -> int:
    return max(1, math.ceil(nodes / TRAYS_PER_RACK))


# ---- formation ------------------------------------------------------------------------------------


def formation_curve(
    sizes: list[int], reps: dict[int, int], host_processes: int, failures: dict[int, str]
) -> list[dict[str, Any]]:
    """A point per size that formed; `failures` gets the error of each size that did not."""
    points: list[dict[str, Any]] = []
    for nodes in sizes:
        scenario = formation.Scenario(
            f"growth-{nodes}",
            racks=racks_for(nodes),
            nodes=nodes,
            reps=reps.get(nodes, 1),
            mesh_tls=False,
            host_processes=min(host_processes, nodes),
        )
        began = time.monotonic()
        try:
            formation.run_scenario(scenario)
        except (RuntimeError, TimeoutError, OSError) as exc:
            # One size that does not form leaves the others' points (and the controller curve).
            failures[nodes] = f"{type(exc).__name__}: {exc}"[:2000]
            print(
                f"[growth] formation of {nodes} nodes failed: {failures[nodes]}", file=sys.stderr, flush=True
            )
            continue
        summary = formation.summarize(scenario)
        summary["wall_s"] = round(time.monotonic() - began, 1)
        points.append(summary)
        print(
            f"[growth] formation of {nodes} nodes: Ready {summary['ready_p50_s']} s (median of {summary['reps']})",
            file=sys.stderr,
            flush=True,
        )
    return points


# ---- controller -----------------------------------------------------------------------------------


async def controller_point(
    endpoint: str, workdir: Path, domains: int, members: int, churn_s: float
) -> dict[str, Any]:
    nodes = math.ceil(domains * members * 1.25)
    config = EtcdConfig(endpoint=endpoint, prefix=f"/growth-{uuid.uuid4().hex[:8]}/", timeout_s=10.0)
    stores = [Store(config) for _ in range(4)]
    for s in stores:
        await s.connect()
    controller = churn.start_controller(config, workdir)
    pid = controller.proc.pid
    try:
        began, cpu_began = time.monotonic(), cpu_seconds(pid)
        events_began = controller.events_handled(controller.metrics())
        pop = await churn.populate(stores[0], nodes, domains, members)

        def all_ready() -> bool:
            return controller.metrics().get('cd_controller_domains{status="Ready"}', 0) >= domains

        await churn.wait_until(all_ready, _CONVERGE_TIMEOUT_S, f"{domains} domains Ready")
        converge_s = time.monotonic() - began
        converge_cpu = cpu_seconds(pid) - cpu_began
        converge_events = controller.events_handled(controller.metrics()) - events_began
        await asyncio.sleep(1.0)

        before = controller.metrics()
        cpu_before = cpu_seconds(pid)
        stop = asyncio.Event()
        stats = churn.ChurnStats()
        workers = [
            asyncio.create_task(churn.churn_worker(stores[i % len(stores)], pop, stop, stats))
            for i in range(32)
        ]
        await asyncio.sleep(churn_s)
        stop.set()
        await asyncio.gather(*workers)
        target = await stores[0].revision()

        def caught_up() -> bool:
            m = controller.metrics()
            return (
                m.get("cd_controller_view_revision", 0) >= target
                and m.get("cd_controller_workqueue_depth", 1) == 0
                and m.get('cd_controller_domains{status="NotReady"}', 1) == 0
                and m.get('cd_controller_domains{status="Terminating"}', 1) == 0
            )

        catch_up_s = await churn.wait_until(caught_up, 300, "the controller to catch up")
        cpu = cpu_seconds(pid) - cpu_before
        events = controller.events_handled(controller.metrics()) - controller.events_handled(before)
        rss, _ = controller.rss_mb()
    finally:
        controller.stop()
        for s in stores:
            await s.close()
    if events <= 0:
        raise RuntimeError(f"the controller handled no event while {domains} domains churned")
    point = {
        "domains": domains,
        "nodes": nodes,
        "members": members,
        "churn_s": churn_s,
        "domain_cycles": stats.cycles,
        "driver_errors": stats.errors,
        "events": int(events),
        "cpu_s": round(cpu, 3),
        "cpu_ms_per_event": round(cpu / events * 1000, 4),
        "catch_up_s": round(catch_up_s, 2),
        "converge_s": round(converge_s, 1),
        "converge_events": int(converge_events),
        "converge_cpu_ms_per_event": round(converge_cpu / max(1.0, converge_events) * 1000, 4),
        "rss_mb": round(rss, 1),
    }
    print(
        f"[growth] controller at {domains} domains: {point['cpu_ms_per_event']} ms CPU per event "
        f"({events:.0f} events)",
        file=sys.stderr,
        flush=True,
    )
    return point


def controller_curve(sizes: list[int], members: int, churn_s: float) -> list[dict[str, Any]]:
    points = []
    for domains in sizes:
        base = simenv.scratch_dir("growth-ctl-")
        server = EtcdServer(data_dir=base / "etcd", binary=etcd_binary())
        server.start()
        try:
            points.append(asyncio.run(controller_point(server.endpoint, base, domains, members, churn_s)))
        finally:
            server.destroy()
            simenv.remove_tree(base)
    return points


def curve(points: list[dict[str, Any]], x: str, y: str, bound: float) -> dict[str, Any]:
    pairs = [(float(p[x]), float(p[y])) for p in points]
    out: dict[str, Any] = {"x": x, "y": y, "points": [[a, b] for a, b in pairs], "bound": bound}
    try:
        k = fit_exponent(pairs)
    except ValueError as exc:
        out["error"] = str(exc)
        return out
    top = top_exponent(pairs)
    out["exponent"] = round(k, 3)
    out["top_exponent"] = round(top, 3)
    # Linear or better only if the growth between the largest sizes is too, not just on average.
    out["verdict"] = verdict(max(k, top), bound)
    return out


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or any(v < 1 for v in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {text!r}")
    return sorted(set(sizes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="growth", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=parse_sizes, default=[18, 72, 256, 1008], help="formation sizes")
    parser.add_argument("--reps", type=int, default=3, help="formations per size up to 256 nodes")
    parser.add_argument(
        "--reps-large",
        type=int,
        default=3,
        help="formations per size above 256 nodes (formation_1008_s is their median)",
    )
    parser.add_argument("--domains", type=parse_sizes, default=[100, 1000, 5000], help="controller sizes")
    parser.add_argument("--members", type=int, default=4, help="members per domain (controller curve)")
    parser.add_argument("--churn-seconds", type=float, default=15.0, help="churn per controller size")
    parser.add_argument(
        "--host-processes", type=int, default=os.cpu_count() or 1, help="scale host processes per formation"
    )
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.reps < 1 or args.reps_large < 1 or args.members < 1 or args.host_processes < 1:
        parser.error("--reps, --reps-large, --members and --host-processes must be >= 1")
    if args.churn_seconds <= 0:
        parser.error("--churn-seconds must be > 0")
    reps = {n: args.reps if n <= 256 else args.reps_large for n in args.nodes}
    load_before = round(os.getloadavg()[0], 2)
    failures: dict[int, str] = {}
    formations = formation_curve(args.nodes, reps, args.host_processes, failures)
    controllers = controller_curve(args.domains, args.members, args.churn_seconds)
    # formation_1008_s is the largest size asked for: no figure when that one failed.
    largest = next((p for p in formations if p["nodes"] == max(args.nodes)), None)
    result: dict[str, Any] = {
        "benchmark": "growth",
        "settings": {
            **simenv.storage_settings(),
            "mesh": "plaintext",
            "formation_nodes": args.nodes,
            "formation_reps": {str(n): r for n, r in reps.items()},
            "host_processes": args.host_processes,
            "controller_domains": args.domains,
            "members_per_domain": args.members,
            "churn_seconds": args.churn_seconds,
            "churn_workers": 32,
            "growth_tolerance": TOLERANCE,
            "cpu_count": os.cpu_count(),
        },
        "load_average_1m": load_before,
        "load_average_1m_end": round(os.getloadavg()[0], 2),
        "targets": {"formation_1008_s": TARGET_1008_S},
        "formation": {
            "sizes": formations,
            "failed": {str(n): e for n, e in failures.items()},
            "largest_nodes": max(args.nodes),
            **(
                {
                    "largest_ready_p50_s": largest["ready_p50_s"],
                    # Each run of the largest size, so that its spread is reported with the median.
                    "largest_ready_runs_s": [f["ready_s"] for f in largest["formations"]],
                    "largest_ready_spread_s": round(largest["ready_max_s"] - largest["ready_min_s"], 4),
                }
                if largest
                else {}
            ),
            "fit": curve(formations, "nodes", "ready_p50_s", 1.0),
        },
        "controller": {"sizes": controllers, "fit": curve(controllers, "domains", "cpu_ms_per_event", 0.0)},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
