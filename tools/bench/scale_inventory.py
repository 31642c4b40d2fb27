"""Benchmark: a 10,000-node inventory held by scale-mode agents, and what it costs.

Set-up: a private etcd, one `cd-controller` (leader, simulation mode), then one scale-mode host
(`tools.sim.scalesim --inventory-only`) with one agent per node of a 556-rack cluster (10,008 nodes).
Inventory-only agents run the node agent's real `NodeRecordKeeper`: the node record (address,
clique, 4 GPUs, health) written on the node's own lease, the lease kept alive, simulated
hardware health followed. They serve no DRA socket and run no IMEX daemon.

Reported: time until every record is in the store, memory of the host (per node), of etcd and
of the controller holding the inventory, the host's CPU while it only keeps leases alive, its
largest event-loop delay, and lease losses (a lost lease makes a node look dead; must be 0).

    python -m tools.bench.scale_inventory [--racks 556] [--hold-s 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from libs.state.config import EtcdConfig
from libs.state.store import Store
from tools.bench import simenv
from tools.bench.proc_cpu import cpu_seconds


async def count_records(endpoint: str, prefix: str) -> tuple[int, int]:
    """(node records, distinct leases they are attached to)."""
    async with Store(EtcdConfig(endpoint=endpoint, prefix=prefix, timeout_s=30.0)) as store:
        result = await store.client.get_prefix(store.keys.nodes().encode(), keys_only=True)
        kvs = list(result)
        return len(kvs), len({kv.lease for kv in kvs if kv.lease})


def run(racks: int, hold_s: float) -> dict[str, Any]:
    base = simenv.scratch_dir("inv-")
    prefix = f"/bench-{uuid.uuid4().hex[:8]}/"
    try:
        with simenv.private_etcd(base) as etcd:
            assert etcd.process is not None
            controller = simenv.start_controller(etcd.endpoint, prefix, base)
            host: simenv.HostGroup | None = None
            try:
                ctl_before, _ = simenv.process_rss_mb(controller.proc.pid)
                began = time.monotonic()
                host = simenv.start_host(
                    etcd.endpoint,
                    prefix,
                    base,
                    racks=racks,
                    nodes=0,
                    address_block=1,  # no daemons: addresses are only written into records
                    inventory_only=True,
                    extra_args=("--start-batch=500",),
                )
                registered_s = time.monotonic() - began
                records, leases = asyncio.run(count_records(etcd.endpoint, prefix))
                cpu_before = cpu_seconds(host.pids[0])
                time.sleep(hold_s)
                held_cpu = cpu_seconds(host.pids[0]) - cpu_before
                status = host.status()
                host_rss, host_peak = simenv.process_rss_mb(host.pids[0])
                etcd_rss, _ = simenv.process_rss_mb(etcd.process.pid)
                ctl_rss, ctl_peak = simenv.process_rss_mb(controller.proc.pid)
                records_after, _ = asyncio.run(count_records(etcd.endpoint, prefix))
                nodes = len(host.sockets)
                return {
                    "benchmark": "scale_inventory",
                    "nodes": nodes,
                    "node_records": records,
                    "node_records_after_hold": records_after,
                    "leases": leases,
                    "lease_ttl_s": status.get("lease_ttl_s"),
                    "register_all_s": round(registered_s, 2),
                    "host_start_s": host.report("start_s")[0],
                    "host_rss_mb": round(host_rss, 1),
                    "host_peak_rss_mb": round(host_peak, 1),
                    "host_rss_kb_per_node": round(host_rss * 1024 / max(nodes, 1), 1),
                    "host_cpu_percent_holding": round(held_cpu / hold_s * 100, 1),
                    "host_max_loop_lag_s": status["max_loop_lag_s"],
                    "lease_losses": status["lease_losses"],
                    "etcd_rss_mb": round(etcd_rss, 1),
                    "controller_rss_mb": round(ctl_rss, 1),
                    "controller_peak_rss_mb": round(ctl_peak, 1),
                    "controller_rss_mb_before": round(ctl_before, 1),
                    "hold_s": hold_s,
                    "settings": {
                        **simenv.storage_settings(base),
                        "host_processes": len(host.pids),
                        "inventory_only": True,
                        "hold_s": hold_s,
                        "cpu_count": os.cpu_count(),
                    },
                    "cpus": os.cpu_count(),
                    "load_average_1m": round(os.getloadavg()[0], 2),
                }
            finally:
                if host is not None:
                    host.stop()
                controller.stop()
    finally:
        simenv.remove_tree(base)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scale_inventory", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--racks", type=int, default=556, help="racks of 18 nodes (556 = 10,008 nodes)")
    parser.add_argument("--hold-s", type=float, default=20.0, help="how long to hold the inventory")
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    # A SIGTERM (the suite runner's timeout) unwinds like Ctrl-C: etcd, controller, host stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    result = run(args.racks, args.hold_s)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    ok = result["node_records_after_hold"] == result["nodes"] and result["lease_losses"] == 0
    if not ok:
        print("some node records were lost while holding the inventory", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
