"""Benchmark: one controller under domain churn, and its memory with 10,000 nodes and 1,000 domains.

Set-up: a private etcd (unless --etcd-endpoint) and one `cd-controller` process
(simulation mode). The store is populated with N node records and D domains
whose members joined and whose daemons are READY (written in bulk, as node
agents would have), and the controller converges them all to Ready: its RSS
is measured then. Churn: W workers then play node agents and users at full
speed for S seconds: each picks a domain, deletes it (deletion mark, each
member's claim unprepared and the node leaving, the controller tearing the
record down) and forms a new one on free nodes (claims prepared, nodes joined
through the central index assignment, daemons READY), so the population stays
at D domains while they churn. Reported: store events the controller handled
per second (its own counter), reconciles and status writes, how long it takes
to catch up once churn stops, and its RSS (current and peak).

    python -m tools.bench.controller_churn [--domains 1000] [--nodes 10000] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.gen.computedomain.state import v1 as pb
from libs.state.config import EtcdConfig
from libs.state.membership import join_domain, leave_domain
from libs.state.store import Op, Put, Store
from tools.bench import simenv
from tools.etcd.server import EtcdServer, etcd_binary

TARGET_EVENTS_PER_S = 500.0
TARGET_RSS_MB = 300.0
TRAYS_PER_RACK = 18


def node_record(i: int) -> pb.Node:
    rack, tray = divmod(i, TRAYS_PER_RACK)
    return pb.Node(
        name=f"rack{rack}-tray{tray}",
        ip_address=f"127.{rack // 250 + 1}.{rack % 250}.{tray + 1}",
        clique_id=f"00000000-0000-4000-8000-{rack:012d}.1",
        cluster_uuid=f"00000000-0000-4000-8000-{rack:012d}",
        health=pb.Health.HEALTHY,
        gpus=[
            pb.Gpu(uuid=f"GPU-{i:08d}-{g}", index=g, clique_id=f"00000000-0000-4000-8000-{rack:012d}.1")
            for g in range(4)
        ],
    )


def domain_record(uid: str, members: int) -> pb.ComputeDomain:
    return pb.ComputeDomain(
        uid=uid,
        namespace="bench",
        name=f"cd-{uid[:8]}",
        spec=pb.ComputeDomainSpec(num_nodes=members, channel=pb.ChannelSpec(f"rct-{uid[:8]}")),
        created_unix_ms=int(time.time() * 1000),
        source="simulation",
    )


# ---- the controller process ----------------------------------------------------------------------


def start_controller(config: EtcdConfig, workdir: Path) -> simenv.ControllerProcess:
    return simenv.start_controller(
        config.endpoint,
        config.prefix,
        workdir,
        level="info",
        # Long enough to survive being stopped for the backlog phase.
        settings=("--leader-lease-ttl-s=120",),
    )


# ---- population -----------------------------------------------------------------------------------


@dataclass
class Population:
    members: int
    nodes: list[pb.Node]
    free: list[pb.Node] = field(default_factory=list)
    # domain uid -> (node, claim uid) of its members
    domains: dict[str, list[tuple[pb.Node, str]]] = field(default_factory=dict)


async def write_all(store: Store, ops: list[Op], concurrency: int = 64) -> None:
    """Write each record with its own request (one event per revision, as node agents make them)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(op: Op) -> None:
        assert isinstance(op, Put)
        async with gate:
            await store.txn([], [op])

    await asyncio.gather(*(one(op) for op in ops))


def formed_domain_ops(
    store: Store, uid: str, members: list[pb.Node]
) -> tuple[list[Op], list[tuple[pb.Node, str]]]:
    """The records of a domain whose members joined and whose daemons are READY."""
    k = store.keys
    ops: list[Op] = [Put(k.domain(uid), domain_record(uid, len(members)))]
    next_index: dict[str, int] = {}
    held: list[tuple[pb.Node, str]] = []
    for n in members:
        index = next_index.get(n.clique_id, 0)
        next_index[n.clique_id] = index + 1
        claim = uuid.uuid4().hex
        held.append((n, claim))
        member = pb.Member(
            domain_uid=uid,
            node_name=n.name,
            clique_id=n.clique_id,
            index=index,
            state=pb.MemberState.ACTIVE,
            ip_address=n.ip_address,
            joined_unix_ms=int(time.time() * 1000),
            namespace="bench",
        )
        ops += [
            Put(k.member(uid, n.name), member),
            Put(k.member_index(uid, n.clique_id, index), pb.IndexClaim(uid, n.clique_id, index, n.name)),
            Put(k.node_binding(n.name), pb.NodeBinding(n.name, uid)),
            Put(k.daemon(uid, n.name), ready_status(uid, n, members)),
            Put(
                k.preparation(n.name, claim),
                pb.PreparedClaim(
                    claim_uid=claim,
                    namespace="bench",
                    node_name=n.name,
                    domain_uid=uid,
                    state=pb.PreparedState.PREPARE_COMPLETED,
                ),
            ),
        ]
    return ops, held


def ready_status(uid: str, node: pb.Node, members: list[pb.Node]) -> pb.DaemonStatus:
    """A READY daemon connected to every other member of its clique (what makes a member ready)."""
    return pb.DaemonStatus(
        domain_uid=uid,
        node_name=node.name,
        state=pb.DaemonState.READY,
        connected_nodes=[m.name for m in members if m.clique_id == node.clique_id and m.name != node.name],
    )


async def populate(store: Store, nodes: int, domains: int, members: int) -> Population:
    records = [node_record(i) for i in range(nodes)]
    await write_all(store, [Put(store.keys.node(n.name), n) for n in records])
    pop = Population(members, records)
    # Members of a domain are consecutive trays, as a clique-aware scheduler would place them.
    used = domains * members
    if used > nodes:
        raise SystemExit(f"{domains} domains of {members} need {used} nodes; only {nodes}")
    ops: list[Op] = []
    for d in range(domains):
        uid = str(uuid.uuid4())
        domain_ops, held = formed_domain_ops(store, uid, records[d * members : (d + 1) * members])
        pop.domains[uid] = held
        ops += domain_ops
    await write_all(store, ops)
    pop.free = records[used:]
    random.shuffle(pop.free)
    return pop


# ---- churn ----------------------------------------------------------------------------------------


@dataclass
class ChurnStats:
    cycles: int = 0
    joins: int = 0
    errors: int = 0


async def delete_domain(store: Store, uid: str, held: list[tuple[pb.Node, str]]) -> None:
    def mark(current: pb.ComputeDomain | None) -> pb.ComputeDomain | None:
        if current is None or current.deleting:
            return None
        current.deleting = True
        current.deletion_requested_unix_ms = int(time.time() * 1000)
        return current

    await store.update(store.keys.domain(uid), pb.ComputeDomain, mark)
    for n, claim in held:
        # Kubelet unprepares the claim: the agent drops it and leaves (its last claim of the domain).
        await store.delete(store.keys.preparation(n.name, claim))
        await leave_domain(store, uid, n.name)


async def form_domain(
    store: Store, uid: str, members: list[pb.Node], stats: ChurnStats
) -> list[tuple[pb.Node, str]]:
    k = store.keys
    await store.put(k.domain(uid), domain_record(uid, len(members)))
    held: list[tuple[pb.Node, str]] = []
    for n in members:
        claim = uuid.uuid4().hex
        prep = pb.PreparedClaim(
            claim_uid=claim,
            namespace="bench",
            node_name=n.name,
            domain_uid=uid,
            state=pb.PreparedState.PREPARE_STARTED,
        )
        await store.put(k.preparation(n.name, claim), prep)
        await join_domain(store, uid, "bench", n)
        stats.joins += 1
        prep.state = pb.PreparedState.PREPARE_COMPLETED
        await store.put(k.preparation(n.name, claim), prep)
        held.append((n, claim))
    for n, _ in held:
        await store.put(k.daemon(uid, n.name), ready_status(uid, n, members))
    return held


async def churn_worker(store: Store, pop: Population, stop: asyncio.Event, stats: ChurnStats) -> None:
    while not stop.is_set():
        if not pop.domains:
            await asyncio.sleep(0.01)
            continue
        uid = random.choice(list(pop.domains))
        held = pop.domains.pop(uid)
        try:
            await delete_domain(store, uid, held)
            pop.free.extend(n for n, _ in held)
            take = pop.members
            if len(pop.free) < take:
                await asyncio.sleep(0.01)
                continue
            members, pop.free[:take] = pop.free[:take], []
            new_uid = str(uuid.uuid4())
            pop.domains[new_uid] = await form_domain(store, new_uid, members, stats)
            stats.cycles += 1
        except Exception as exc:
            stats.errors += 1
            print(f"churn step failed: {type(exc).__name__}: {exc}", file=sys.stderr)


# ---- measurement ----------------------------------------------------------------------------------


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def wait_until(predicate: Any, timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while True:
        if await asyncio.to_thread(predicate):
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.25)


async def run(args: argparse.Namespace, endpoint: str, workdir: Path) -> dict[str, Any]:
    config = EtcdConfig(endpoint=endpoint, prefix=f"/bench-{uuid.uuid4().hex[:8]}/", timeout_s=10.0)
    stores = [Store(config) for _ in range(4)]
    for s in stores:
        await s.connect()
    controller = start_controller(config, workdir)
    try:
        started = time.monotonic()
        pop = await populate(stores[0], args.nodes, args.domains, args.members)
        written_s = time.monotonic() - started
        progress(f"wrote {args.nodes} nodes and {args.domains} formed domains in {written_s:.1f} s")

        def all_ready() -> bool:
            return controller.metrics().get('cd_controller_domains{status="Ready"}', 0) >= args.domains

        converge_s = await wait_until(all_ready, 600, f"{args.domains} domains to be Ready")
        await asyncio.sleep(1.0)
        rss_populated, _ = controller.rss_mb()
        progress(f"controller converged in {converge_s:.1f} s; RSS {rss_populated:.1f} MB; churning")

        before = controller.metrics()
        stop = asyncio.Event()
        stats = ChurnStats()
        workers = [
            asyncio.create_task(churn_worker(stores[i % len(stores)], pop, stop, stats))
            for i in range(args.workers)
        ]
        churn_started = time.monotonic()
        peak_rss = rss_populated
        samples: list[tuple[float, float]] = []
        while time.monotonic() - churn_started < args.churn_seconds:
            await asyncio.sleep(1.0)
            m = controller.metrics()
            samples.append((time.monotonic() - churn_started, controller.events_handled(m)))
            peak_rss = max(peak_rss, controller.rss_mb()[0])
        stop.set()
        await asyncio.gather(*workers)
        churn_s = time.monotonic() - churn_started
        progress(f"churned {stats.cycles} domains in {churn_s:.1f} s; waiting for the controller to catch up")
        at_stop = controller.metrics()

        # Caught up: the controller's view has reached the store's last revision, nothing is queued,
        # every deleted domain is torn down and every new one Ready.
        def settled_at(target_revision: int) -> Any:
            def check() -> bool:
                m = controller.metrics()
                return (
                    m.get("cd_controller_view_revision", 0) >= target_revision
                    and m.get("cd_controller_workqueue_depth", 1) == 0
                    and m.get('cd_controller_domains{status="NotReady"}', 1) == 0
                    and m.get('cd_controller_domains{status="Terminating"}', 1) == 0
                )

            return check

        settled = settled_at(await stores[0].revision())
        catch_up_s = await wait_until(settled, 300, "the controller to catch up after churn")
        after = controller.metrics()
        rss_end, rss_peak = controller.rss_mb()

        # Backlog: the controller is stopped while the drivers churn, then resumed; how fast it
        # works off the pile shows its own capacity, apart from the drivers' (same CPUs).
        progress(f"backlog phase: controller stopped, churning {args.backlog_seconds:.0f} s")
        controller.proc.send_signal(signal.SIGSTOP)
        backlog_before = controller.events_handled(after)
        stop = asyncio.Event()
        backlog_stats = ChurnStats()
        workers = [
            asyncio.create_task(churn_worker(stores[i % len(stores)], pop, stop, backlog_stats))
            for i in range(args.workers)
        ]
        await asyncio.sleep(args.backlog_seconds)
        stop.set()
        await asyncio.gather(*workers)
        target = await stores[0].revision()
        resumed = time.monotonic()
        controller.proc.send_signal(signal.SIGCONT)
        await wait_until(settled_at(target), 300, "the controller to work off the backlog")
        drain_s = time.monotonic() - resumed
        backlog_events = controller.events_handled(controller.metrics()) - backlog_before
        progress(f"worked off {backlog_events:.0f} events in {drain_s:.1f} s")

        handled_during = controller.events_handled(at_stop) - controller.events_handled(before)
        handled_total = controller.events_handled(after) - controller.events_handled(before)
        reconciles = after.get("cd_controller_reconciles_total", 0) - before.get(
            "cd_controller_reconciles_total", 0
        )
        writes = after.get("cd_controller_status_writes_total", 0) - before.get(
            "cd_controller_status_writes_total", 0
        )
        errors = after.get("cd_controller_reconcile_errors_total", 0) - before.get(
            "cd_controller_reconcile_errors_total", 0
        )
        events_per_s = handled_total / (churn_s + catch_up_s)
        drain_per_s = backlog_events / drain_s if drain_s > 0 else 0.0
        return {
            "benchmark": "controller_churn",
            "config": {
                "nodes": args.nodes,
                "domains": args.domains,
                "members_per_domain": args.members,
                "churn_workers": args.workers,
                "churn_seconds": args.churn_seconds,
                "cpus": os.cpu_count(),
            },
            "populate": {"write_s": round(written_s, 2), "converge_to_ready_s": round(converge_s, 2)},
            "churn": {
                "seconds": round(churn_s, 2),
                "domain_cycles": stats.cycles,
                "domains_per_s": round(stats.cycles / churn_s, 1),
                "joins": stats.joins,
                "driver_errors": stats.errors,
                "events_handled": int(handled_total),
                "events_handled_during_churn": int(handled_during),
                "events_per_s": round(events_per_s, 1),
                "peak_events_per_s_1s": round(
                    max((b[1] - a[1]) / (b[0] - a[0]) for a, b in itertools.pairwise(samples))
                    if len(samples) > 1
                    else 0.0,
                    1,
                ),
                "reconciles": int(reconciles),
                "status_writes": int(writes),
                "reconcile_errors": int(errors),
                "catch_up_s": round(catch_up_s, 2),
            },
            "backlog": {
                "churn_seconds": args.backlog_seconds,
                "domain_cycles": backlog_stats.cycles,
                "events": int(backlog_events),
                "drain_s": round(drain_s, 2),
                "events_per_s": round(drain_per_s, 1),
            },
            "rss_mb": {
                "with_population": round(rss_populated, 1),
                "peak_during_churn": round(max(peak_rss, rss_end), 1),
                "process_peak_vmhwm": round(rss_peak, 1),
            },
            "targets": {"events_per_s": TARGET_EVENTS_PER_S, "rss_mb": TARGET_RSS_MB},
            "meets_targets": max(events_per_s, drain_per_s) >= TARGET_EVENTS_PER_S
            and rss_populated <= TARGET_RSS_MB,
        }
    except BaseException:
        tail = controller.log.read_text(errors="replace").splitlines()[-15:]
        progress("failed; controller log tail:\n" + "\n".join(tail))
        raise
    finally:
        controller.stop()
        for s in stores:
            await s.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="controller_churn", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--domains", type=int, default=1_000)
    parser.add_argument("--members", type=int, default=4, help="members per domain")
    parser.add_argument("--workers", type=int, default=32, help="concurrent churn drivers")
    parser.add_argument("--churn-seconds", type=float, default=30.0)
    parser.add_argument(
        "--backlog-seconds", type=float, default=20.0, help="churn while the controller is stopped"
    )
    parser.add_argument("--etcd-endpoint", default="", help="use this etcd instead of a private one")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)

    # A SIGTERM unwinds like Ctrl-C, so the etcd and controller started here are stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    workdir = simenv.scratch_dir("controller-churn-")
    server: EtcdServer | None = None
    ok = False
    try:
        endpoint = args.etcd_endpoint
        if not endpoint:
            server = EtcdServer(data_dir=workdir / "etcd", binary=etcd_binary())
            server.start()
            endpoint = server.endpoint
        result = asyncio.run(run(args, endpoint, workdir))
        result["settings"] = {
            "etcd_data": "external" if args.etcd_endpoint else simenv.fs_label(workdir),
            "etcd_fsync": "external" if args.etcd_endpoint else simenv.etcd_fsync(),
            "nodes": args.nodes,
            "domains": args.domains,
            "members": args.members,
            "workers": args.workers,
            "churn_seconds": args.churn_seconds,
            "backlog_seconds": args.backlog_seconds,
            "cpu_count": os.cpu_count(),
        }
        ok = True
    finally:
        if server is not None:
            server.destroy()
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            progress(f"kept {workdir} (controller.log) for a look")
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    c, b, r = result["churn"], result["backlog"], result["rss_mb"]
    print(text)
    print(
        f"\ncontroller churn: {c['events_per_s']} store events/s handled live "
        f"({c['domains_per_s']} domains/s recycled by the drivers, caught up {c['catch_up_s']} s after), "
        f"{b['events_per_s']} events/s working off a backlog of {b['events']} "
        f"(target >= {TARGET_EVENTS_PER_S:.0f}); "
        f"RSS {r['with_population']} MB with {args.nodes} nodes + {args.domains} domains "
        f"(target <= {TARGET_RSS_MB:.0f}), peak {r['peak_during_churn']} MB"
    )
    return 0 if result["meets_targets"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
