"""The fleet index on its own (no store, no event loop): a hypothesis state machine applies node
records, bindings, reservations (also stale ones), holds and hints in any order, and after every
step the index must agree with the same facts recomputed from scratch: which nodes are free, the
per-clique indexes, the fragmentation sums, the largest free block and what a decision would leave.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from libs.gen.computedomain.state import v1 as pb
from services.advisor.clique_index import CliqueFree, CliqueIndex
from services.advisor.fleet_index import FleetIndex
from services.advisor.model import natural_key
from services.advisor.policies import fragmentation_of
from tests.advisor.fleet import node_record

NODES = [f"rack{r}-tray{t}" for r in range(3) for t in range(1, 5)]
CLIQUES = ["c0", "c1", ""]
DOMAINS = ["d1", "d2"]
RESERVATION_IDS = ["r1", "r2", "r3"]

# What a node record can say: (clique, node health, one GPU's fabric state).
RECORDS = st.tuples(
    st.sampled_from(CLIQUES),
    st.sampled_from([pb.Health.HEALTHY] * 3 + [pb.Health.DEGRADED, pb.Health.UNHEALTHY]),
    st.sampled_from([pb.FabricState.COMPLETED] * 3 + [pb.FabricState.IN_PROGRESS]),
)


@dataclass
class Facts:
    """What the index was told, kept as plainly as possible."""

    records: dict[str, tuple[str, bool]] = field(default_factory=dict)  # name -> (clique, usable)
    bound: dict[str, str] = field(default_factory=dict)
    reservations: dict[str, tuple[list[str], str]] = field(default_factory=dict)
    holds: dict[str, int] = field(default_factory=dict)  # node -> token of its latest hold
    hints: dict[str, float] = field(default_factory=dict)  # node -> expiry

    def reserved(self) -> set[str]:
        return {n for nodes, _ in self.reservations.values() for n in nodes}

    def free(self, sick: bool = False) -> dict[str, set[str]]:
        """Per clique its untaken usable nodes (`sick`: its untaken unusable ones)."""
        taken = set(self.bound) | self.reserved() | set(self.holds) | set(self.hints)
        out: dict[str, set[str]] = {}
        for name, (clique, usable) in self.records.items():
            if clique:
                out.setdefault(clique, set())
                if usable != sick and name not in taken:
                    out[clique].add(name)
        return out

    def members(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for name, (clique, _) in self.records.items():
            if clique:
                out.setdefault(clique, set()).add(name)
        return out


class FleetIndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.index = FleetIndex(clock=lambda: self.now)
        self.facts = Facts()
        self.revision = 0
        self.tokens: list[int] = []
        self.generation = 0

    def _next_revision(self) -> int:
        self.revision += 1
        return self.revision

    @rule(name=st.sampled_from(NODES), record=RECORDS)
    def node_record_written(self, name: str, record: tuple[str, pb.Health, pb.FabricState]) -> None:
        clique, health, fabric = record
        node = node_record(name, clique, "cluster-a", health=health)
        node.gpus[0].fabric_state = fabric
        self.index.apply_node(name, node)
        usable = bool(clique) and health == pb.Health.HEALTHY and fabric == pb.FabricState.COMPLETED
        self.facts.records[name] = (clique, usable)

    @rule(name=st.sampled_from(NODES))
    def node_record_lapsed(self, name: str) -> None:
        self.index.apply_node(name, None)
        self.facts.records.pop(name, None)

    @rule(name=st.sampled_from(NODES), domain=st.one_of(st.none(), st.sampled_from(DOMAINS)))
    def binding_changed(self, name: str, domain: str | None) -> None:
        self.index.apply_binding(name, domain)
        if self.facts.bound.get(name) == domain:
            return  # no change: the index does nothing (a hint stays)
        if domain is None:
            self.facts.bound.pop(name, None)
        else:
            self.facts.bound[name] = domain
            self.facts.hints.pop(name, None)

    @rule(
        rid=st.sampled_from(RESERVATION_IDS),
        nodes=st.lists(st.sampled_from(NODES), min_size=1, max_size=4, unique=True),
        domain=st.sampled_from(DOMAINS),
    )
    def reservation_written(self, rid: str, nodes: list[str], domain: str) -> None:
        others = {n for r, (held, _) in self.facts.reservations.items() if r != rid for n in held}
        if others & set(nodes):
            return  # the store lets one reservation at a time hold a node (reservations.py)
        record = pb.Reservation(id=rid, node_names=nodes, domain_uid=domain)
        self.index.apply_reservation(rid, record, self._next_revision())
        self.facts.reservations[rid] = (nodes, domain)
        for name in nodes:
            self.facts.hints.pop(name, None)

    @rule(rid=st.sampled_from(RESERVATION_IDS))
    def reservation_removed(self, rid: str) -> None:
        self.index.apply_reservation(rid, None, self._next_revision())
        self.facts.reservations.pop(rid, None)

    @precondition(lambda self: self.revision > 1)
    @rule(
        rid=st.sampled_from(RESERVATION_IDS),
        nodes=st.lists(st.sampled_from(NODES), min_size=1, max_size=4, unique=True),
        present=st.booleans(),
    )
    def stale_reservation_news_is_ignored(self, rid: str, nodes: list[str], present: bool) -> None:
        """A watch event older than what the index holds about the id changes nothing."""
        known = self.index.reservation_revision(rid)
        if known < 2:
            return
        before = (dict(self.index.reserved_by), {c: set(e.free) for c, e in self.index.cliques.items()})
        record = pb.Reservation(id=rid, node_names=nodes, domain_uid="stale") if present else None
        self.index.apply_reservation(rid, record, known - 1)
        after = (dict(self.index.reserved_by), {c: set(e.free) for c, e in self.index.cliques.items()})
        assert after == before

    @rule(nodes=st.lists(st.sampled_from(NODES), min_size=1, max_size=4, unique=True))
    def hold_taken(self, nodes: list[str]) -> None:
        token = self.index.hold(nodes)
        self.tokens.append(token)
        for name in nodes:
            self.facts.holds[name] = token

    @precondition(lambda self: bool(self.tokens))
    @rule(pick=st.integers(0, 100))
    def hold_released(self, pick: int) -> None:
        token = self.tokens.pop(pick % len(self.tokens))
        self.index.release_hold(token)
        for name in [n for n, t in self.facts.holds.items() if t == token]:
            del self.facts.holds[name]

    @rule(
        nodes=st.lists(st.sampled_from(NODES), min_size=1, max_size=3, unique=True), seconds=st.integers(1, 5)
    )
    def hinted_taken(self, nodes: list[str], seconds: int) -> None:
        self.index.hint_taken(nodes, float(seconds))
        for name in nodes:
            self.facts.hints[name] = self.now + seconds

    @rule(seconds=st.integers(0, 4))
    def time_passes_and_hints_expire(self, seconds: int) -> None:
        self.now += seconds
        self.index.expire_hints()
        for name in [n for n, expiry in self.facts.hints.items() if expiry <= self.now]:
            del self.facts.hints[name]

    @rule()
    def everything_relisted(self) -> None:
        """A watch resync with what the index already holds changes nothing it offers."""
        records = [(name, self.index.nodes[name].record) for name in list(self.index.nodes)]
        self.index.resync_nodes(records)
        self.index.resync_bindings(list(self.facts.bound.items()))

    @invariant()
    def free_nodes_are_exactly_the_usable_untaken_ones(self) -> None:
        want = self.facts.free()
        got = {c: set(e.free) for c, e in self.index.cliques.items()}
        assert got == want
        for name in NODES:
            clique = self.facts.records.get(name, ("", False))[0]
            assert self.index.is_free(name) == (name in want.get(clique, set()))
        for clique, free in want.items():
            assert self.index.sorted_free(clique) == sorted(free, key=natural_key)

    @invariant()
    def tallies_match_a_fresh_count(self) -> None:
        free, members = self.facts.free(), self.facts.members()
        fresh = CliqueIndex.from_cliques(
            CliqueFree(c, len(f), len(members[c]), min(natural_key(n) for n in members[c]))
            for c, f in free.items()
            if f
        )
        assert self.index.index.entries == fresh.entries
        sick = self.facts.free(sick=True)
        with_sick = CliqueIndex.from_cliques(
            CliqueFree(c, len(f) + len(sick[c]), len(members[c]), min(natural_key(n) for n in members[c]))
            for c, f in free.items()
            if f or sick[c]
        )
        assert self.index.index_with_sick.entries == with_sick.entries
        tally = self.index.tally
        assert tally.free_count == sum(len(f) for f in free.values())
        assert tally.largest_free_block() == max((len(f) for f in free.values()), default=0)
        pairs = [(len(f), len(members[c])) for c, f in free.items()]
        assert math.isclose(tally.fragmentation(), fragmentation_of(pairs), abs_tol=1e-9)
        assert self.index.largest_clique() == max((len(m) for m in members.values()), default=0)

    @invariant()
    def a_decision_is_scored_as_if_recounted(self) -> None:
        """`after_taking` predicts the fragmentation and largest block of taking nodes from cliques."""
        free, members = self.facts.free(), self.facts.members()
        taken = {c: (len(f) + 1) // 2 for c, f in free.items() if f}
        pairs = [(len(f) - taken.get(c, 0), len(members[c])) for c, f in free.items()]
        frag, block = self.index.tally.after_taking(self.index.cliques, taken)
        assert math.isclose(frag, fragmentation_of(pairs), abs_tol=1e-9)
        assert block == max((n for n, _ in pairs), default=0)

    @invariant()
    def domains_hold_their_bound_and_reserved_nodes(self) -> None:
        for domain in DOMAINS:
            want = {n for n, d in self.facts.bound.items() if d == domain}
            want |= {n for nodes, d in self.facts.reservations.values() if d == domain for n in nodes}
            assert self.index.domain_nodes(domain) == want

    @invariant()
    def every_change_moves_the_generation(self) -> None:
        assert self.index.generation >= self.generation
        self.generation = self.index.generation


FleetIndexMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("FLEET_INDEX_MAX_EXAMPLES", "40")), stateful_step_count=30, deadline=None
)
TestFleetIndex = FleetIndexMachine.TestCase


def test_listeners_hear_every_change_and_nothing_else() -> None:
    index = FleetIndex()
    heard: list[int] = []
    index.listeners.append(lambda: heard.append(index.generation))
    index.apply_node("rack0-tray1", node_record("rack0-tray1", "c0", "cluster-a"))
    index.apply_binding("rack0-tray1", "d1")
    index.apply_binding("rack0-tray1", "d1")  # no change: no news
    index.apply_node("rack9-tray9", None)  # unknown node gone: no news
    assert heard == [1, 2]
