"""cdsim's release of a job's reservation, against a gRPC advisor that answers as the real one
does while etcd restarts (UNAVAILABLE): retried with backoff, not dropped. A dropped release kept
16 of a chaos soak's 18 nodes reserved for the reservation's TTL after their job was deleted."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server

from libs.gen.computedomain.placement import v1 as pp
from tools.cdsim import advisor
from tools.net_ports import free_port


class ScriptedAdvisor(pp.PlacementAdvisorBase):
    """Answers Release with the given statuses in turn, then releases."""

    def __init__(self, failures: list[Status]) -> None:
        self.failures = failures
        self.calls = 0

    async def release(self, release_request: pp.ReleaseRequest) -> pp.ReleaseResponse:
        self.calls += 1
        if self.failures:
            status = self.failures.pop(0)
            raise GRPCError(status, f"scripted {status.name}")
        return pp.ReleaseResponse(released=True, node_names=["n0"])


async def _serve(service: ScriptedAdvisor) -> AsyncIterator[str]:
    server = Server([service])
    port = free_port()
    await server.start("127.0.0.1", port)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture
async def flaky() -> AsyncIterator[tuple[ScriptedAdvisor, str]]:
    service = ScriptedAdvisor([Status.UNAVAILABLE, Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED])
    async for endpoint in _serve(service):
        yield service, endpoint


async def test_a_release_refused_while_the_store_is_unavailable_is_retried_until_it_succeeds(
    flaky: tuple[ScriptedAdvisor, str],
) -> None:
    service, endpoint = flaky
    assert await advisor.release(endpoint, "r1", holder="cdsim/job")
    assert service.calls == 4


async def test_a_release_the_advisor_refuses_for_good_is_not_retried() -> None:
    service = ScriptedAdvisor([Status.INVALID_ARGUMENT])
    async for endpoint in _serve(service):
        assert not await advisor.release(endpoint, "r1", holder="cdsim/job")
        assert service.calls == 1


async def test_a_release_gives_up_at_its_deadline() -> None:
    service = ScriptedAdvisor([Status.UNAVAILABLE] * 100)
    async for endpoint in _serve(service):
        began = time.monotonic()
        assert not await advisor.release(endpoint, "r1", holder="cdsim/job", deadline_s=1.5)
        assert time.monotonic() - began < 3.0
        assert 2 <= service.calls < 100
