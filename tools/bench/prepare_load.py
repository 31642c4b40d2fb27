"""The loads tools/bench/nodeagent_prepare.py puts on a node agent's DRA socket, and their floors.

Kubelet makes one NodePrepareResources call per pod with that pod's claims; pods' calls overlap
only when pods start together, and a GB200 tray rarely starts more than a few at once. So:
- :func:`sequential`: one call in flight (a pod at a time);
- :func:`bursts`: `size` pods starting together, then idle: the latency that pod start waits
  for is the last call's of the burst;
- :func:`closed_loop`: `inflight` calls always outstanding, the agent's capacity (calls/s).

Floors measured beside them, by the same client: an empty-handler DRA call on the agent's gRPC
stack (grpclib + betterproto over a unix socket, tools/bench/dra_grpc_ab.py's server) and one
fsynced etcd transaction through the project's store client (a guarded write of a claim-sized
record, as the agent's record write is). A prepare cannot be faster than either.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from grpclib.client import Channel

from libs.gen.k8s.io.kubelet.pkg.apis.dra import v1 as dra
from libs.state.store import Absent, Put, Store, Unchanged
from tools.bench import dra_grpc_ab
from tools.bench.stats import percentile

_CALL_TIMEOUT_S = 30.0


def summary(latencies_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in latencies_s]
    return {
        "calls": len(ms),
        "p50_ms": round(percentile(ms, 50), 3),
        "p90_ms": round(percentile(ms, 90), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "max_ms": round(max(ms), 3),
        "mean_ms": round(statistics.fmean(ms), 3),
    }


async def prepare(stub: dra.DraPluginStub, claim: dra.Claim) -> float:
    """One NodePrepareResources call for `claim`: its latency (s); SystemExit if it failed."""
    start = time.perf_counter()
    reply = await stub.node_prepare_resources(
        dra.NodePrepareResourcesRequest(claims=[claim]), timeout=_CALL_TIMEOUT_S
    )
    took = time.perf_counter() - start
    if reply.claims[claim.uid].error:
        raise SystemExit(f"prepare of {claim.uid} failed: {reply.claims[claim.uid].error}")
    return took


async def unprepare(stub: dra.DraPluginStub, claim: dra.Claim) -> float:
    start = time.perf_counter()
    reply = await stub.node_unprepare_resources(
        dra.NodeUnprepareResourcesRequest(claims=[claim]), timeout=_CALL_TIMEOUT_S
    )
    took = time.perf_counter() - start
    if reply.claims[claim.uid].error:
        raise SystemExit(f"unprepare of {claim.uid} failed: {reply.claims[claim.uid].error}")
    return took


async def closed_loop(
    stub: dra.DraPluginStub, claims: list[dra.Claim], inflight: int, hold: int = 1
) -> tuple[list[float], list[float]]:
    """Prepare every claim and unprepare it again, `inflight` callers at a time over one
    connection. Each caller prepares its next claim, then unprepares the one it prepared `hold`
    claims before, so the node holds up to (`hold` + 1) x `inflight` claims besides the anchor.
    The latencies (s) of the prepares and of the unprepares."""
    prepares: list[float] = []
    unprepares: list[float] = []

    async def caller(mine: list[dra.Claim]) -> None:
        held: list[dra.Claim] = []
        for claim in mine:
            prepares.append(await prepare(stub, claim))
            held.append(claim)
            if len(held) > hold:
                unprepares.append(await unprepare(stub, held.pop(0)))
        for claim in held:
            unprepares.append(await unprepare(stub, claim))

    await asyncio.gather(*(caller(claims[i::inflight]) for i in range(inflight)))
    return prepares, unprepares


async def sequential(
    stub: dra.DraPluginStub, claims: list[dra.Claim], hold: int
) -> tuple[list[float], list[float]]:
    """One call in flight; `hold` claims stay prepared besides the one being prepared."""
    return await closed_loop(stub, claims, 1, hold)


async def bursts(
    stub: dra.DraPluginStub, claims: list[dra.Claim], size: int, idle_s: float
) -> tuple[list[float], list[float]]:
    """`size` prepares sent together, then `idle_s` idle, then their `size` unprepares together,
    then idle again, for each group of `size` claims. Per burst, the latency of its last call
    from the burst's start (all of its calls leave at once): (prepare bursts, unprepare bursts)."""

    async def burst(
        call: Callable[[dra.DraPluginStub, dra.Claim], Awaitable[float]], group: list[dra.Claim]
    ) -> float:
        start = time.perf_counter()
        await asyncio.gather(*(call(stub, c) for c in group))
        return time.perf_counter() - start

    prepares: list[float] = []
    unprepares: list[float] = []
    for first in range(0, len(claims) - size + 1, size):
        group = claims[first : first + size]
        prepares.append(await burst(prepare, group))
        await asyncio.sleep(idle_s)
        unprepares.append(await burst(unprepare, group))
        await asyncio.sleep(idle_s)
    return prepares, unprepares


async def dra_call_floor(work: Path, calls: int) -> list[float]:
    """`calls` NodePrepareResources, one in flight, to an empty-handler server on the agent's gRPC
    stack (its own process, a unix socket); the latencies (s) at this client."""
    socket_path = work / "floor-dra.sock"
    server = dra_grpc_ab.start_server("grpclib", socket_path, work)
    channel = Channel(path=str(socket_path))
    try:
        stub = dra.DraPluginStub(channel)
        claims = [
            dra.Claim(namespace="bench", uid=str(uuid.uuid4()), name=f"floor-{i}") for i in range(calls)
        ]
        for claim in claims[:20]:  # warm-up: the connection, the code paths
            await prepare(stub, claim)
        return [await prepare(stub, claim) for claim in claims]
    finally:
        channel.close()
        server.terminate()
        server.wait(10)


async def etcd_txn_floor(store: Store, record: bytes, calls: int) -> list[float]:
    """`calls` guarded transactions (compare the key's revision, put `record`), one in flight, on
    the store the agent uses; the latencies (s)."""
    key = f"{store.keys.prefix}bench-floor/{uuid.uuid4().hex}"
    mod = (await store.txn([Absent(key)], [Put(key, record)])).revision
    latencies: list[float] = []
    for _ in range(calls):
        start = time.perf_counter()
        result = await store.txn([Unchanged(key, mod)], [Put(key, record)])
        latencies.append(time.perf_counter() - start)
        if not result.succeeded:
            raise SystemExit(f"the floor's transaction on {key} lost its guard")
        mod = result.revision
    await store.delete(key)
    return latencies
