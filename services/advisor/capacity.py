"""The capacity report: what the inventory holds per clique, for GetCapacity and WatchCapacity
(a pure function of the fleet index)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.advisor import policies
from services.advisor.fleet_index import FleetIndex


@dataclass(frozen=True, slots=True)
class CliqueCapacity:
    clique_id: str
    cluster_uuid: str
    total_nodes: int
    healthy_nodes: int
    free_nodes: int
    reserved_nodes: int
    bound_nodes: int


@dataclass(frozen=True, slots=True)
class CapacityReport:
    cliques: tuple[CliqueCapacity, ...]
    total_nodes: int
    healthy_nodes: int
    free_nodes: int
    reserved_nodes: int
    bound_nodes: int
    largest_free_block: int
    fragmentation: float
    generation: int


def capacity_report(inv: FleetIndex, selector: Mapping[str, str]) -> CapacityReport:
    """Per clique (in rank order) and in total: nodes, healthy, free, reserved and bound, of the
    nodes matching `selector` (already checked); cliques without such nodes are left out."""
    rows = []
    for cid, clique in inv.cliques.items():
        members = [n for n in clique.nodes if all(inv.node_attribute(n, k) == v for k, v in selector.items())]
        if selector and not members:
            continue
        rows.append(
            CliqueCapacity(
                clique_id=cid,
                cluster_uuid=clique.cluster,
                total_nodes=len(members),
                healthy_nodes=sum(1 for n in members if inv.nodes[n].usable),
                free_nodes=sum(1 for n in members if n in clique.free),
                reserved_nodes=sum(1 for n in members if n in inv.reserved_by),
                bound_nodes=sum(1 for n in members if n in inv.bound),
            )
        )
    rows.sort(key=lambda r: inv.cliques[r.clique_id].rank)
    return CapacityReport(
        cliques=tuple(rows),
        total_nodes=sum(r.total_nodes for r in rows),
        healthy_nodes=sum(r.healthy_nodes for r in rows),
        free_nodes=sum(r.free_nodes for r in rows),
        reserved_nodes=sum(r.reserved_nodes for r in rows),
        bound_nodes=sum(r.bound_nodes for r in rows),
        largest_free_block=max((r.free_nodes for r in rows), default=0),
        fragmentation=policies.fragmentation_of((r.free_nodes, r.total_nodes) for r in rows),
        generation=inv.generation,
    )
