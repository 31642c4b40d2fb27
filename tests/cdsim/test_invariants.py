"""The invariant checker finds each kind of violation (records planted in a real etcd)."""

from __future__ import annotations

import json
from pathlib import Path

from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import (
    NodeLocalPaths,
    check_cluster_idle,
    check_domain_gone,
    check_store_invariants,
)
from libs.state.store import Store

CLIQUE = "c0ffee00-0000-5000-8000-000000000000.7"


def member(domain: str, node: str, index: int, ns: str = "ns") -> pb.Member:
    return pb.Member(
        domain_uid=domain,
        node_name=node,
        clique_id=CLIQUE,
        index=index,
        state=pb.MemberState.ACTIVE,
        ip_address=f"127.9.0.{index + 1}",
        namespace=ns,
    )


def paths(tmp_path: Path, node: str) -> NodeLocalPaths:
    root = tmp_path / node
    return NodeLocalPaths(node, root / "cdi", root / "imex", root / "checkpoint.json")


async def put_domain(store: Store, uid: str, ns: str = "ns") -> None:
    await store.put(store.keys.domain(uid), pb.ComputeDomain(uid=uid, namespace=ns, name=uid))


async def test_a_consistent_domain_passes(store: Store, tmp_path: Path) -> None:
    await put_domain(store, "d1")
    members = [member("d1", "n0", 0), member("d1", "n1", 1)]
    peers = [m.ip_address for m in members]
    for m in members:
        await store.put(store.keys.member("d1", m.node_name), m)
        await store.put(
            store.keys.daemon("d1", m.node_name),
            pb.DaemonStatus(domain_uid="d1", node_name=m.node_name, state=pb.DaemonState.READY, peers=peers),
        )
        node = paths(tmp_path, m.node_name)
        (node.imex_work_dir / "d1").mkdir(parents=True)
        (node.imex_work_dir / "d1" / "nodes_config.cfg").write_text("\n".join(peers) + "\n")
    nodes = [paths(tmp_path, "n0"), paths(tmp_path, "n1")]
    assert await check_store_invariants(store, nodes=nodes) == []


async def test_each_violation_is_named(store: Store, tmp_path: Path) -> None:
    await put_domain(store, "d1")
    await put_domain(store, "d2", ns="other")
    # inv1: n0 in two domains; inv2: index 0 twice in d1's clique; index 18 out of range.
    for m in (member("d1", "n0", 0), member("d2", "n0", 0), member("d1", "n1", 0), member("d1", "n2", 18)):
        await store.put(store.keys.member(m.domain_uid, m.node_name), m)
    # inv3: a claim prepared on a node that is not a member, and one of another namespace.
    await store.put(
        store.keys.preparation("n5", "c1"),
        pb.PreparedClaim(
            claim_uid="c1",
            namespace="ns",
            node_name="n5",
            domain_uid="d1",
            state=pb.PreparedState.PREPARE_COMPLETED,
        ),
    )
    await store.put(
        store.keys.preparation("n0", "c2"),
        pb.PreparedClaim(
            claim_uid="c2",
            namespace="ns",
            node_name="n0",
            domain_uid="d2",
            state=pb.PreparedState.PREPARE_COMPLETED,
        ),
    )
    # inv4: n1's daemon was told only about itself, and its file on disk lists a stranger.
    await store.put(
        store.keys.daemon("d1", "n1"),
        pb.DaemonStatus(domain_uid="d1", node_name="n1", state=pb.DaemonState.READY, peers=["127.9.0.1"]),
    )
    n1 = paths(tmp_path, "n1")
    (n1.imex_work_dir / "d1").mkdir(parents=True)
    (n1.imex_work_dir / "d1" / "nodes_config.cfg").write_text("127.9.9.9\n")
    found = "\n".join(await check_store_invariants(store, nodes=[n1]))
    assert "inv1: node n0 is a member of 2 domains" in found
    assert "inv2: index 0 of clique" in found and "held by n0 and n1" in found
    assert "inv2: member n2 of d1 has index 18 outside [0, 18)" in found
    assert "inv3: claim c1 is prepared on n5, which is not a member of d1" in found
    assert "inv3: claim c2 of namespace ns is prepared for domain other/d2" in found
    assert "inv4: daemon of n1 in d1 has peers ['127.9.0.1']" in found
    assert "inv4: nodes config of n1 in d1 lists ['127.9.9.9']" in found
    # Invariant 4 only holds at quiescence: not checked when asked not to.
    assert "inv4" not in "\n".join(await check_store_invariants(store, quiescent=False))


async def test_leftovers_of_a_deleted_domain_are_found(store: Store, tmp_path: Path) -> None:
    node = paths(tmp_path, "n0")
    await store.put(store.keys.member("gone", "n0"), member("gone", "n0", 0))
    await store.put(store.keys.claim("c9"), pb.Claim(uid="c9", namespace="ns", name="c9", node_name="n0"))
    node.cdi_root.mkdir(parents=True)
    (node.cdi_root / "k8s.compute-domain.nvidia.com-claim_c9.json").write_text("{}")
    (node.imex_work_dir / "gone").mkdir(parents=True)
    node.checkpoint_file.write_text(
        json.dumps({"entries": {"c9": {"state": "PrepareCompleted", "domainUID": "gone"}}})
    )
    found = "\n".join(await check_domain_gone(store, "gone", ["c9"], [node]))
    assert "inv5: member" in found
    assert "inv5: claim record c9 remains" in found
    assert "inv5: CDI file k8s.compute-domain.nvidia.com-claim_c9.json remains on n0" in found
    assert "inv5: IMEX config dir for gone remains on n0" in found
    assert "inv5: checkpoint entry c9 for gone remains on n0" in found
    idle = "\n".join(await check_cluster_idle(store, [node]))
    assert "idle: member" in idle and "idle: claim" in idle
    assert "idle: CDI file" in idle and "idle: IMEX dir gone remains on n0" in idle
    assert "idle: checkpoint entry c9 remains on n0" in idle


async def test_an_empty_cluster_is_idle(store: Store, tmp_path: Path) -> None:
    node = paths(tmp_path, "n0")
    node.cdi_root.mkdir(parents=True)
    node.imex_work_dir.mkdir(parents=True)
    assert await check_cluster_idle(store, [node]) == []
    assert await check_domain_gone(store, "never-existed", ["c1"], [node]) == []
