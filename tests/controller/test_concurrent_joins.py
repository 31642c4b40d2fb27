"""256 nodes over 15 cliques join one domain at once, against a real etcd, with the controller running."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import check_store_invariants
from libs.state.config import EtcdConfig
from libs.state.membership import join_domain
from libs.state.store import Store
from tests.controller.harness import create_domain, domain_status, running_controller
from tests.polling import eventually

NODES = 256
CLIQUES = 15
PER_CLIQUE = 18


def layout() -> list[pb.Node]:
    """256 nodes: 14 full racks of 18 trays and 4 trays of a 15th rack."""
    nodes = []
    for i in range(NODES):
        rack, tray = divmod(i, PER_CLIQUE)
        nodes.append(
            pb.Node(
                name=f"rack{rack}-tray{tray}",
                ip_address=f"127.1.{rack}.{tray + 1}",
                clique_id=f"00000000-0000-4000-8000-{rack:012d}.1",
                health=pb.Health.HEALTHY,
            )
        )
    assert len({n.clique_id for n in nodes}) == CLIQUES
    return nodes


async def test_256_concurrent_joins_get_unique_dense_indices(store: Store, etcd_config: EtcdConfig) -> None:
    nodes = layout()
    await asyncio.gather(*(store.put(store.keys.node(n.name), n) for n in nodes))
    await create_domain(store, "job256", num_nodes=NODES)
    # The joins alone in this event loop: the controller comes after, so its work does not
    # slow the joiners down (in production it is another process).
    started = time.perf_counter()
    results = await asyncio.gather(*(join_domain(store, "job256", "ns", n) for n in nodes))
    wall = time.perf_counter() - started
    attempts = [r.attempts for r in results]
    print(
        f"\n256 concurrent joins over {CLIQUES} cliques: {wall:.2f} s wall, "
        f"transaction attempts mean {sum(attempts) / len(attempts):.1f}, max {max(attempts)}"
    )
    assert all(r.joined_now for r in results)
    async with running_controller(etcd_config, workers=4):
        members, _ = await store.list(store.keys.members("job256"), pb.Member)
        assert len(members) == NODES, "a join was lost"
        by_clique: dict[str, list[int]] = defaultdict(list)
        for m in members:
            assert m.value.state == pb.MemberState.ACTIVE
            by_clique[m.value.clique_id].append(m.value.index)
        # Unique and dense: with no leave in between, each clique holds exactly 0..k-1.
        for clique, indices in by_clique.items():
            assert sorted(indices) == list(range(len(indices))), clique
        assert sorted(len(v) for v in by_clique.values()) == [4] + [18] * 14
        claims, _ = await store.list(store.keys.member_indices("job256"), pb.IndexClaim)
        assert len(claims) == NODES
        bindings, _ = await store.list(store.keys.node_bindings(), pb.NodeBinding)
        assert {b.value.node_name for b in bindings if b.value.domain_uid == "job256"} == {
            n.name for n in nodes
        }

        # Every daemon comes up and reaches its clique: the controller reports the 256-node domain Ready.
        async def report(n: pb.Node) -> None:
            peers = [p.name for p in nodes if p.clique_id == n.clique_id and p.name != n.name]
            status = pb.DaemonStatus(
                domain_uid="job256", node_name=n.name, state=pb.DaemonState.READY, connected_nodes=peers
            )
            await store.put(store.keys.daemon("job256", n.name), status)

        await asyncio.gather(*(report(n) for n in nodes))

        async def ready() -> pb.ComputeDomainStatus | None:
            status = await domain_status(store, "job256")
            return status if status is not None and status.status == pb.Readiness.READY else None

        status = await eventually(ready, "the 256-node domain to be Ready", timeout_s=20)
        assert len(status.nodes) == NODES and all(n.status == pb.Readiness.READY for n in status.nodes)
        assert await check_store_invariants(store, quiescent=False) == []
