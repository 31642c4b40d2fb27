"""`python -m tools.chaoskube --duration SECONDS [--seed N]`: the chaos soak in Kubernetes mode on a
fresh environment of real kubelets (one rack of --trays trays, tests/e2e/harness.py).

Prints the seed first, the result at the end; `--summary-json` also writes it as data (faults by
kind, jobs, checks, violations). Exit status: 0 when every invariant held, 1 on a violation (the
environment's logs are kept and their place printed), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
from pathlib import Path

from kubernetes_asyncio import config as k8s_config

from libs.runtime.logging import configure_logging
from libs.state.config import EtcdConfig
from libs.state.store import Store
from tests.e2e.harness import E2EEnvironment
from tools.chaoskube.soak import KubeSoak, KubeSoakOptions
from tools.controlplane.binaries import ensure_binaries, ensure_node_binaries
from tools.sim.kubelet.addresses import addresses_in_range
from tools.sim.kubelet.host_state import host_state


def _host(state: dict[str, object]) -> dict[str, object]:
    """What this environment's kubelets could change on the host (tools.sim.kubelet.host_state): the
    kernel values and kubelet's host paths; node IPs and mounts of other environments running
    on the machine at the same time are not ours, so the node IPs are checked by address."""
    return {k: v for k, v in state.items() if k in ("sysctl", "paths")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.chaoskube",
        description="Random ComputeDomain jobs through the API server on real kubelets, under kubelet restarts, "
        "cd-node-agent kills, controller failovers, kube-apiserver restarts and lost nodes; invariants checked "
        "throughout. Seeded: the same seed makes the same decisions.",
    )
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of faults (default 600)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one, printed)")
    parser.add_argument("--trays", type=int, default=6, help="trays (nodes, each with a kubelet) of the rack")
    parser.add_argument("--max-job-size", type=int, default=2, help="pods of the largest job (default 2)")
    parser.add_argument("--settle", type=float, default=180.0, help="seconds a quiescence may take")
    parser.add_argument("--quiet", action="store_true", help="do not print events as they happen")
    parser.add_argument("--summary-json", type=Path, default=None, help="also write the result here")
    return parser


async def _soak(env: E2EEnvironment, options: KubeSoakOptions) -> tuple[bool, KubeSoak]:
    api = await k8s_config.new_client_from_config(config_file=str(env.cp.kubeconfig))
    store = Store(EtcdConfig(endpoint=env.etcd.endpoint, timeout_s=5.0))
    await store.connect()
    try:
        soak = KubeSoak(env, api, store, options, sys.stdout)
        return await soak.run(), soak
    finally:
        await store.close()
        await api.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.duration <= 0 or args.trays < 3 or not 1 <= args.max_job_size < args.trays - 1:
        print("need --duration > 0, --trays >= 3 and 1 <= --max-job-size < trays - 1", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    print(f"kubernetes chaos soak: seed {seed}, {args.duration:.0f}s, {args.trays} trays", flush=True)
    configure_logging("console", "critical", stream=sys.stderr)
    binaries = ensure_binaries()
    ensure_node_binaries()
    before = _host(host_state())
    env = E2EEnvironment(binaries, racks=1, trays=args.trays, kubelets="real")
    env.start()
    ok = False
    try:
        print(f"environment up in {sum(env.timings.values()):.0f}s: {env.timings}", flush=True)
        options = KubeSoakOptions(
            duration_s=args.duration,
            seed=seed,
            settle_s=args.settle,
            max_job_size=args.max_job_size,
            echo=not args.quiet,
        )
        ok, soak = asyncio.run(_soak(env, options))
        print(soak.report(ok), flush=True)
        if args.summary_json is not None:
            args.summary_json.write_text(json.dumps(soak.summary(ok), indent=2) + "\n")
    finally:
        env.stop(keep_root=not ok)
    after = _host(host_state())
    left = sorted(set(env.kubelet_nodes[n].ip for n in env.kubelet_nodes) & set(addresses_in_range()))
    if after != before or left:
        print(
            f"the host changed: the real kubelets left {left or 'kernel values or paths'} behind",
            file=sys.stderr,
        )
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
