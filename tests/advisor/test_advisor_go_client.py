"""The advisor from Go: integrations/placement-go's placement-check (grpc-go, bindings generated
from protos/) calls every PlacementAdvisor method, the standard health service and server
reflection against a running advisor, with an error case per call."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from grpclib.client import Channel
from grpclib.health.check import ServiceStatus
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from libs.gen.computedomain.state import v1 as pb
from libs.state.config import EtcdConfig
from libs.state.store import Store
from services.advisor.standard_services import standard_services
from services.advisor.transport import CorkedServer
from tests.advisor.fleet import cluster_records, put_nodes
from tests.advisor.harness import running_advisor, settings_for
from tools.cached_tool import cached_tool
from tools.sim.hardware.cluster import ClusterDescription

REPO = Path(__file__).resolve().parents[2]
CLUSTER = ClusterDescription(racks=2, trays_per_rack=18, seed="go-client")
EXPECTED_CHECKS = {
    'health ""',
    'health "computedomain.placement.v1.PlacementAdvisor"',
    "health unknown service",
    "reflection list",
    "reflection describe",
    "reflection unknown symbol",
    "GetCapacity",
    "GetCapacity unknown selector key",
    "WatchCapacity first snapshot",
    "Place",
    "Place num_nodes=0",
    "Explain",
    "Explain num_nodes=-1",
    "Reserve",
    "Reserve taken nodes",
    "WatchCapacity sees the reservation",
    "WatchCapacity min_interval_ms=-1",
    "Release by another holder",
    "Release",
    "Release empty id",
}


@pytest.fixture(scope="module")
def placement_check() -> Path:
    return cached_tool("integrations/placement-go/build.sh", "--cached-only") / "placement-check"


async def test_a_go_client_uses_every_call_health_and_reflection(
    etcd_config: EtcdConfig, store: Store, placement_check: Path
) -> None:
    await put_nodes(store, cluster_records(CLUSTER))
    async with running_advisor(settings_for(etcd_config)) as adv:
        proc = await asyncio.create_subprocess_exec(
            str(placement_check),
            "-addr",
            f"127.0.0.1:{adv.grpc_port}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    results = [json.loads(line) for line in out.decode().splitlines()]
    failed = [r for r in results if not r["ok"]]
    assert proc.returncode == 0 and not failed, f"{failed}\n{err.decode()}"
    assert {r["check"] for r in results} == EXPECTED_CHECKS
    # The reservation the Go client made and released is gone from the store.
    reservations, _ = await store.list(store.keys.node_reservations(), pb.Reservation)
    assert reservations == []


async def test_health_follows_readiness(tmp_path: Path) -> None:
    """NOT_SERVING until the status is set (the advisor sets it once its inventory is synced)."""
    ready = ServiceStatus()
    ready.set(False)
    server = CorkedServer(standard_services([], ready))
    socket = str(tmp_path / "advisor.sock")
    await server.start(path=socket)
    channel = Channel(path=socket)
    try:
        health = HealthStub(channel)
        before = await health.Check(HealthCheckRequest(service=""), timeout=5)
        ready.set(True)
        after = await health.Check(HealthCheckRequest(service=""), timeout=5)
    finally:
        channel.close()
        server.close()
        await server.wait_closed()
    assert before.status == HealthCheckResponse.NOT_SERVING
    assert after.status == HealthCheckResponse.SERVING
