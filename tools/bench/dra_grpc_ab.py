"""A/B of the DRA socket's gRPC stack: the agent's grpclib + betterproto against grpcio + protobuf.

The node agent serves kubelet with grpclib (pure-Python HTTP/2) and betterproto messages. The
alternative is grpcio's asyncio server (C core) with Google's protobuf runtime (upb, messages
generated with grpc_tools.protoc at run time from the repo's protos/, as tests/nodeagent does).
Both serve ``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` on a unix socket in a process of their
own with the same trivial handler (one claim answered with one device, no store, no files), so
the figure is the stack's own cost per call. One grpcio client process (kubelet's side, played
by the C-core client) calls both, alternately, in the same run: a warm-up, then `--calls` calls
at each of the `--inflight` levels. Reported per stack and level: the server's CPU per call
(from /proc, robust to a busy machine) and the client-side latency.

    python -m tools.bench.dra_grpc_ab [--calls 4000] [--inflight 1,16] [--rounds 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from tools.bench.proc_cpu import cpu_seconds
from tools.bench.stats import percentile

REPO = Path(__file__).resolve().parents[2]
PROTO = REPO / "protos/k8s.io/kubelet/pkg/apis/dra/v1/api.proto"
STACKS = ("grpclib", "grpcio")
POOL, DEVICE = "rack0-tray0", "channel-0"


def generate_stubs(out: Path) -> None:
    """grpcio and protobuf modules ``drav1_pb2`` / ``drav1_pb2_grpc`` in `out`."""
    from grpc_tools import protoc

    shutil.copy(PROTO, out / "drav1.proto")  # a flat name: "k8s.io" is no Python package name
    code = protoc.main(
        ["protoc", f"-I{out}", f"--python_out={out}", f"--grpc_python_out={out}", str(out / "drav1.proto")]
    )
    if code != 0:
        raise SystemExit(f"protoc failed on {PROTO}")


def load_stubs(out: Path) -> tuple[ModuleType, ModuleType]:
    sys.path.insert(0, str(out))
    return importlib.import_module("drav1_pb2"), importlib.import_module("drav1_pb2_grpc")


def cdi_id(uid: str) -> str:
    return f"k8s.compute-domain.nvidia.com/claim={uid}-channel-0"


async def serve_grpclib(socket_path: str) -> None:
    from grpclib.server import Server

    from libs.gen.k8s.io.kubelet.pkg.apis.dra import v1 as api

    class Dra(api.DraPluginBase):
        async def node_prepare_resources(
            self, node_prepare_resources_request: api.NodePrepareResourcesRequest
        ) -> api.NodePrepareResourcesResponse:
            return api.NodePrepareResourcesResponse(
                claims={
                    c.uid: api.NodePrepareResourceResponse(
                        devices=[
                            api.Device(
                                request_names=["channel"],
                                pool_name=POOL,
                                device_name=DEVICE,
                                cdi_device_ids=[cdi_id(c.uid)],
                            )
                        ]
                    )
                    for c in node_prepare_resources_request.claims
                }
            )

    server = Server([Dra()])
    await server.start(path=socket_path)
    await server.wait_closed()


async def serve_grpcio(socket_path: str, stubs: Path) -> None:
    import grpc

    pb2, pb2_grpc = load_stubs(stubs)

    class Dra(pb2_grpc.DRAPluginServicer):  # type: ignore[name-defined]
        async def NodePrepareResources(self, request: Any, context: Any) -> Any:
            reply = pb2.NodePrepareResourcesResponse()
            for claim in request.claims:
                device = reply.claims[claim.uid].devices.add(
                    request_names=["channel"], pool_name=POOL, device_name=DEVICE
                )
                device.cdi_device_ids.append(cdi_id(claim.uid))
            return reply

    server = grpc.aio.server()
    pb2_grpc.add_DRAPluginServicer_to_server(Dra(), server)
    server.add_insecure_port(f"unix://{socket_path}")
    await server.start()
    await server.wait_for_termination()


def start_server(stack: str, socket_path: Path, stubs: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.bench.dra_grpc_ab", "--serve", stack, str(socket_path), str(stubs)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    deadline = time.monotonic() + 30
    while not socket_path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{stack} server did not serve {socket_path}")
        time.sleep(0.05)
    return proc


async def measure(stub: Any, pb2: ModuleType, server_pid: int, calls: int, inflight: int) -> dict[str, float]:
    latencies: list[float] = []

    async def call(i: int) -> None:
        uid = f"00000000-0000-4000-8000-{i:012d}"
        request = pb2.NodePrepareResourcesRequest(
            claims=[pb2.Claim(namespace="bench", uid=uid, name=f"c-{i}")]
        )
        start = time.perf_counter()
        reply = await stub.NodePrepareResources(request, timeout=30)
        latencies.append(time.perf_counter() - start)
        if list(reply.claims[uid].devices[0].cdi_device_ids) != [cdi_id(uid)]:
            raise SystemExit(f"wrong answer for {uid}: {reply}")

    async def caller(first: int) -> None:
        for i in range(first, calls, inflight):
            await call(i)

    cpu_before, wall_start = cpu_seconds(server_pid), time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(inflight)))
    wall = time.perf_counter() - wall_start
    ms = [v * 1000 for v in latencies]
    return {
        "server_cpu_ms_per_call": round((cpu_seconds(server_pid) - cpu_before) * 1000 / calls, 4),
        "calls_per_s": round(calls / wall, 1),
        "p50_ms": round(percentile(ms, 50), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "mean_ms": round(statistics.fmean(ms), 3),
    }


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import grpc
    from google.protobuf.internal import api_implementation

    stubs = work / "stubs"
    stubs.mkdir()
    generate_stubs(stubs)
    pb2, pb2_grpc = load_stubs(stubs)
    servers = {stack: start_server(stack, work / f"{stack}.sock", stubs) for stack in STACKS}
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        s: {str(n): [] for n in args.inflight} for s in STACKS
    }
    try:
        channels = {s: grpc.aio.insecure_channel(f"unix://{work / f'{s}.sock'}") for s in STACKS}
        stubs_by_stack = {s: pb2_grpc.DRAPluginStub(channels[s]) for s in STACKS}
        for stack in STACKS:  # warm-up: connections, code paths
            await measure(stubs_by_stack[stack], pb2, servers[stack].pid, 300, 4)
        for _ in range(args.rounds):
            for inflight in args.inflight:
                for stack in STACKS:
                    figures = await measure(
                        stubs_by_stack[stack], pb2, servers[stack].pid, args.calls, inflight
                    )
                    results[stack][str(inflight)].append(figures)
                    print(stack, f"inflight={inflight}", figures, file=sys.stderr)
        for channel in channels.values():
            await channel.close()
    finally:
        for proc in servers.values():
            proc.terminate()
            proc.wait(10)
    return {
        "benchmark": "dra_grpc_ab",
        "description": "NodePrepareResources with a trivial handler (one claim, one device) on a unix socket: "
        "the agent's grpclib + betterproto server against grpcio's asyncio server + protobuf, "
        "one grpcio client process calling both alternately",
        "settings": {
            "calls": args.calls,
            "inflight": args.inflight,
            "rounds": args.rounds,
            "protobuf_runtime": api_implementation.Type(),
            "cpu_count": os.cpu_count(),
        },
        "results": results,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        stack, socket_path, stubs = argv[1:4]
        server = serve_grpclib(socket_path) if stack == "grpclib" else serve_grpcio(socket_path, Path(stubs))
        asyncio.run(server)
        return
    parser = argparse.ArgumentParser(prog="dra_grpc_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4000, help="calls per stack, level and round")
    parser.add_argument(
        "--inflight",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 16],
        help="comma-separated calls in flight (default 1,16)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two stacks")
    parser.add_argument("--out", type=Path, help="also write the result as JSON to this file")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rounds < 1 or not args.inflight or min(args.inflight) < 1:
        parser.error("--calls, --rounds and every --inflight level must be >= 1")
    # Unix socket paths must fit in 108 bytes: a short temp directory.
    work = Path(tempfile.mkdtemp(prefix="dra-ab-"))
    try:
        result = asyncio.run(run(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
