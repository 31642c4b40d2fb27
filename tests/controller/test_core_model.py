"""Stateful property test of the controller core over a model of the store.

The model stores what etcd would hold (members, bindings, index claims,
prepared claims, daemon statuses, node records). Node agents join with the
same rule as `libs.state.membership.join_domain` (binding check, lowest free
index per clique), leave on their last unprepare, die and come back; the
controller step runs the pure core (`plan_domain`) on every domain and
applies its actions with the store's semantics. After every step: indices are
unique per clique and inside the bound, a node is in at most one domain, and
each domain's status is Ready exactly when SPEC §5 says.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from libs.gen.computedomain.state import v1 as pb
from libs.state.membership import lowest_free_index
from services.controller.actions import (
    DeleteDaemonStatus,
    DeleteDomain,
    DeletePreparation,
    MarkMemberLost,
    ReleaseMember,
)
from services.controller.domainrecord import DomainRecord
from services.controller.observed import DaemonRecord, DomainObservation, MemberRecord, NodeRecord
from services.controller.plan import plan_domain
from services.controller.statusmodel import StatusValue

LIMIT = 3  # max members per clique in one domain; small so that "clique full" happens
GRACE_MS = 1_000
# Eight nodes: three cliques of fabric nodes and two non-fabric ones.
NODES = {
    "a0": "A.1",
    "a1": "A.1",
    "a2": "A.1",
    "a3": "A.1",
    "b0": "B.1",
    "b1": "B.1",
    "c0": "",
    "c1": "",
}
DOMAINS = ["d0", "d1", "d2"]


@dataclass
class MemberRow:
    clique: str
    index: int
    lost: bool
    joined_ms: int
    revision: int


@dataclass
class Model:
    now_ms: int = 1
    revision: int = 1
    domains: dict[str, DomainRecord] = field(default_factory=dict)
    members: dict[tuple[str, str], MemberRow] = field(default_factory=dict)
    bindings: dict[str, str] = field(default_factory=dict)
    index_claims: dict[tuple[str, str, int], str] = field(default_factory=dict)
    # (node, claim uid) -> domain uid
    preparations: dict[tuple[str, str], str] = field(default_factory=dict)
    daemons: dict[tuple[str, str], pb.DaemonState] = field(default_factory=dict)
    present: set[str] = field(default_factory=lambda: set(NODES))
    claims_made: int = 0
    statuses: dict[str, StatusValue] = field(default_factory=dict)

    def bump(self) -> int:
        self.revision += 1
        return self.revision

    # ---- what the node agent does (membership.join_domain / leave_domain semantics) ----

    def join(self, node: str, uid: str) -> bool:
        bound = self.bindings.get(node)
        if bound is not None and bound != uid:
            return False  # NodeBusy
        row = self.members.get((uid, node))
        if row is not None and not row.lost:
            return True
        clique = NODES[node]
        index = -1
        if clique:
            used = [i for (u, c, i) in self.index_claims if u == uid and c == clique]
            free = lowest_free_index(used, LIMIT)
            if free is None:
                return False  # CliqueFull
            index = free
            self.index_claims[(uid, clique, index)] = node
        self.members[(uid, node)] = MemberRow(clique, index, False, self.now_ms, self.bump())
        self.bindings[node] = uid
        if clique:
            self.daemons[(uid, node)] = pb.DaemonState.STARTING
        return True

    def leave(self, node: str, uid: str) -> None:
        row = self.members.pop((uid, node), None)
        self.daemons.pop((uid, node), None)
        if self.bindings.get(node) == uid:
            del self.bindings[node]
        if row is not None and row.index >= 0:
            self.index_claims.pop((uid, row.clique, row.index), None)

    # ---- what the controller sees and does ------------------------------------------------

    def observe(self, uid: str) -> DomainObservation:
        members = {
            n: MemberRecord(n, r.clique, r.index, r.lost, "ip", "ns", r.joined_ms, r.revision)
            for (u, n), r in self.members.items()
            if u == uid
        }
        daemons = {
            n: DaemonRecord(s, "crashed" if s == pb.DaemonState.FAILED else "", 0)
            for (u, n), s in self.daemons.items()
            if u == uid
        }
        preps: dict[str, set[str]] = {}
        for (n, c), u in self.preparations.items():
            if u == uid:
                preps.setdefault(n, set()).add(c)
        nodes = {n: NodeRecord("ip", NODES[n], pb.Health.HEALTHY) for n in NODES if n in self.present}
        d = self.domains.get(uid)
        return DomainObservation(
            uid=uid,
            domain=d,
            domain_revision=d.created_unix_ms if d else 0,
            status=self.statuses.get(uid, StatusValue()),
            members=members,
            daemons=daemons,
            nodes=nodes,
            preparations={n: frozenset(c) for n, c in preps.items()},
        )

    def apply(self, uid: str, action: object) -> None:
        # The store's compares would refuse an unsafe action; the core must not even ask for one
        # (this model has no watch lag to excuse it).
        if isinstance(action, MarkMemberLost):
            row = self.members[(uid, action.node)]
            assert not row.lost and action.node not in self.present, f"{action} of a live member"
            if row.index >= 0:
                del self.index_claims[(uid, row.clique, row.index)]
            row.lost, row.index, row.revision = True, -1, self.bump()
        elif isinstance(action, ReleaseMember):
            row = self.members[(uid, action.node)]
            assert row.revision == action.mod_revision
            holds = any(n == action.node and u == uid for (n, _), u in self.preparations.items())
            assert uid not in self.domains or (row.lost and not holds), f"{action} of a member still in use"
            self.leave(action.node, uid)
        elif isinstance(action, DeletePreparation):
            assert action.node not in self.present, f"{action} of a live node"
            assert self.domains[uid].deleting
            del self.preparations[(action.node, action.claim_uid)]
        elif isinstance(action, DeleteDaemonStatus):
            assert (uid, action.node) not in self.members
            del self.daemons[(uid, action.node)]
        elif isinstance(action, DeleteDomain):
            assert not any(u == uid for u, _ in self.members)
            assert not any(u == uid for u in self.preparations.values())
            del self.domains[uid]
            self.statuses.pop(uid, None)
            for daemon_key in [k for k in self.daemons if k[0] == uid]:
                del self.daemons[daemon_key]
            for claim_key in [k for k in self.index_claims if k[0] == uid]:
                del self.index_claims[claim_key]
        else:
            raise AssertionError(f"unexpected action {action!r}")

    def all_uids(self) -> set[str]:
        return set(self.domains) | {u for u, _ in self.members} | {u for u, _ in self.daemons}


def spec_ready(model: Model, uid: str) -> bool:
    """SPEC §5, stated on the model directly."""
    d = model.domains[uid]
    if d.deleting:
        return False
    rows = {n: r for (u, n), r in model.members.items() if u == uid}
    if not rows:
        return False
    if any(r.lost or n not in model.present for n, r in rows.items()):
        return False
    if d.spec.num_nodes > 0 and len(rows) < d.spec.num_nodes:
        return False
    for n, r in rows.items():
        if r.clique and model.daemons.get((uid, n)) != pb.DaemonState.READY:
            return False
    return True


class ControllerCoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = Model()

    @initialize(num_nodes=st.lists(st.integers(0, 4), min_size=2, max_size=2))
    def start_with_two_domains(self, num_nodes: list[int]) -> None:
        for uid, n in zip(DOMAINS, num_nodes, strict=False):
            self.create_domain(uid, n)

    @precondition(lambda self: len(self.m.members) >= 3)
    @rule()
    def drain_everything(self) -> None:
        """Delete every domain, unprepare what live nodes hold: teardown must leave nothing."""
        for d in self.m.domains.values():
            d.deleting = True
        for node, claim in sorted(self.m.preparations):
            if node in self.m.present:
                uid = self.m.preparations.pop((node, claim))
                if not any(n == node and u == uid for (n, _), u in self.m.preparations.items()):
                    self.m.leave(node, uid)
        for _ in range(6):
            self.controller_step(advance_past_grace=True)
        assert not self.m.domains and not self.m.members and not self.m.bindings
        assert not self.m.index_claims and not self.m.daemons and not self.m.preparations

    @rule(uid=st.sampled_from(DOMAINS), num_nodes=st.integers(0, 4))
    def create_domain(self, uid: str, num_nodes: int) -> None:
        if uid not in self.m.domains and uid not in self.m.all_uids():
            self.m.domains[uid] = DomainRecord(
                uid=uid,
                namespace="ns",
                name=uid,
                spec=pb.ComputeDomainSpec(num_nodes=num_nodes),
                created_unix_ms=self.m.bump(),
            )

    @rule(node=st.sampled_from(sorted(NODES)), uid=st.sampled_from(DOMAINS))
    def stale_join(self, node: str, uid: str) -> None:
        # A join that raced the domain's teardown (the agent read the domain before it went).
        if node in self.m.present and uid not in self.m.domains:
            self.m.join(node, uid)

    @rule(data=st.data())
    def unprepare(self, data: st.DataObject) -> None:
        live = sorted(k for k in self.m.preparations if k[0] in self.m.present)
        if not live:
            return
        node, claim = data.draw(st.sampled_from(live))
        uid = self.m.preparations.pop((node, claim))
        if not any(n == node and u == uid for (n, _), u in self.m.preparations.items()):
            self.m.leave(node, uid)

    @rule(node=st.sampled_from(sorted(NODES)))
    def lose_node(self, node: str) -> None:
        self.m.present.discard(node)

    @rule(node=st.sampled_from(sorted(NODES)))
    def restart_node(self, node: str) -> None:
        if node in self.m.present:
            return
        self.m.present.add(node)
        # The agent reconciles from its checkpoint: rejoin the domain it still holds claims of.
        held = {u for (n, _), u in self.m.preparations.items() if n == node}
        for uid in sorted(held):
            d = self.m.domains.get(uid)
            if d is not None and not d.deleting:
                self.m.join(node, uid)

    @rule(uid=st.sampled_from(DOMAINS))
    def delete_domain(self, uid: str) -> None:
        d = self.m.domains.get(uid)
        if d is not None:
            d.deleting = True

    # Hypothesis favours the rules defined last: the ones that make domains form.
    @rule(advance_past_grace=st.booleans())
    def controller_step(self, advance_past_grace: bool) -> None:
        self.m.now_ms += GRACE_MS + 1 if advance_past_grace else 1
        for uid in sorted(self.m.all_uids()):
            obs = self.m.observe(uid)
            plan = plan_domain(obs, self.m.now_ms, GRACE_MS)
            if uid in self.m.domains and not any(isinstance(a, DeleteDomain) for a in plan.actions):
                status = plan.status if plan.status is not None else self.m.statuses.get(uid, StatusValue())
                ready = status.ready
                event(f"domain ready={ready}")
                assert ready == spec_ready(self.m, uid), (uid, status.conditions, self.m.members)
                self.m.statuses[uid] = status
            for action in plan.actions:
                self.m.apply(uid, action)

    @rule(node=st.sampled_from(sorted(NODES)), ready=st.booleans())
    def daemon_reports(self, node: str, ready: bool) -> None:
        uid = self.m.bindings.get(node)
        row = self.m.members.get((uid, node)) if uid else None
        if uid and row and not row.lost and row.clique and node in self.m.present:
            self.m.daemons[(uid, node)] = pb.DaemonState.READY if ready else pb.DaemonState.FAILED

    @rule(node=st.sampled_from(sorted(NODES)), uid=st.sampled_from(DOMAINS))
    def prepare(self, node: str, uid: str) -> None:
        d = self.m.domains.get(uid)
        if node not in self.m.present or d is None or d.deleting:
            return
        if self.m.join(node, uid):
            self.m.claims_made += 1
            self.m.preparations[(node, f"claim{self.m.claims_made}")] = uid

    @rule(uid=st.sampled_from(DOMAINS), count=st.integers(1, 4), all_ready=st.booleans())
    def job_starts(self, uid: str, count: int, all_ready: bool) -> None:
        """Pods of a job land on free nodes: each prepares a claim; their daemons come up."""
        free = [n for n in sorted(NODES) if n in self.m.present and n not in self.m.bindings]
        for node in free[:count]:
            self.prepare(node, uid)
            if all_ready and (uid, node) in self.m.daemons:
                self.m.daemons[(uid, node)] = pb.DaemonState.READY
        self.controller_step(advance_past_grace=False)

    @invariant()
    def indices_unique_per_clique_and_bounded(self) -> None:
        seen: set[tuple[str, str, int]] = set()
        for (uid, node), row in self.m.members.items():
            if row.lost or not row.clique:
                assert row.index == -1
                continue
            assert 0 <= row.index < LIMIT
            key = (uid, row.clique, row.index)
            assert key not in seen, f"index {key} given twice"
            seen.add(key)
            assert self.m.index_claims.get(key) == node
        assert set(self.m.index_claims) == seen

    @invariant()
    def prepared_claims_belong_to_a_domain_listing_their_node(self) -> None:
        for (node, _claim), uid in self.m.preparations.items():
            assert (uid, node) in self.m.members and uid in self.m.domains

    @invariant()
    def node_in_at_most_one_domain(self) -> None:
        for uid, node in self.m.members:
            assert self.m.bindings.get(node) == uid
        per_node: dict[str, set[str]] = {}
        for uid, node in self.m.members:
            per_node.setdefault(node, set()).add(uid)
        assert all(len(u) == 1 for u in per_node.values())


ControllerCoreMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestControllerCore = ControllerCoreMachine.TestCase
