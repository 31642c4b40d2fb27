"""``python -m tools.sim.scalesim``: host many simulated nodes (both programs each) in this process.

    python -m tools.sim.scalesim --racks 15 --nodes 256 --state-dir DIR --etcd-endpoint HOST:PORT \\
        [--etcd-prefix /cd/v1/] [--inventory-only] [--ready-file FILE] [--kubeconfig FILE]

Starts both programs of each node (the first ``--nodes`` nodes spread over the racks, or every node),
waits until all serve, writes the ready file (JSON: node -> DRA socket, start time, memory) and
runs until SIGTERM/SIGINT, then stops every node and its IMEX daemons. With ``--kubeconfig`` the
nodes run in Kubernetes mode: claims are read from that API server, and each node keeps its
ResourceSlice and clique label there (the Node objects are someone else's: the kubelet shim's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from pathlib import Path

import structlog

from libs.fsio.atomic import write_atomic
from libs.runtime.logging import configure_logging
from libs.state.config import EtcdConfig
from services.imexagent.settings import ImexSettings
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.scalesim.agent import AgentOptions
from tools.sim.scalesim.host import ScaleHost, spread_nodes

log = structlog.get_logger(__name__)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scalesim", description=__doc__.splitlines()[0])
    parser.add_argument("--racks", type=int, default=1, help="racks of the simulated cluster")
    parser.add_argument("--trays-per-rack", type=int, default=18)
    parser.add_argument("--seed", default="scalesim", help="cluster seed (names of UUIDs and cliques)")
    parser.add_argument(
        "--address-block", type=int, default=60, help="second octet of rack 0's loopback addresses"
    )
    parser.add_argument("--nodes", type=int, default=0, help="how many nodes to host (0 = every node)")
    parser.add_argument(
        "--shard",
        type=parse_shard,
        default=(0, 1),
        help="I/N: host only the I-th of N contiguous parts of those nodes (N host processes use N cores)",
    )
    parser.add_argument("--state-dir", type=Path, required=True, help="where the nodes' directories go")
    parser.add_argument("--etcd-endpoint", required=True)
    parser.add_argument("--etcd-prefix", default="/cd/v1/")
    parser.add_argument("--etcd-timeout-s", type=float, default=10.0)
    parser.add_argument(
        "--store-pool",
        type=int,
        default=0,
        help="etcd clients shared by the agents (0 = see scale_store_pool)",
    )
    parser.add_argument(
        "--inventory-only",
        action="store_true",
        help="agents keep only their node record on a lease (no DRA socket, no IMEX daemon)",
    )
    parser.add_argument(
        "--kubeconfig",
        default="",
        help="Kubernetes mode: read claims from this API server and publish ResourceSlices there",
    )
    parser.add_argument("--kube-timeout-s", type=float, default=10.0, help="deadline of each API request")
    parser.add_argument(
        "--lease-ttl-s",
        type=int,
        default=0,
        help="node record lease TTL (0 = the agent's 5 s up to 40 nodes, then nodes/8 s: see scale_lease_ttl)",
    )
    parser.add_argument(
        "--imex-poll-starting-s",
        type=float,
        default=0.0,
        help="readiness poll of a starting IMEX daemon (0 = the agent's 25 ms up to 40 nodes, then "
        "nodes/1600 s: see scale_poll_interval)",
    )
    parser.add_argument(
        "--health-poll-s",
        type=float,
        default=0.0,
        help="simulated hardware fault poll interval (0 = the agent's 0.25 s up to 18 nodes, "
        "more for more nodes: every hosted agent polls its own fault file)",
    )
    parser.add_argument("--start-batch", type=int, default=32, help="agents started at a time")
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--ready-file",
        type=Path,
        help="write the host report (JSON) here once serving, and again every --report-interval-s",
    )
    parser.add_argument("--report-interval-s", type=float, default=1.0)
    parser.add_argument(
        "--profile",
        type=Path,
        help="run under cProfile and write the stats here (shard I of N>1: <stem>.I<suffix>)",
    )
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    args = parser.parse_args(argv)
    if args.kubeconfig and args.inventory_only:
        parser.error("--kubeconfig needs node agents that serve kubelet: not with --inventory-only")
    if args.kube_timeout_s <= 0:
        parser.error(f"--kube-timeout-s must be > 0, got {args.kube_timeout_s}")
    return args


# A settled daemon's probe interval (ImexSettings.poll_interval_ready_s): the others never exceed it.
_READY_POLL_S = ImexSettings().poll_interval_ready_s


def parse_shard(text: str) -> tuple[int, int]:
    """``I/N`` with 0 <= I < N."""
    index, sep, count = text.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"shard must be I/N (e.g. 0/2), got {text!r}") from None
    if not sep or not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"shard must be I/N with 0 <= I < N, got {text!r}")
    return i, n


def shard_of(nodes: list[str], index: int, count: int) -> list[str]:
    """The `index`-th of `count` contiguous, near-equal parts of `nodes` (racks stay together
    where the sizes allow: the nodes are in rack order)."""
    base, extra = divmod(len(nodes), count)
    start = index * base + min(index, extra)
    return nodes[start : start + base + (1 if index < extra else 0)]


# The hosted agents share one event loop: every per-node periodic task runs `nodes` times, and
# every delay of the loop delays all of them. These keep the totals bounded; below ~40 nodes the
# agent's own settings apply unchanged.


def scale_lease_ttl(nodes: int) -> int:
    """Node-record lease TTL: the agent's 5 s, longer for many nodes, so that (a) refreshes stay
    under ~25 a second in total (10,000 nodes: 1,250 s) and (b) a formation burst that keeps the
    shared loop busy for seconds does not let leases lapse (real agents each have their own loop)."""
    return max(5, nodes // 8)


def scale_poll_interval(nodes: int) -> float:
    """How often a starting IMEX daemon is asked whether it is READY: the agent's 25 ms, and for
    many nodes at most ~800 probes a second per host process (128 nodes: every 160 ms; each probe
    is a connection, a reply of 18 links to parse and a status decision on the shared loop)."""
    return min(_READY_POLL_S, max(0.025, nodes / 800))


def scale_waiting_interval(nodes: int) -> float:
    """How often a daemon waiting for a peer is probed: the agent's 0.25 s, and for many nodes at
    most ~256 such probes a second per host process (128 nodes: every 0.5 s)."""
    return min(_READY_POLL_S, max(0.25, nodes / 256))


def scale_store_pool(nodes: int) -> int:
    """etcd clients for the hosted agents: one per 2 agents (at least 4, at most 128). A client's
    watch stream hands its responses to the event loop one at a time, a few dozen a second on a
    loaded host, so the per-node watches (binding, daemon status: what a prepare waits for) of
    many agents on one stream queue behind each other: with one client per 8 agents a daemon's
    READY reached its node's prepare 2-5 s late at p90 in a 256-pod formation, 0.2-1.3 s with
    one per 2."""
    return min(128, max(4, nodes // 2))


def health_poll_interval(nodes: int) -> float:
    """The agent's own 0.25 s for a rack, growing so that all hosted agents together poll their
    fault files at most ~40 times a second (each poll is a thread: a query that can hang never
    runs on the loop); a fault injected by hand still shows within seconds (128 nodes: 3.2 s)."""
    return max(0.25, nodes / 40)


async def serve(args: argparse.Namespace) -> int:
    cluster = ClusterDescription(
        racks=args.racks, trays_per_rack=args.trays_per_rack, seed=args.seed, address_block=args.address_block
    )
    nodes = shard_of(spread_nodes(cluster, args.nodes or cluster.node_count), *args.shard)
    if not nodes:
        raise ValueError(f"shard {args.shard[0]}/{args.shard[1]} holds no node")
    options = AgentOptions(
        inventory_only=args.inventory_only,
        lease_ttl_s=args.lease_ttl_s or scale_lease_ttl(len(nodes)),
        health_poll_interval_s=args.health_poll_s or health_poll_interval(len(nodes)),
        imex=ImexSettings(
            stop_daemons_on_exit=True,
            poll_interval_starting_s=args.imex_poll_starting_s or scale_poll_interval(len(nodes)),
            poll_interval_waiting_s=scale_waiting_interval(len(nodes)),
        ),
    )
    etcd = EtcdConfig(endpoint=args.etcd_endpoint, prefix=args.etcd_prefix, timeout_s=args.etcd_timeout_s)
    host = ScaleHost(
        cluster,
        nodes,
        args.state_dir,
        etcd,
        options,
        store_pool=args.store_pool or scale_store_pool(len(nodes)),
        kubeconfig=args.kubeconfig,
        kube_timeout_s=args.kube_timeout_s,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        starting = asyncio.create_task(host.start(args.start_timeout_s, batch=args.start_batch))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            return 1
        stopping.cancel()
        report = starting.result()
        if args.ready_file is not None:
            write_atomic(args.ready_file, json.dumps(report.to_json()).encode())
        print(
            f"scalesim: {len(report.nodes)} agents serving after {report.start_s:.1f}s, RSS {report.rss_mb:.0f} MB",
            flush=True,
        )
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(args.report_interval_s):
                    await stop.wait()
            if args.ready_file is not None:
                write_atomic(args.ready_file, json.dumps(host.report().to_json()).encode())
        return 0
    finally:
        await host.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("json", args.log_level)
    try:
        if args.profile is not None:
            import cProfile

            with cProfile.Profile() as profile:
                code = asyncio.run(serve(args))
            index, count = args.shard
            profile.dump_stats(
                args.profile if count == 1 else args.profile.with_suffix(f".{index}{args.profile.suffix}")
            )
            return code
        return asyncio.run(serve(args))
    except (TimeoutError, RuntimeError, ValueError, OSError) as exc:
        print(f"scalesim: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
