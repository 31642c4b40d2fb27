"""A dashboard served in-process over a real etcd, with a simulated cluster's rack layout."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from libs.state.config import EtcdConfig
from libs.state.store import Store
from tests.dashboard import records
from tools.dashboard.main import DashboardService, resolve_target
from tools.dashboard.settings import DashboardSettings
from tools.sim.hardware.cluster import ClusterDescription


@dataclass
class Served:
    service: DashboardService
    store: Store
    cluster: ClusterDescription

    @property
    def url(self) -> str:
        return self.service.url


async def serve(
    tmp_path: Path, etcd_config: EtcdConfig, cluster: ClusterDescription, down: tuple[str, ...] = ()
) -> AsyncIterator[Served]:
    cluster_file = tmp_path / "cluster.json"
    cluster.save(cluster_file)
    store = Store(etcd_config)
    await store.connect()
    for name in cluster.node_names():
        if name not in down:
            await store.put(store.keys.node(name), records.node(cluster, name))
    settings = DashboardSettings(
        etcd_endpoint=etcd_config.endpoint,
        etcd_prefix=etcd_config.prefix,
        sim_cluster=str(cluster_file),
        host="127.0.0.1",
        port=0,
        title="test cluster",
        keepalive_s=0.5,
    )
    service = DashboardService(settings, resolve_target(settings))
    await service.start()
    try:
        yield Served(service, store, cluster)
    finally:
        await service.stop()
        await store.close()


@pytest.fixture
async def nvl72(tmp_path: Path, etcd_config: EtcdConfig) -> AsyncIterator[Served]:
    """Two racks of 18 trays; rack1-tray5's agent never registered."""
    cluster = ClusterDescription(racks=2, trays_per_rack=18, seed="dashboard")
    async for served in serve(tmp_path, etcd_config, cluster, down=("rack1-tray5",)):
        yield served
