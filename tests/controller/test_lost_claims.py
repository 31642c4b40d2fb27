"""Which prepared claims of lost nodes the controller may check and drop (pure decisions)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from libs.gen.computedomain.state import v1 as pb
from libs.state.domain_record import DomainRecord
from services.controller.kube.lost_claims import allocated_nodes, claim_gone
from services.controller.membership_decisions import lost_holdings
from services.controller.observed import DaemonRecord, DomainObservation, MemberRecord, NodeRecord


def member(node: str, index: int, lost: bool = False) -> MemberRecord:
    return MemberRecord(node, "c.1", index, lost, "127.0.0.9", "ns", 0, 40 + index)


def obs(**kw: Any) -> DomainObservation:
    domain = DomainRecord(uid="d1", namespace="ns", name="cd")
    return DomainObservation(uid="d1", domain=domain, domain_revision=7, **kw)


def node() -> NodeRecord:
    return NodeRecord("127.0.0.9", "c.1", pb.Health.HEALTHY)


def claim(uid: str = "u1", nodes: list[str] | None = None, allocated: bool = True) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if allocated:
        terms = [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": nodes or ["n1"]}]}]
        status["allocation"] = {"nodeSelector": {"nodeSelectorTerms": terms}}
    return {"metadata": {"uid": uid, "name": "c", "namespace": "ns"}, "status": status}


def test_only_the_claims_of_lost_members_that_are_gone_are_candidates() -> None:
    o = obs(
        members={"n1": member("n1", 0, lost=True), "n2": member("n2", 1), "n3": member("n3", 2, lost=True)},
        nodes={"n2": node(), "n3": node()},
        preparations={"n1": frozenset({"b", "a"}), "n2": frozenset({"c"}), "n3": frozenset({"d"})},
    )
    # n2 is live (its plugin owns its records); n3 is LOST but its record is back.
    assert lost_holdings(o) == [("n1", "a"), ("n1", "b")]


def test_a_lost_member_a_live_peer_still_reaches_keeps_its_claims() -> None:
    daemon = DaemonRecord(pb.DaemonState.READY, "", 0, frozenset({"n1", "n2"}))
    o = obs(
        members={"n1": member("n1", 0, lost=True), "n2": member("n2", 1)},
        nodes={"n2": node()},
        daemons={"n2": daemon},
        preparations={"n1": frozenset({"a"})},
    )
    assert lost_holdings(o) == []


def test_an_active_member_without_its_node_record_is_not_a_candidate_until_marked_lost() -> None:
    o = obs(members={"n1": member("n1", 0)}, preparations={"n1": frozenset({"a"})})
    assert lost_holdings(o) == []


def test_a_claim_is_gone_when_deleted_replaced_or_no_longer_allocated_to_the_node() -> None:
    assert claim_gone("u1", "n1", None) == "claim deleted"
    assert claim_gone("u1", "n1", claim(uid="u2")) == "claim replaced (another uid under its name)"
    assert claim_gone("u1", "n1", claim(allocated=False)) == "claim no longer allocated"
    assert claim_gone("u1", "n1", claim(nodes=["n7"])) == "claim allocated to another node"


def test_a_claim_still_allocated_to_the_node_is_kept() -> None:
    assert claim_gone("u1", "n1", claim()) is None
    assert claim_gone("u1", "n1", claim(nodes=["n7", "n1"])) is None
    # An allocation that does not name nodes by name cannot tell: kept.
    by_label = claim()
    by_label["status"]["allocation"] = {"nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": []}]}}
    assert allocated_nodes(by_label) is None
    assert claim_gone("u1", "n1", by_label) is None


@given(
    members=st.dictionaries(
        st.sampled_from(["n1", "n2", "n3", "n4"]), st.tuples(st.booleans(), st.booleans()), max_size=4
    ),
    claims=st.dictionaries(
        st.sampled_from(["n1", "n2", "n3", "n4", "n5"]),
        st.frozensets(st.sampled_from(["a", "b", "c"]), min_size=1),
    ),
)
def test_candidates_are_only_ever_claims_of_lost_members_whose_node_record_is_absent(
    members: dict[str, tuple[bool, bool]], claims: dict[str, frozenset[str]]
) -> None:
    o = obs(
        members={n: member(n, i, lost=lost) for i, (n, (lost, _)) in enumerate(sorted(members.items()))},
        nodes={n: node() for n, (_, present) in members.items() if present},
        preparations=claims,
    )
    held = lost_holdings(o)
    for name, uid in held:
        assert o.members[name].lost and not o.node_present(name) and uid in claims[name]
    expected = {
        (n, c) for n, (lost, present) in members.items() if lost and not present for c in claims.get(n, ())
    }
    assert set(held) == expected
