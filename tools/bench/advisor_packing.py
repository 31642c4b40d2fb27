"""Benchmark: packing quality and decision speed of the placement policies on a synthetic trace.

A seeded trace (job arrivals, sizes, durations, node failures) is replayed against each policy
on a simulated NVL72 cluster of ~1,000 and ~10,000 nodes (racks of 18 trays, one clique per rack).
Every placement goes through the advisor's real decision path (`Advisor.decide` on a real
`FleetIndex`); placed jobs bind their nodes, finished jobs free them, failed nodes turn
unhealthy until repaired (a job on a failing node is killed).

Trace (same for every policy):
- arrivals: Poisson, at the rate that offers `--load` (default 0.8) of the cluster;
- sizes: 94 % single-clique jobs of 1-18 nodes (weighted towards 1, 2, 4, 8, 16, 18), mode
  PREFER_SINGLE_CLIQUE; 6 % multi-clique jobs: 36/54/72 nodes in segments of 18
  (ALLOW_SPLIT, segment_size 18) or 24/32/48 nodes as few cliques as possible (PREFER);
- durations: log-normal, mean 1 time unit (sigma 1: many short jobs, a few long ones);
- node failures: Poisson, ~0.5 % of the nodes down at any time, repaired after ~2 time units.
A job that cannot be placed on arrival is rejected (no queue), so fragmentation shows up as
rejections rather than waiting time.

Metrics (over the steady state: the first 20 % of the trace's time is warm-up):
- single-clique fit rate: placed jobs of <= 18 nodes that got one clique / all placed such jobs;
- stranded nodes: free healthy nodes sitting in cliques whose free count is smaller than the
  trace's typical job (the median size of its single-clique jobs): capacity that is free but
  too fragmented for the typical job. Averaged over 400 samples in time; also plotted;
- largest free block: the most free nodes in one clique, averaged over the samples;
- rejection rate: rejected arrivals / arrivals; utilization: busy nodes / nodes, averaged;
- decision latency p50/p99 and decisions/s: time spent in `Advisor.decide` (validation, view,
  policy, node choice, fragmentation before/after), in this process.

    python -m tools.bench.advisor_packing [--jobs-1k 6000 --jobs-10k 30000] [--out results.json]
        [--markdown table.md] [--plot stranded.png] [--seed 7]
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from libs.gen.computedomain.state import v1 as pb
from services.advisor.advisor import Advisor
from services.advisor.fleet_index import FleetIndex
from services.advisor.model import Mode, PlacementRequest, PolicyName
from tools.sim.hardware.cluster import ClusterDescription

TARGET_STRANDED_REDUCTION = 0.30
TARGET_FIT_RATE = 0.99
WARMUP_FRACTION = 0.2
SAMPLES = 400
CLIQUE_SIZE = 18

SMALL_SIZES = {
    1: 8,
    2: 10,
    3: 4,
    4: 14,
    5: 3,
    6: 5,
    7: 2,
    8: 14,
    9: 5,
    10: 3,
    11: 1,
    12: 6,
    13: 1,
    14: 2,
    15: 1,
    16: 8,
    17: 1,
    18: 10,
}
LARGE_JOBS = [
    (36, Mode.ALLOW_SPLIT, 18),
    (54, Mode.ALLOW_SPLIT, 18),
    (72, Mode.ALLOW_SPLIT, 18),
    (24, Mode.PREFER_SINGLE_CLIQUE, 0),
    (32, Mode.PREFER_SINGLE_CLIQUE, 0),
    (48, Mode.PREFER_SINGLE_CLIQUE, 0),
]
LARGE_FRACTION = 0.06
DURATION_SIGMA = 1.0
DOWN_FRACTION = 0.005
REPAIR_MEAN = 2.0


# ---- the trace ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    id: int
    arrival: float
    duration: float
    size: int
    mode: Mode
    segment_size: int


@dataclass(frozen=True, slots=True)
class Failure:
    time: float
    node: str
    repair_after: float


@dataclass
class Trace:
    seed: int
    racks: int
    load: float
    jobs: list[Job]
    failures: list[Failure]
    horizon: float
    typical_job: int


def _mean_size() -> float:
    total = sum(SMALL_SIZES.values())
    small = sum(s * w for s, w in SMALL_SIZES.items()) / total
    large = statistics.fmean(size for size, _, _ in LARGE_JOBS)
    return (1 - LARGE_FRACTION) * small + LARGE_FRACTION * large


def generate_trace(racks: int, jobs: int, seed: int, load: float = 0.8) -> Trace:
    """A reproducible trace for a cluster of `racks` racks of 18 nodes."""
    rng = random.Random(seed)
    nodes = racks * CLIQUE_SIZE
    rate = load * nodes / (_mean_size() * 1.0)  # mean duration 1
    mu = -(DURATION_SIGMA**2) / 2  # log-normal with mean 1
    sizes, weights = zip(*SMALL_SIZES.items(), strict=True)
    out: list[Job] = []
    t = 0.0
    for i in range(jobs):
        t += rng.expovariate(rate)
        duration = rng.lognormvariate(mu, DURATION_SIGMA)
        if rng.random() < LARGE_FRACTION:
            size, mode, segment = rng.choice(LARGE_JOBS)
        else:
            size, mode, segment = rng.choices(sizes, weights)[0], Mode.PREFER_SINGLE_CLIQUE, 0
        out.append(Job(i, t, duration, size, mode, segment))
    horizon = t
    failure_rate = DOWN_FRACTION * nodes / REPAIR_MEAN
    failures = []
    t = rng.expovariate(failure_rate)
    while t < horizon:
        rack, tray = rng.randrange(racks), rng.randrange(CLIQUE_SIZE)
        failures.append(Failure(t, f"rack{rack}-tray{tray}", rng.expovariate(1 / REPAIR_MEAN)))
        t += rng.expovariate(failure_rate)
    typical = int(statistics.median(j.size for j in out if j.size <= CLIQUE_SIZE))
    return Trace(seed, racks, load, out, failures, horizon, typical)


# ---- replay ------------------------------------------------------------------------------------


def _records(cluster: ClusterDescription, health: pb.Health) -> dict[str, pb.Node]:
    out = {}
    for node in cluster.nodes():
        gpus = [
            pb.Gpu(
                uuid=f"GPU-{node.name}-{i}",
                index=i,
                clique_id=node.clique,
                fabric_state=pb.FabricState.COMPLETED,
                health=pb.Health.HEALTHY,
            )
            for i in range(cluster.gpus_per_tray)
        ]
        out[node.name] = pb.Node(
            name=node.name, clique_id=node.clique, cluster_uuid=node.cluster_uuid, gpus=gpus, health=health
        )
    return out


@dataclass
class PolicyResult:
    policy: str
    nodes: int
    arrivals: int = 0
    placed: int = 0
    rejected: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    small_placed: int = 0
    small_single_clique: int = 0
    large_placed: int = 0
    large_arrivals: int = 0
    killed_by_failures: int = 0
    stranded_avg: float = 0.0
    stranded_max: int = 0
    largest_free_block_avg: float = 0.0
    utilization: float = 0.0
    free_avg: float = 0.0
    decision_p50_us: float = 0.0
    decision_p99_us: float = 0.0
    decision_max_us: float = 0.0
    decision_cpu_p50_us: float = 0.0
    decision_cpu_p99_us: float = 0.0
    decisions_per_s: float = 0.0
    decisions: int = 0
    replay_s: float = 0.0
    series: list[tuple[float, int]] = field(default_factory=list)

    @property
    def fit_rate(self) -> float:
        return self.small_single_clique / self.small_placed if self.small_placed else 0.0

    @property
    def rejection_rate(self) -> float:
        return self.rejected / self.arrivals if self.arrivals else 0.0

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["single_clique_fit_rate"] = round(self.fit_rate, 5)
        data["rejection_rate"] = round(self.rejection_rate, 5)
        data["series"] = [(round(t, 4), s) for t, s in self.series]
        for key, value in list(data.items()):
            if isinstance(value, float):
                data[key] = round(value, 4)
        return data


def stranded(fleet: FleetIndex, typical: int) -> int:
    """Free nodes in cliques with fewer free nodes than the typical job."""
    return sum(free * count for free, count in fleet.index.histogram() if free < typical)


def replay(
    trace: Trace, policy: PolicyName, healthy: dict[str, pb.Node], sick: dict[str, pb.Node]
) -> PolicyResult:
    fleet = FleetIndex()
    fleet.synced.update({"nodes", "bindings", "reservations"})
    for name, record in healthy.items():
        fleet.apply_node(name, record)
    advisor = Advisor(fleet, rng=random.Random(trace.seed))
    nodes = len(healthy)
    result = PolicyResult(policy.value, nodes)
    warmup = trace.horizon * WARMUP_FRACTION
    sample_every = (trace.horizon - warmup) / SAMPLES
    next_sample = warmup

    # (time, order, kind, payload): departures before arrivals at equal times.
    events: list[tuple[float, int, str, Any]] = []
    for arrival in trace.jobs:
        events.append((arrival.arrival, 2, "arrive", arrival))
    for planned in trace.failures:
        events.append((planned.time, 1, "fail", planned))
    heapq.heapify(events)
    running: dict[int, list[str]] = {}
    node_job: dict[str, int] = {}
    down: set[str] = set()
    latencies: list[float] = []
    # CPU time of the decision thread: what the decision costs when other work shares the cores.
    cpu_times: list[float] = []
    samples_stranded: list[int] = []
    samples_block: list[int] = []
    samples_busy: list[int] = []
    samples_free: list[int] = []

    def release(job_id: int) -> None:
        for name in running.pop(job_id, []):
            node_job.pop(name, None)
            fleet.apply_binding(name, None)

    gc.collect()
    gc.disable()  # collections would land in random decisions and blur p99
    started = time.perf_counter()
    try:
        while events:
            now, _, kind, payload = heapq.heappop(events)
            while next_sample <= now and next_sample <= trace.horizon:
                s = stranded(fleet, trace.typical_job)
                samples_stranded.append(s)
                samples_block.append(fleet.tally.largest_free_block())
                samples_busy.append(len(node_job))
                samples_free.append(fleet.tally.free_count)
                result.series.append((next_sample, s))
                next_sample += sample_every
            measured = now >= warmup
            if kind == "arrive":
                job: Job = payload
                request = PlacementRequest(
                    num_nodes=job.size, mode=job.mode, segment_size=job.segment_size, policy=policy
                )
                t0, c0 = time.perf_counter(), time.thread_time()
                decision = advisor.decide(request)
                latencies.append(time.perf_counter() - t0)
                cpu_times.append(time.thread_time() - c0)
                if measured:
                    result.arrivals += 1
                    if job.size > CLIQUE_SIZE:
                        result.large_arrivals += 1
                if not decision.feasible:
                    if measured:
                        result.rejected += 1
                        reason = decision.reason.value if decision.reason else "?"
                        result.rejected_by_reason[reason] = result.rejected_by_reason.get(reason, 0) + 1
                    continue
                placed = decision.node_names
                for name in placed:
                    fleet.apply_binding(name, f"job-{job.id}")
                    node_job[name] = job.id
                running[job.id] = placed
                heapq.heappush(events, (now + job.duration, 0, "leave", job.id))
                if measured:
                    result.placed += 1
                    if job.size <= CLIQUE_SIZE:
                        result.small_placed += 1
                        result.small_single_clique += len({s.clique_id for s in decision.segments}) == 1
                    else:
                        result.large_placed += 1
            elif kind == "leave":
                release(payload)
            elif kind == "fail":
                failure: Failure = payload
                if failure.node in down:
                    continue
                down.add(failure.node)
                fleet.apply_node(failure.node, sick[failure.node])
                victim = node_job.get(failure.node)
                if victim is not None:
                    release(victim)
                    if measured:
                        result.killed_by_failures += 1
                heapq.heappush(events, (now + failure.repair_after, 1, "repair", failure.node))
            elif kind == "repair":
                down.discard(payload)
                fleet.apply_node(payload, healthy[payload])
    finally:
        gc.enable()
    result.replay_s = time.perf_counter() - started
    latencies.sort()
    result.decisions = len(latencies)
    result.decision_p50_us = latencies[len(latencies) // 2] * 1e6
    result.decision_p99_us = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e6
    result.decision_max_us = latencies[-1] * 1e6
    result.decisions_per_s = len(latencies) / sum(latencies)
    cpu_times.sort()
    result.decision_cpu_p50_us = cpu_times[len(cpu_times) // 2] * 1e6
    result.decision_cpu_p99_us = cpu_times[min(len(cpu_times) - 1, int(len(cpu_times) * 0.99))] * 1e6
    result.stranded_avg = statistics.fmean(samples_stranded)
    result.stranded_max = max(samples_stranded)
    result.largest_free_block_avg = statistics.fmean(samples_block)
    result.utilization = statistics.fmean(samples_busy) / nodes
    result.free_avg = statistics.fmean(samples_free)
    return result


# ---- reporting ----------------------------------------------------------------------------------


def run_size(racks: int, jobs: int, seed: int, load: float, policies: list[PolicyName]) -> dict[str, Any]:
    trace = generate_trace(racks, jobs, seed, load)
    cluster = ClusterDescription(racks=racks, seed=f"bench-{seed}")
    healthy = _records(cluster, pb.Health.HEALTHY)
    sick = _records(cluster, pb.Health.UNHEALTHY)
    results = {}
    for policy in policies:
        result = replay(trace, policy, healthy, sick)
        results[policy.value] = result
        print(
            f"  {racks * CLIQUE_SIZE} nodes {policy.value:9s} stranded {result.stranded_avg:7.1f} "
            f"fit {result.fit_rate:.4f} rejected {result.rejection_rate:.4f} "
            f"p99 {result.decision_p99_us:7.0f} us ({result.replay_s:.1f} s)",
            file=sys.stderr,
        )
    return {
        "nodes": racks * CLIQUE_SIZE,
        "racks": racks,
        "jobs": jobs,
        "failures": len(trace.failures),
        "horizon": round(trace.horizon, 3),
        "typical_job": trace.typical_job,
        "results": results,
    }


def judge(size: dict[str, Any]) -> dict[str, Any]:
    results: dict[str, PolicyResult] = size["results"]
    best, first = results.get("BEST_FIT"), results.get("FIRST_FIT")
    verdict: dict[str, Any] = {}
    if best is not None and first is not None and first.stranded_avg > 0:
        reduction = 1 - best.stranded_avg / first.stranded_avg
        verdict["stranded_reduction_vs_first_fit"] = round(reduction, 4)
        verdict["stranded_target_met"] = reduction >= TARGET_STRANDED_REDUCTION
    if best is not None:
        verdict["fit_rate_target_met"] = best.fit_rate >= TARGET_FIT_RATE
        verdict["best_fit_p99_us"] = round(best.decision_p99_us, 1)
    return verdict


def markdown(sizes: list[dict[str, Any]]) -> str:
    lines = [
        "| nodes | policy | single-clique fit | stranded nodes (avg) | vs first fit | largest free block (avg) "
        "| rejected | utilization | decision p50 | decision p99 | p99 CPU | decisions/s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in sizes:
        results: dict[str, PolicyResult] = size["results"]
        first = results.get("FIRST_FIT")
        for name, r in results.items():
            versus = (
                f"{(r.stranded_avg / first.stranded_avg - 1) * 100:+.0f} %"
                if first is not None and first.stranded_avg > 0
                else "n/a"
            )
            lines.append(
                f"| {size['nodes']:,} | {name} | {r.fit_rate * 100:.2f} % | {r.stranded_avg:.1f} | {versus} "
                f"| {r.largest_free_block_avg:.1f} | {r.rejection_rate * 100:.2f} % | {r.utilization * 100:.1f} % "
                f"| {r.decision_p50_us:.0f} µs | {r.decision_p99_us:.0f} µs | {r.decision_cpu_p99_us:.0f} µs "
                f"| {r.decisions_per_s:,.0f} |"
            )
    return "\n".join(lines) + "\n"


def plot(sizes: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(sizes), 1, figsize=(10, 3.6 * len(sizes)), squeeze=False)
    for ax, size in zip(axes[:, 0], sizes, strict=True):
        for name, r in size["results"].items():
            ax.plot([t for t, _ in r.series], [s for _, s in r.series], label=name, linewidth=1.0)
        ax.set_title(
            f"{size['nodes']:,} nodes: free nodes stranded in cliques with < {size['typical_job']} free"
        )
        ax.set_yscale("symlog", linthresh=10)
        ax.set_xlabel("time (mean job durations)")
        ax.set_ylabel("stranded nodes")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="advisor_packing", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--jobs-1k", type=int, default=6000, help="jobs in the ~1,000-node trace (0 = skip)")
    parser.add_argument(
        "--jobs-10k", type=int, default=30000, help="jobs in the ~10,000-node trace (0 = skip)"
    )
    parser.add_argument(
        "--racks-1k", type=int, default=56, help="racks of the small cluster (56 x 18 = 1,008)"
    )
    parser.add_argument(
        "--racks-10k", type=int, default=556, help="racks of the large cluster (556 x 18 = 10,008)"
    )
    parser.add_argument("--load", type=float, default=0.8, help="offered load, fraction of the cluster")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--policies", default="BEST_FIT,FIRST_FIT,RANDOM,SPREAD", help="comma-separated policies to replay"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the Markdown table here")
    parser.add_argument("--plot", type=Path, help="write the PNG plot of stranded nodes over time here")
    args = parser.parse_args(argv)
    policies = [PolicyName(p.strip()) for p in args.policies.split(",") if p.strip()]

    load_before = os.getloadavg()
    sizes = []
    for racks, jobs in ((args.racks_1k, args.jobs_1k), (args.racks_10k, args.jobs_10k)):
        if jobs > 0:
            sizes.append(run_size(racks, jobs, args.seed, args.load, policies))
    table = markdown(sizes)
    print(table)
    verdicts = [judge(size) for size in sizes]
    for size, verdict in zip(sizes, verdicts, strict=True):
        print(f"{size['nodes']:,} nodes: {json.dumps(verdict)}")
    if args.markdown:
        args.markdown.write_text(table)
    if args.plot:
        plot(sizes, args.plot)
    if args.out:
        document = {
            "benchmark": "advisor_packing",
            # A replay of the advisor's decision path in this process: no store, no disk.
            "settings": {
                "seed": args.seed,
                "load": args.load,
                "policies": [p.value for p in policies],
                "jobs_1k": args.jobs_1k,
                "jobs_10k": args.jobs_10k,
                "cpus": os.cpu_count(),
            },
            "seed": args.seed,
            "load": args.load,
            # Other work on the machine shows in wall-clock percentiles, not in CPU-time ones.
            "host": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
            "stranded_definition": "free healthy nodes in cliques whose free count is below the median "
            "size of the trace's single-clique jobs",
            "targets": {
                "stranded_reduction_vs_first_fit": TARGET_STRANDED_REDUCTION,
                "fit_rate": TARGET_FIT_RATE,
            },
            "sizes": [
                {
                    **{k: v for k, v in size.items() if k != "results"},
                    "verdict": verdict,
                    "results": {name: r.to_json() for name, r in size["results"].items()},
                }
                for size, verdict in zip(sizes, verdicts, strict=True)
            ],
        }
        args.out.write_text(json.dumps(document, indent=1))
    met = all(v.get("stranded_target_met", True) and v.get("fit_rate_target_met", True) for v in verdicts)
    return 0 if met or not args.check else 1


if __name__ == "__main__":
    raise SystemExit(main())
