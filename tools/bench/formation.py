"""Benchmark: ComputeDomain formation, submit to Ready, for an 18-node rack and a 256-node job.

Set-up per scenario: a private etcd, one `cd-controller` process (leader, simulation mode) and one
scale-mode host process (`tools.sim.scalesim`) that runs, per node, the two node programs as their
own composition roots build them (the IMEX agent and the kubelet plugin), each node with its own
DRA socket, checkpoint, CDI root and a real simulated IMEX daemon process per domain. This
process plays the user and kubelet.

One formation, timed from t0 in this process:

1. submit: the ComputeDomain record and one allocated channel claim per node are written to the
   store (as `cdsim job submit` does, without the placement advisor: nodes are fixed);
2. every node's kubelet calls NodePrepareResources on that node's DRA socket, all at once, retried
   like kubelet on failure. A prepare returns only once the node joined the domain and its IMEX
   daemon is READY (local: the daemon is up with its node ID), so "all claims prepared" implies
   "all daemons READY";
3. the controller marks the domain Ready (every member's daemon READY and reporting every other
   member of its clique connected: the full mesh), seen through a watch on the domain record.

Reported: the formation time t(Ready) - t0 (the target figure) and t(all prepared) - t0. Between
repetitions the job is deleted (claims unprepared, claims deleted, domain marked deleting) and the
benchmark waits until the controller removed the domain and every daemon has stopped.

    python -m tools.bench.formation [--reps 10] [--nodes-256 256 --racks-256 15] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.gen.computedomain.state import v1 as pb
from libs.state.config import EtcdConfig
from libs.state.domain_record import DomainRecord as DomainReadiness
from libs.state.store import Delete, Put, Store
from libs.state.watch import Resync, watch_prefix
from tools.bench import simenv
from tools.bench.stats import percentile
from tools.cdsim import kubelet, proc_scan
from tools.cdsim.job_book import Job
from tools.cdsim.jobs import build_claim, build_domain, plan_claims

TARGET_18_P50_S = 1.0
TARGET_256_S = 10.0
NAMESPACE = "bench"
# etcd refuses transactions with more operations than 128.
_TXN_OPS = 120
# Generous: a formation far over its target should still be measured, not reported as failed.
_PREPARE_DEADLINE_S = 300.0
_READY_TIMEOUT_S = 300.0
_TEARDOWN_TIMEOUT_S = 300.0


@dataclass
class Formation:
    nodes: int
    prepared_s: float
    ready_s: float
    first_prepared_s: float
    attempts: int  # kubelet calls in total (nodes = no retries)
    teardown_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in vars(self).items()}


@dataclass
class Scenario:
    name: str
    racks: int
    nodes: int
    reps: int
    formations: list[Formation] = field(default_factory=list)
    host: dict[str, Any] = field(default_factory=dict)
    # Run the host under cProfile and write its stats here.
    profile: Path | None = None
    # The domains' IMEX mesh: mutual TLS (certificates requested, signed, installed) or plaintext.
    mesh_tls: bool = True
    # Scale host processes the nodes are spread over (a node's two programs are one process
    # each on a real node; one host process for hundreds of nodes would measure one core).
    host_processes: int = 1


async def _write_job(store: Store, job: Job) -> None:
    now = int(time.time() * 1000)
    ops: list[Put] = [Put(store.keys.domain(job.domain_uid), build_domain(job, now))]
    ops += [
        Put(store.keys.claim(c.uid), build_claim(c, job.domain_uid, job.allocation_mode, now))
        for c in job.claims
    ]
    for start in range(0, len(ops), _TXN_OPS):
        await store.txn([], ops[start : start + _TXN_OPS])


async def _wait_ready(store: Store, domain_uid: str, ready: asyncio.Future[float]) -> None:
    """Resolve `ready` with the perf_counter time the domain is first seen Ready (reading only
    the readiness: this process shares the machine with what it measures)."""
    async for event in watch_prefix(store, store.keys.domain(domain_uid), DomainReadiness):
        values = [i.value for i in event.items] if isinstance(event, Resync) else [event.value]
        if any(v is not None and v.ready for v in values):
            if not ready.done():
                ready.set_result(time.perf_counter())
            return


def _calls(job: Job, sockets: dict[str, str]) -> list[kubelet.ClaimCall]:
    return [
        kubelet.ClaimCall(
            namespace=c.namespace, name=c.name, uid=c.uid, node=c.node, socket=Path(sockets[c.node])
        )
        for c in job.claims
    ]


async def form(store: Store, sockets: dict[str, str], nodes: list[str], name: str) -> tuple[Job, Formation]:
    """Submit one job on `nodes` and wait until its domain is Ready."""
    job = Job(
        name=name,
        namespace=NAMESPACE,
        domain_uid=str(uuid.uuid4()),
        num_nodes=len(nodes),
        allocation_mode="Single",
        state="submitting",
        created_unix_ms=int(time.time() * 1000),
        claims=plan_claims(name, NAMESPACE, nodes),
    )
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[float] = loop.create_future()
    watcher = asyncio.create_task(_wait_ready(store, job.domain_uid, ready))
    await asyncio.sleep(0.05)  # the watch lists before the domain exists
    prepared_at: list[float] = []

    async def prepare(call: kubelet.ClaimCall) -> kubelet.CallOutcome:
        outcome = await kubelet.prepare(call, _PREPARE_DEADLINE_S)
        prepared_at.append(time.perf_counter())
        return outcome

    try:
        t0 = time.perf_counter()
        await _write_job(store, job)
        outcomes = await asyncio.gather(*(prepare(c) for c in _calls(job, sockets)))
        t_prepared = time.perf_counter()
        failed = [o for o in outcomes if not o.ok]
        if failed:
            raise RuntimeError(
                f"{len(failed)} of {len(outcomes)} prepares failed; first: {failed[0].claim.node}: {failed[0].last_error}"
            )
        async with asyncio.timeout(_READY_TIMEOUT_S):
            t_ready = await ready
    finally:
        watcher.cancel()
    return job, Formation(
        nodes=len(nodes),
        prepared_s=t_prepared - t0,
        ready_s=t_ready - t0,
        first_prepared_s=min(prepared_at) - t0,
        attempts=sum(o.attempts for o in outcomes),
    )


async def teardown(
    store: Store, sockets: dict[str, str], job: Job, daemons_running: Callable[[], int] = lambda: 0
) -> float:
    """Delete the job like `cdsim job delete`; wait until domain, members, daemon statuses and
    daemon processes (`daemons_running`) are gone."""
    began = time.perf_counter()
    outcomes = await asyncio.gather(
        *(kubelet.unprepare(c, _TEARDOWN_TIMEOUT_S) for c in _calls(job, sockets))
    )
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} unprepares failed; first: {failed[0].last_error}")
    claims = [Delete(store.keys.claim(c.uid)) for c in job.claims]
    for start in range(0, len(claims), _TXN_OPS):
        await store.txn([], claims[start : start + _TXN_OPS])

    def mark(domain: pb.ComputeDomain | None) -> pb.ComputeDomain | None:
        if domain is None or domain.deleting:
            return None
        domain.deleting = True
        domain.deletion_requested_unix_ms = int(time.time() * 1000)
        return domain

    await store.update(store.keys.domain(job.domain_uid), pb.ComputeDomain, mark)
    deadline = time.monotonic() + _TEARDOWN_TIMEOUT_S
    keys = store.keys
    while time.monotonic() < deadline:
        domain = await store.get(keys.domain(job.domain_uid), pb.ComputeDomain)
        members, _ = await store.list(keys.members(job.domain_uid), pb.Member)
        daemons, _ = await store.list(keys.daemons(job.domain_uid), pb.DaemonStatus)
        if domain is None and not members and not daemons and not daemons_running():
            return time.perf_counter() - began
        await asyncio.sleep(0.05)
    raise RuntimeError(f"domain {job.domain_uid} not torn down within {_TEARDOWN_TIMEOUT_S:.0f}s")


async def _drive(
    scenario: Scenario, endpoint: str, prefix: str, sockets: dict[str, str], state_dir: Path
) -> None:
    def daemons_running() -> int:
        return len(proc_scan.imex_daemons_under(state_dir))

    nodes = list(sockets)
    async with Store(EtcdConfig(endpoint=endpoint, prefix=prefix, timeout_s=10.0)) as store:
        for rep in range(scenario.reps):
            job, formation = await form(store, sockets, nodes, f"{scenario.name}-{rep}")
            formation.teardown_s = await teardown(store, sockets, job, daemons_running)
            scenario.formations.append(formation)
            print(
                f"{scenario.name} #{rep + 1}: Ready {formation.ready_s:.3f}s, prepared {formation.prepared_s:.3f}s, "
                f"teardown {formation.teardown_s:.2f}s",
                file=sys.stderr,
                flush=True,
            )


def run_scenario(scenario: Scenario) -> None:
    base = simenv.scratch_dir("fm-")
    prefix = f"/bench-{uuid.uuid4().hex[:8]}/"
    try:
        with simenv.private_etcd(base) as etcd:
            controller = simenv.start_controller(etcd.endpoint, prefix, base, mesh_tls=scenario.mesh_tls)
            host: simenv.HostGroup | None = None
            try:
                block = simenv.free_address_block(scenario.racks)
                host = simenv.start_host(
                    etcd.endpoint,
                    prefix,
                    base,
                    racks=scenario.racks,
                    nodes=scenario.nodes,
                    address_block=block,
                    extra_args=(f"--profile={scenario.profile}",) if scenario.profile else (),
                    processes=scenario.host_processes,
                )
                asyncio.run(_drive(scenario, etcd.endpoint, prefix, host.sockets, base))
                memory = [simenv.process_rss_mb(pid) for pid in host.pids]
                status = host.status()
                scenario.host = {
                    "agents": len(host.sockets),
                    "processes": len(host.pids),
                    "start_s": max(host.report("start_s")),
                    "rss_mb": round(sum(rss for rss, _ in memory), 1),
                    "peak_rss_mb": round(sum(peak for _, peak in memory), 1),
                    "store_pool": sum(host.report("store_pool")),
                    "max_loop_lag_s": status["max_loop_lag_s"],
                    "lease_losses": status["lease_losses"],
                }
            finally:
                if host is not None:
                    host.stop()
                controller.stop()
    finally:
        leftovers = simenv.kill_leftover_daemons(base)
        if leftovers:
            print(f"warning: {leftovers} IMEX daemons outlived the scale host", file=sys.stderr)
        simenv.remove_tree(base)


def summarize(scenario: Scenario) -> dict[str, Any]:
    ready = [f.ready_s for f in scenario.formations]
    prepared = [f.prepared_s for f in scenario.formations]
    return {
        "nodes": scenario.nodes,
        "racks": scenario.racks,
        "reps": len(ready),
        "ready_p50_s": round(statistics.median(ready), 4),
        "ready_p90_s": round(percentile(ready, 90), 4),
        "ready_min_s": round(min(ready), 4),
        "ready_max_s": round(max(ready), 4),
        "prepared_p50_s": round(statistics.median(prepared), 4),
        "teardown_p50_s": round(statistics.median(f.teardown_s for f in scenario.formations), 4),
        "formations": [f.to_json() for f in scenario.formations],
        "host": scenario.host,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="formation", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10, help="18-node formations to time")
    parser.add_argument("--nodes-18", type=int, default=18, help="nodes of the small domain (one rack)")
    parser.add_argument("--nodes-256", type=int, default=256, help="nodes of the large job (0 = skip)")
    parser.add_argument("--racks-256", type=int, default=15, help="racks the large job spans")
    parser.add_argument("--reps-256", type=int, default=1, help="large-job formations to time")
    parser.add_argument(
        "--host-processes-256",
        type=int,
        default=os.cpu_count() or 1,
        help="scale host processes for the large job (default: one per CPU)",
    )
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    parser.add_argument(
        "--mesh",
        default="tls",
        choices=("tls", "plaintext"),
        help="the domains' IMEX mesh: mutual TLS (the default) or plaintext, to measure TLS's cost",
    )
    parser.add_argument(
        "--profile-dir", type=Path, help="profile the scale hosts (cProfile stats <dir>/host-<scenario>.prof)"
    )
    args = parser.parse_args(argv)
    # A SIGTERM (the suite runner's timeout) unwinds like Ctrl-C: etcd, controller, host stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.reps < 1 or args.reps_256 < 1:
        parser.error("--reps and --reps-256 must be >= 1")
    profile = args.profile_dir.resolve() if args.profile_dir else None
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
    scenarios = {
        "18": Scenario("rack", racks=1, nodes=args.nodes_18, reps=args.reps, mesh_tls=args.mesh == "tls")
    }
    if args.nodes_256:
        scenarios["256"] = Scenario(
            "job",
            racks=args.racks_256,
            nodes=args.nodes_256,
            reps=args.reps_256,
            mesh_tls=args.mesh == "tls",
            host_processes=args.host_processes_256,
        )
    result: dict[str, Any] = {
        "benchmark": "formation",
        "settings": {
            **simenv.storage_settings(),
            # tools/sim/scalesim keeps each node's CDI root under its node directory.
            "cdi_root": "disk (under the node directories)",
            "mesh": args.mesh,
            **{f"reps_{size}": s.reps for size, s in scenarios.items()},
            **{f"host_processes_{size}": s.host_processes for size, s in scenarios.items()},
            "cpu_count": os.cpu_count(),
        },
        "mesh": args.mesh,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "targets": {"formation_18_p50_s": TARGET_18_P50_S, "formation_256_s": TARGET_256_S},
    }
    for size, scenario in scenarios.items():
        scenario.profile = profile / f"host-{scenario.name}.prof" if profile else None
        run_scenario(scenario)
        result[f"formation_{size}"] = summarize(scenario)
    result["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
