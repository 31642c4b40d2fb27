"""Run real advisor services (gRPC + extender + health) against the test etcd (test helper)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from grpclib.client import Channel

from libs.gen.computedomain.placement import v1 as pp
from libs.state.config import EtcdConfig
from services.advisor.main import AdvisorService
from services.advisor.settings import AdvisorSettings


def settings_for(etcd_config: EtcdConfig, **overrides: object) -> AdvisorSettings:
    base = AdvisorSettings(
        etcd_endpoint=etcd_config.endpoint,
        etcd_prefix=etcd_config.prefix,
        grpc_host="127.0.0.1",
        grpc_port=0,
        extender_host="127.0.0.1",
        extender_port=0,
        health_host="127.0.0.1",
        health_port=0,
        log_format="console",
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


@dataclass
class Running:
    service: AdvisorService
    stop: asyncio.Event
    task: asyncio.Task[None]

    @property
    def grpc_port(self) -> int:
        assert self.service.grpc_port
        return self.service.grpc_port

    def channel(self) -> Channel:
        return Channel("127.0.0.1", self.grpc_port)

    def stub(self, channel: Channel) -> pp.PlacementAdvisorStub:
        return pp.PlacementAdvisorStub(channel, timeout=10.0)


@contextlib.asynccontextmanager
async def running_advisor(settings: AdvisorSettings) -> AsyncIterator[Running]:
    service = AdvisorService(settings)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    started = asyncio.create_task(service.started.wait())
    done, _ = await asyncio.wait({task, started}, timeout=20.0, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()
    assert started in done, "advisor did not start"
    assert await service.inventory.wait_for(lambda: service.inventory.ready, 20.0), "inventory not synced"
    try:
        yield Running(service, stop, task)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=20.0)
