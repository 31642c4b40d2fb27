"""A/B of a claim GET: kubernetes-asyncio's own client against libs/kube/client.py's.

Both read one allocated ResourceClaim from a real kube-apiserver (tools/bench/kube_claims.py),
the way the node agent's claim source does, alternately in one process, `--rounds` times:
`--calls` GETs one at a time per variant and round. Reported per variant and round: this
process's CPU time per GET (what the agent's event loop pays; a busy machine inflates it far less
than latency) and the latency p50 / p99.

    python -m tools.bench.kube_client_ab [--calls 500] [--rounds 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from libs.kube.resource_api import resource_path
from tools.bench import kube_claims, simenv
from tools.bench.prepare_load import summary
from tools.controlplane.binaries import ensure_binaries

NAMESPACE, CLAIM = "bench", "claim-0"


async def _plain_client(kubeconfig: Path) -> Any:
    from kubernetes_asyncio import config as kube_config
    from kubernetes_asyncio.client import ApiClient, Configuration

    configuration = Configuration()
    await kube_config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    return ApiClient(configuration)


async def _measure(api: Any, calls: int) -> dict[str, float]:
    path = resource_path(kube_claims.RESOURCE_VERSION, "resourceclaims", NAMESPACE, CLAIM)
    for _ in range(20):  # warm-up: the connection
        await kube_claims.request(api, "GET", path)
    latencies: list[float] = []
    cpu = time.process_time()
    for _ in range(calls):
        began = time.perf_counter()
        await kube_claims.request(api, "GET", path)
        latencies.append(time.perf_counter() - began)
    return {"cpu_ms_per_get": round((time.process_time() - cpu) * 1000 / calls, 3), **summary(latencies)}


async def run(args: argparse.Namespace, kube: kube_claims.ApiServer) -> dict[str, Any]:
    clients = {
        "kubernetes_asyncio": await _plain_client(kube.kubeconfig),
        "without_env_lookups": await kube_claims.api_client(kube.kubeconfig),
    }
    try:
        await kube_claims.create_allocated_claims(
            clients["without_env_lookups"], NAMESPACE, [CLAIM], "rack0-tray0", "domain-0"
        )
        results: dict[str, list[dict[str, float]]] = {name: [] for name in clients}
        for _ in range(args.rounds):
            for name, api in clients.items():
                figures = await _measure(api, args.calls)
                results[name].append(figures)
                print(name, figures, file=sys.stderr, flush=True)
        return results
    finally:
        for api in clients.values():
            await api.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kube_client_ab", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="GETs per variant and round")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two clients")
    parser.add_argument("--out", type=Path, help="also write the result as JSON to this file")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        parser.error("--calls and --rounds must be >= 1")
    base = simenv.scratch_dir("kube-ab-")
    kube = kube_claims.ApiServer(ensure_binaries(), base / "kube", wait_for_controllers=False)
    try:
        kube.start()
        results = asyncio.run(run(args, kube))
    finally:
        kube.stop()
        shutil.rmtree(base, ignore_errors=True)
    text = json.dumps(
        {
            "benchmark": "kube_client_ab",
            "settings": {"calls": args.calls, "rounds": args.rounds, "kubernetes": kube.version},
            "results": results,
            "load_average_1m": round(os.getloadavg()[0], 2),
        },
        indent=2,
    )
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
