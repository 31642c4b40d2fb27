"""Stateful property test of the controller core over a model of the store.

The model stores what etcd would hold (members, bindings, index claims,
prepared claims, daemon statuses with the peers they report connected, node
records). Node agents join with the same rule as
`libs.state.membership.join_domain` (binding check, lowest free index per
clique; a LOST member takes up its own index again), leave on their last
unprepare, lose their node record and get it back; daemons report their
links, which drop some time after a node goes. The controller step runs the
pure core (`plan_domain`) on every domain and applies its actions with the
store's semantics. After every step: indices are unique per clique and
inside the bound (lost members included), a member's index never changes
while it exists, a node is in at most one domain, a member is marked LOST
only when its record is gone and no live peer reports it connected, a prepared
claim is dropped only of such a node (judged before the plan and after its
earlier actions), and each domain's status is Ready exactly when the contract
says.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hypothesis import currently_in_test_context, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from libs.gen.computedomain.state import v1 as pb
from libs.state.domain_record import DomainRecord
from libs.state.membership import lowest_free_index
from services.controller.actions import (
    ActivateMember,
    DeleteDaemonStatus,
    DeleteDomain,
    DeletePreparation,
    MarkMemberLost,
    ReleaseMember,
)
from services.controller.observed import DaemonRecord, DomainObservation, MemberRecord, NodeRecord
from services.controller.plan import plan_domain
from services.controller.status_model import StatusValue

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


def event(value: str) -> None:
    """Count an event for the statistics; a no-op when a test replays steps by hand."""
    if currently_in_test_context():
        hypothesis_event(value)


@dataclass
class MemberRow:
    clique: str
    index: int
    lost: bool
    joined_ms: int
    revision: int
    # The index it was given when it joined: it must hold it for as long as it exists.
    first_index: int = -1


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
    # What each daemon status reports connected, and its mod revision.
    connected: dict[tuple[str, str], frozenset[str]] = field(default_factory=dict)
    daemon_revisions: dict[tuple[str, str], int] = field(default_factory=dict)
    present: set[str] = field(default_factory=lambda: set(NODES))
    claims_made: int = 0
    # Members peers vouched for in the observation the current plan was made from.
    vouched_at_decision: set[str] = field(default_factory=set)
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
        if row is not None:
            if row.lost:
                # Taken up again at its own index; its daemon was kept meanwhile.
                event("lost member rejoined")
                row.lost, row.revision = False, self.bump()
            return True
        clique = NODES[node]
        index = -1
        if clique:
            used = [i for (u, c, i) in self.index_claims if u == uid and c == clique]
            free = lowest_free_index(used, LIMIT)
            if free is None:
                return False  # CliqueFull
            if any(r.lost and r.clique == clique for r in self.rows(uid).values()):
                event("newcomer joined beside a lost member")
            index = free
            self.index_claims[(uid, clique, index)] = node
        self.members[(uid, node)] = MemberRow(clique, index, False, self.now_ms, self.bump(), index)
        self.bindings[node] = uid
        if clique:
            self.report(uid, node, pb.DaemonState.STARTING, frozenset())
        return True

    def report(self, uid: str, node: str, state: pb.DaemonState, connected: frozenset[str]) -> None:
        self.daemons[(uid, node)] = state
        self.connected[(uid, node)] = connected
        self.daemon_revisions[(uid, node)] = self.bump()

    def drop_daemon(self, key: tuple[str, str]) -> None:
        self.daemons.pop(key, None)
        self.connected.pop(key, None)
        self.daemon_revisions.pop(key, None)

    def leave(self, node: str, uid: str) -> None:
        row = self.members.pop((uid, node), None)
        self.drop_daemon((uid, node))
        if self.bindings.get(node) == uid:
            del self.bindings[node]
        if row is not None and row.index >= 0:
            self.index_claims.pop((uid, row.clique, row.index), None)

    def unprepare(self, node: str, claim: str) -> None:
        """The node agent unprepares a claim; on its last one of the domain it leaves."""
        uid = self.preparations.pop((node, claim))
        if not any(n == node and u == uid for (n, _), u in self.preparations.items()):
            self.leave(node, uid)

    # ---- what the controller sees and does ------------------------------------------------

    def observe(self, uid: str) -> DomainObservation:
        members = {
            n: MemberRecord(n, r.clique, r.index, r.lost, "ip", "ns", r.joined_ms, r.revision)
            for (u, n), r in self.members.items()
            if u == uid
        }
        daemons = {
            n: DaemonRecord(
                s,
                "crashed" if s == pb.DaemonState.FAILED else "",
                0,
                self.connected[(u, n)],
                self.daemon_revisions[(u, n)],
            )
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
            assert action.node not in self.vouched(uid), f"{action} while a peer reports it connected"
            # The reports the decision relied on are the current ones (no watch lag in this model).
            for peer, rev in action.peer_reports:
                assert self.daemon_revisions.get((uid, peer), 0) == rev, (action, peer)
            event("member lost")
            row.lost, row.revision = True, self.bump()
        elif isinstance(action, ActivateMember):
            row = self.members[(uid, action.node)]
            holds = any(n == action.node and u == uid for (n, _), u in self.preparations.items())
            assert row.revision == action.mod_revision
            assert row.lost and action.node in self.present and holds, f"{action} of {row}"
            event("lost member made active again by the controller")
            row.lost, row.revision = False, self.bump()
        elif isinstance(action, ReleaseMember):
            row = self.members[(uid, action.node)]
            assert row.revision == action.mod_revision
            holds = any(n == action.node and u == uid for (n, _), u in self.preparations.items())
            assert uid not in self.domains or (row.lost and not holds), f"{action} of a member still in use"
            self.leave(action.node, uid)
        elif isinstance(action, DeletePreparation):
            assert action.node not in self.present, f"{action} of a live node"
            # Neither in the observation the plan was made from nor after the plan's earlier
            # actions (which may make a peer ACTIVE again whose report lists this node).
            assert action.node not in self.vouched_at_decision, f"{action} of a node its peers still reach"
            assert action.node not in self.vouched(uid), f"{action} of a node a revived peer reaches"
            assert self.domains[uid].deleting
            del self.preparations[(action.node, action.claim_uid)]
        elif isinstance(action, DeleteDaemonStatus):
            assert (uid, action.node) not in self.members
            self.drop_daemon((uid, action.node))
        elif isinstance(action, DeleteDomain):
            assert not any(u == uid for u, _ in self.members)
            assert not any(u == uid for u in self.preparations.values())
            del self.domains[uid]
            self.statuses.pop(uid, None)
            for daemon_key in [k for k in self.daemons if k[0] == uid]:
                self.drop_daemon(daemon_key)
            for claim_key in [k for k in self.index_claims if k[0] == uid]:
                del self.index_claims[claim_key]
        else:
            raise AssertionError(f"unexpected action {action!r}")

    def all_uids(self) -> set[str]:
        return set(self.domains) | {u for u, _ in self.members} | {u for u, _ in self.daemons}

    def rows(self, uid: str) -> dict[str, MemberRow]:
        return {n: r for (u, n), r in self.members.items() if u == uid}

    def vouched(self, uid: str) -> set[str]:
        """Members some live peer (active, record present, same clique) reports connected."""
        rows = self.rows(uid)
        out: set[str] = set()
        for reporter, r in rows.items():
            if r.lost or not r.clique or reporter not in self.present:
                continue
            for name in self.connected.get((uid, reporter), frozenset()):
                if name != reporter and name in rows and rows[name].clique == r.clique:
                    out.add(name)
        return out

    def lost(self, uid: str) -> set[str]:
        vouched = self.vouched(uid)
        return {
            n for n, r in self.rows(uid).items() if r.lost or (n not in self.present and n not in vouched)
        }


def spec_ready(model: Model, uid: str) -> bool:
    """The contract's readiness, stated on the model directly."""
    d = model.domains[uid]
    if d.deleting:
        return False
    rows = model.rows(uid)
    if not rows or model.lost(uid):
        return False
    if d.spec.num_nodes > 0 and len(rows) < d.spec.num_nodes:
        return False
    for n, r in rows.items():
        if not r.clique:
            if n not in model.present:
                return False
            continue
        if model.daemons.get((uid, n)) != pb.DaemonState.READY:
            return False
        mesh = {p for p, q in rows.items() if p != n and q.clique == r.clique and q.index >= 0}
        if not mesh <= model.connected[(uid, n)]:
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
                self.m.unprepare(node, claim)
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
                mesh_mode=pb.MeshMode.PLAINTEXT,
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
        self.m.unprepare(*data.draw(st.sampled_from(live)))

    @precondition(lambda self: bool(self.m.bindings))
    @rule(data=st.data(), links_drop=st.booleans())
    def lose_member_node(self, data: st.DataObject, links_drop: bool) -> None:
        """A member's node record goes (the node died, or only its IMEX side).

        Its peers' links may drop at once (the node died) or stay up (only the IMEX side did).
        """
        self.lose_node(data.draw(st.sampled_from(sorted(self.m.bindings))), links_drop)

    def lose_node(self, node: str, links_drop: bool) -> None:
        self.m.present.discard(node)
        if links_drop:
            self.links_to_node_drop(node)
        self.controller_step(advance_past_grace=False)

    @rule(node=st.sampled_from(sorted(NODES)))
    def links_to_node_drop(self, node: str) -> None:
        """Every live daemon notices that it lost its link to `node` and reports so."""
        for key, conn in list(self.m.connected.items()):
            if node in conn and key[1] in self.m.present:
                self.m.report(key[0], key[1], self.m.daemons[key], conn - {node})

    @precondition(lambda self: len(self.m.present) < len(NODES))
    @rule(data=st.data(), agent_rejoins=st.booleans())
    def node_returns(self, data: st.DataObject, agent_rejoins: bool) -> None:
        """The node record is back; the kubelet plugin may rejoin first, or leave it to the controller."""
        self.node_back(data.draw(st.sampled_from(sorted(set(NODES) - self.m.present))), agent_rejoins)

    def node_back(self, node: str, agent_rejoins: bool) -> None:
        self.m.present.add(node)
        if not agent_rejoins:
            return
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
            if any(n not in self.m.present for n in self.m.vouched(uid)):
                event("node record gone, a peer still connected")
            if any(self.m.members[(uid, n)].lost for n in self.m.vouched(uid) - self.m.present):
                event("LOST member reported connected again")
            obs = self.m.observe(uid)
            self.m.vouched_at_decision = self.m.vouched(uid)
            plan = plan_domain(obs, self.m.now_ms, GRACE_MS)
            if uid in self.m.domains and not any(isinstance(a, DeleteDomain) for a in plan.actions):
                status = plan.status if plan.status is not None else self.m.statuses.get(uid, StatusValue())
                ready = status.ready
                event(f"domain ready={ready}")
                assert ready == spec_ready(self.m, uid), (uid, status.conditions, self.m.members)
                self.m.statuses[uid] = status
            for action in plan.actions:
                self.m.apply(uid, action)

    @rule(node=st.sampled_from(sorted(NODES)), ready=st.booleans(), data=st.data())
    def daemon_reports(self, node: str, ready: bool, data: st.DataObject) -> None:
        """A daemon reports its state and links: up to every member of its clique it can reach."""
        uid = self.m.bindings.get(node)
        row = self.m.members.get((uid, node)) if uid else None
        if uid and row and not row.lost and row.clique and node in self.m.present:
            reachable = sorted(self.reachable(uid, node))
            connected = (
                frozenset(data.draw(st.sets(st.sampled_from(reachable)))) if reachable else frozenset()
            )
            state = pb.DaemonState.READY if ready else pb.DaemonState.FAILED
            self.m.report(uid, node, state, connected)

    def reachable(self, uid: str, node: str) -> set[str]:
        """Members of `node`'s clique its daemon could be connected to (their record is up)."""
        rows = self.m.rows(uid)
        clique = rows[node].clique
        return {
            n
            for n, r in rows.items()
            if n != node and r.clique == clique and n in self.m.present and not r.lost
        }

    @rule(uid=st.sampled_from(DOMAINS))
    def mesh_forms(self, uid: str) -> None:
        """Every live daemon of the domain is READY and connected to every reachable peer."""
        for node, row in sorted(self.m.rows(uid).items()):
            if row.clique and not row.lost and node in self.m.present:
                self.m.report(uid, node, pb.DaemonState.READY, frozenset(self.reachable(uid, node)))
        self.controller_step(advance_past_grace=False)

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
        if all_ready:
            self.mesh_forms(uid)
        else:
            self.controller_step(advance_past_grace=False)

    @invariant()
    def index_never_changes_while_the_member_exists(self) -> None:
        for key, row in self.m.members.items():
            assert row.index == row.first_index, f"{key} moved from index {row.first_index} to {row.index}"

    @invariant()
    def indices_unique_per_clique_and_bounded(self) -> None:
        """Lost members included: a replacement never gets a lost member's index."""
        seen: set[tuple[str, str, int]] = set()
        for (uid, node), row in self.m.members.items():
            if not row.clique:
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


# A longer hunt: CORE_MODEL_MAX_EXAMPLES=2000 (the default keeps the suite quick).
ControllerCoreMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("CORE_MODEL_MAX_EXAMPLES", "200")), stateful_step_count=40, deadline=None
)
TestControllerCore = ControllerCoreMachine.TestCase


def test_member_marked_lost_while_its_only_peer_was_lost_keeps_its_claims() -> None:
    """Found by the machine: a LOST mark is not the teardown's licence to drop claims.

    a0 dies (links drop) and is marked LOST; its record comes back, its last report still lists
    a1. a1's IMEX side stops (links stay up): a0 does not count yet, so a1 is marked LOST in the
    plan that makes a0 ACTIVE again. Then a0 reports a1 connected: a1 may run the job, and
    deleting the domain must not drop a1's prepared claim (it did, on the strength of the mark).
    """
    machine = ControllerCoreMachine()
    machine.start_with_two_domains([0, 0])
    machine.job_starts(uid="d1", count=2, all_ready=True)
    machine.lose_node("a0", links_drop=True)
    machine.node_back("a0", agent_rejoins=False)
    machine.lose_node("a1", links_drop=False)
    machine.controller_step(advance_past_grace=False)
    assert machine.m.members[("d1", "a1")].lost and not machine.m.members[("d1", "a0")].lost
    machine.delete_domain("d1")
    machine.controller_step(advance_past_grace=False)
    assert ("a1", "claim2") in machine.m.preparations  # a0 still reaches a1
    # a0's link to a1 drops: now a1 is gone and the teardown finishes without anyone's help.
    machine.links_to_node_drop("a1")
    machine.m.unprepare("a0", "claim1")
    for _ in range(3):
        machine.controller_step(advance_past_grace=False)
    assert "d1" not in machine.m.domains and not machine.m.preparations


def test_no_claim_dropped_in_the_plan_that_revives_the_peer_reaching_it() -> None:
    """As above with the domain deleted first: one plan marks a1 LOST and makes a0 ACTIVE again.

    a0's report does not count in that plan's observation, but it does right after; the claims
    of a1 wait for the next observation, in which a0 vouches for a1.
    """
    machine = ControllerCoreMachine()
    machine.start_with_two_domains([0, 0])
    machine.job_starts(uid="d1", count=2, all_ready=True)
    machine.lose_node("a0", links_drop=True)
    machine.node_back("a0", agent_rejoins=False)
    machine.delete_domain("d1")
    machine.lose_node("a1", links_drop=False)  # runs the controller step
    machine.controller_step(advance_past_grace=False)
    assert ("a1", "claim2") in machine.m.preparations
