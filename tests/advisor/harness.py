"""Run real advisor services (gRPC + extender + health), or an in-process Advisor, against the test
etcd (test helper)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from grpclib.client import Channel

from libs.gen.computedomain.placement import v1 as pp
from libs.gen.computedomain.state import v1 as pb
from libs.state.config import EtcdConfig
from libs.state.store import Store
from services.advisor.advisor import Advisor
from services.advisor.fleet_feeds import follow, wait_until
from services.advisor.fleet_index import FleetIndex
from services.advisor.main import AdvisorService
from services.advisor.settings import AdvisorSettings
from tests.advisor.fleet import put_nodes


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
    assert await wait_until(service.fleet, lambda: service.fleet.ready, 20.0), "inventory not synced"
    try:
        yield Running(service, stop, task)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=20.0)


@contextlib.asynccontextmanager
async def advisor_on_store(store: Store, records: Sequence[pb.Node]) -> AsyncIterator[Advisor]:
    """An in-process Advisor whose inventory follows `store`, after `records` were written there."""
    await put_nodes(store, records)
    fleet = FleetIndex()
    ready = asyncio.Event()
    feeds = asyncio.create_task(follow(fleet, store, ready.set))
    try:
        await asyncio.wait_for(ready.wait(), 20)
        advisor = Advisor(fleet, store)
        try:
            yield advisor
        finally:
            await advisor.close()
    finally:
        feeds.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeds
