"""What a policy decides over for one request: the candidate cliques' free-node counts, and how to
name their free nodes (pure functions of the fleet index and the request)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.advisor.clique_index import CliqueFree, CliqueIndex
from services.advisor.fleet_index import FleetIndex
from services.advisor.model import PlacementRequest


@dataclass(slots=True)
class View:
    """Policy input for one request: candidate cliques and how to name their free nodes."""

    index: CliqueIndex
    largest: int
    names: Callable[[str], list[str]]
    # The same cliques with unhealthy-but-untaken nodes counted as free.
    with_sick: Callable[[], CliqueIndex]


def view_for(inv: FleetIndex, req: PlacementRequest) -> View:
    """The policy input for `req`: the whole inventory's index when nothing narrows it (no copy),
    else the candidate cliques with their free nodes counted and named."""
    if req.node_selector or req.candidate_nodes is not None or req.gpus_per_node > inv.min_usable_gpus():
        return _restricted(inv, req)
    if req.excluded_nodes:
        return _excluding(inv, req.excluded_nodes)
    return _whole(inv)


def _whole(inv: FleetIndex) -> View:
    return View(inv.index, inv.largest_clique(), inv.sorted_free, lambda: inv.index_with_sick)


def _restricted(inv: FleetIndex, req: PlacementRequest) -> View:
    sel = req.node_selector
    ids: set[str] | None = None

    def narrow(found: set[str]) -> None:
        nonlocal ids
        ids = set(found) if ids is None else ids & found

    if "clique" in sel:
        narrow({sel["clique"]})
    for key in ("cluster", "rack"):
        if key in sel:
            narrow(inv.cliques_by_cluster.get(sel[key], set()))
    if "name" in sel:
        named_clique = inv.nodes[sel["name"]].clique
        narrow({named_clique} if named_clique else set())
    if req.candidate_nodes is not None:
        narrow({inv.nodes[n].clique for n in req.candidate_nodes if n in inv.nodes and inv.nodes[n].clique})
    chosen_ids = set(inv.cliques) if ids is None else ids

    checks: list[Callable[[str], bool]] = []
    if "name" in sel:
        wanted_name = sel["name"]
        checks.append(lambda n: n == wanted_name)
    for key in ("driver_version", "agent_version"):
        if key in sel:
            checks.append(_attribute_check(inv, key, sel[key]))
    if req.excluded_nodes:
        excluded = req.excluded_nodes
        checks.append(lambda n: n not in excluded)
    if req.candidate_nodes is not None:
        candidates = req.candidate_nodes
        checks.append(lambda n: n in candidates)
    if req.gpus_per_node > 0:
        gpus = req.gpus_per_node
        checks.append(lambda n: inv.nodes[n].healthy_gpus >= gpus)

    def ok(name: str) -> bool:
        return all(check(name) for check in checks)

    cliques: list[CliqueFree] = []
    sick: list[CliqueFree] = []
    names: dict[str, list[str]] = {}
    largest = 0
    for cid in chosen_ids:
        clique = inv.cliques.get(cid)
        if clique is None:
            continue
        members = [n for n in clique.nodes if ok(n)] if checks else list(clique.nodes)
        size = len(members)
        largest = max(largest, size)
        free = [n for n in members if n in clique.free]
        sick_count = sum(1 for n in members if n in clique.sick_free)
        if free:
            free.sort(key=lambda n: inv.nodes[n].key)
            names[cid] = free
            cliques.append(CliqueFree(cid, len(free), size, clique.rank))
        if free or sick_count:
            sick.append(CliqueFree(cid, len(free) + sick_count, size, clique.rank))
    sick_index = CliqueIndex.from_cliques(sick)
    return View(CliqueIndex.from_cliques(cliques), largest, lambda c: names[c], lambda: sick_index)


def _excluding(inv: FleetIndex, excluded: frozenset[str]) -> View:
    """The whole inventory minus a few nodes: copy the index, adjust only the cliques they are in."""
    index = inv.index.copy()
    sick_index = inv.index_with_sick.copy()
    names: dict[str, list[str]] = {}
    affected = {inv.nodes[n].clique for n in excluded if n in inv.nodes and inv.nodes[n].clique}
    for cid in affected:
        clique = inv.cliques[cid]
        free = [n for n in inv.sorted_free(cid) if n not in excluded]
        sick = sum(1 for n in clique.sick_free if n not in excluded)
        size = sum(1 for n in clique.nodes if n not in excluded)
        names[cid] = free
        index.put(CliqueFree(cid, len(free), size, clique.rank))
        sick_index.put(CliqueFree(cid, len(free) + sick, size, clique.rank))

    def free_names(cid: str) -> list[str]:
        found = names.get(cid)
        return found if found is not None else inv.sorted_free(cid)

    return View(index, inv.largest_clique(), free_names, lambda: sick_index)


def _attribute_check(inv: FleetIndex, key: str, value: str) -> Callable[[str], bool]:
    def check(name: str) -> bool:
        return inv.node_attribute(name, key) == value

    return check
