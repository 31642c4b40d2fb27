"""What a node's daemon should be, from its binding and its clique's members (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from libs.gen.computedomain.state import v1 as pb
from libs.imex import slots
from services.imexagent.slot_map import (
    Identity,
    connected_nodes,
    membership_of,
    recently_connected,
    slot_holders,
)

UID = "d0"
CLIQUE = "cluster-a.1"
ACTIVE, LOST = pb.MemberState.ACTIVE, pb.MemberState.LOST


def member(
    name: str, index: int, address: str, state: pb.MemberState = ACTIVE, clique: str = CLIQUE
) -> pb.Member:
    return pb.Member(
        domain_uid=UID, node_name=name, clique_id=clique, index=index, state=state, ip_address=address
    )


def binding(node: str, uid: str = UID) -> pb.NodeBinding:
    return pb.NodeBinding(node_name=node, domain_uid=uid)


def test_slots_hold_members_by_index_and_the_placeholder_elsewhere() -> None:
    members = [
        member("n0", 0, "10.0.0.1"),
        member("n2", 2, "10.0.0.3"),
        member("x", 1, "10.9.9.9", clique="other"),
    ]
    addresses, names = slot_holders(members, CLIQUE)
    assert len(addresses) == len(names) == slots.MAX_SLOTS
    assert addresses[0] == "10.0.0.1" and addresses[2] == "10.0.0.3"
    assert addresses[1] == slots.PLACEHOLDER_ADDRESS, "another clique's member holds no slot here"
    assert set(addresses[3:]) == {slots.PLACEHOLDER_ADDRESS}
    assert names[:3] == ("n0", "", "n2")


def test_a_lost_member_keeps_its_slot_address() -> None:
    members = [(member("n0", 0, "10.0.0.1"), 5), (member("n1", 1, "10.0.0.2", LOST), 6)]
    desired = membership_of("n0", binding("n0"), members).desired
    assert desired is not None
    assert desired.slot_addresses[1] == "10.0.0.2"
    assert desired.slot_nodes[1] == "n1"


def test_own_identity_and_fence_revision() -> None:
    members = [(member("n0", 0, "10.0.0.1"), 5), (member("n1", 3, "10.0.0.2"), 6)]
    membership = membership_of("n1", binding("n1"), members)
    assert membership.domain_uid == UID and not membership.non_fabric
    desired = membership.desired
    assert desired is not None
    assert desired.identity == Identity(UID, CLIQUE, 3, "10.0.0.2")
    assert desired.member_revision == 6 and not desired.lost


def test_lost_own_member_is_kept_but_marked() -> None:
    desired = membership_of("n0", binding("n0"), [(member("n0", 0, "10.0.0.1", LOST), 9)]).desired
    assert desired is not None and desired.lost


def test_no_binding_no_member_or_non_fabric_run_nothing() -> None:
    assert membership_of("n0", None, []).desired is None
    gone = membership_of("n0", binding("n0"), [(member("n1", 0, "10.0.0.2"), 3)])
    assert gone.domain_uid == UID and gone.desired is None and not gone.non_fabric
    non_fabric = membership_of("n0", binding("n0"), [(member("n0", -1, "10.0.0.1", clique=""), 3)])
    assert non_fabric.non_fabric and non_fabric.desired is None


def test_a_peer_joining_changes_the_slots_but_not_the_identity() -> None:
    before = membership_of("n0", binding("n0"), [(member("n0", 0, "10.0.0.1"), 5)]).desired
    after = membership_of(
        "n0", binding("n0"), [(member("n0", 0, "10.0.0.1"), 5), (member("n1", 1, "10.0.0.2"), 7)]
    ).desired
    assert before is not None and after is not None
    assert before.identity == after.identity
    assert before.slot_addresses != after.slot_addresses


def test_connected_nodes_names_other_members_whose_slot_is_connected() -> None:
    members = [
        (member("n0", 0, "10.0.0.1"), 1),
        (member("n1", 1, "10.0.0.2"), 2),
        (member("n2", 2, "10.0.0.3"), 3),
    ]
    desired = membership_of("n0", binding("n0"), members).desired
    assert desired is not None
    connections = {0: "CONNECTED", 1: "CONNECTED", 2: "DISCONNECTED", 5: "CONNECTED"}
    assert connected_nodes(desired, connections) == ["n1"]


@given(
    st.lists(
        st.tuples(st.integers(0, slots.MAX_SLOTS - 1), st.sampled_from([ACTIVE, LOST])),
        max_size=slots.MAX_SLOTS,
        unique_by=lambda t: t[0],
    )
)
def test_every_node_of_a_clique_computes_the_same_slots(held: list[tuple[int, pb.MemberState]]) -> None:
    members = [(member(f"n{i}", i, f"10.0.1.{i + 1}", state), i + 1) for i, state in held]
    views = [membership_of(m.node_name, binding(m.node_name), members).desired for m, _ in members]
    assert len({v.slot_addresses for v in views if v is not None}) <= 1
    for v in views:
        assert v is not None
        assert v.slot_addresses[v.index] == v.address


def test_a_link_that_drops_for_a_moment_is_still_reported_connected() -> None:
    """SIGUSR1 re-dials every link: a blip is not a lost peer; a peer gone for good drops out."""
    members = [(member(f"n{i}", i, f"10.0.0.{i + 1}"), i + 1) for i in range(3)]
    desired = membership_of("n0", binding("n0"), members).desired
    assert desired is not None
    seen = {"n1": 10.0, "n2": 10.0}
    assert recently_connected(desired, seen, now=10.5, debounce_s=1.0) == ["n1", "n2"]
    seen["n1"] = 11.4  # n1 came back after the re-dial, n2 did not
    assert recently_connected(desired, seen, now=11.5, debounce_s=1.0) == ["n1"]
    assert recently_connected(desired, {}, now=0.0, debounce_s=1.0) == []
