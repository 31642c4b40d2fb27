"""Node records of a simulated cluster, for the inventory and the store (test helper)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store, with_retries
from services.advisor.fleet_index import FleetIndex
from tools.sim.hardware.cluster import ClusterDescription


def node_record(
    name: str,
    clique: str,
    cluster_uuid: str,
    health: pb.Health = pb.Health.HEALTHY,
    gpus: int = 4,
    fabric: pb.FabricState = pb.FabricState.COMPLETED,
) -> pb.Node:
    return pb.Node(
        name=name,
        clique_id=clique,
        cluster_uuid=cluster_uuid,
        health=health,
        gpus=[
            pb.Gpu(
                uuid=f"GPU-{name}-{i}",
                index=i,
                clique_id=clique,
                fabric_state=fabric,
                health=pb.Health.HEALTHY,
            )
            for i in range(gpus)
        ],
    )


def cluster_records(cluster: ClusterDescription) -> list[pb.Node]:
    return [node_record(n.name, n.clique, n.cluster_uuid) for n in cluster.nodes()]


def filled_fleet(records: Iterable[pb.Node]) -> FleetIndex:
    fleet = FleetIndex()
    fleet.synced.update({"nodes", "bindings", "reservations"})
    for record in records:
        fleet.apply_node(record.name, record)
    return fleet


async def put_nodes(store: Store, records: Sequence[pb.Node], lease: int = 0, concurrency: int = 32) -> None:
    """Write node records one put each, as node agents do (`concurrency` at a time)."""

    async def put_one(record: pb.Node) -> None:
        await with_retries(lambda: store.put(store.keys.node(record.name), record, lease), "seed node", 20.0)

    for i in range(0, len(records), concurrency):
        await asyncio.gather(*(put_one(r) for r in records[i : i + concurrency]))


async def bind(store: Store, node: str, domain_uid: str) -> None:
    await store.put(store.keys.node_binding(node), pb.NodeBinding(node_name=node, domain_uid=domain_uid))
