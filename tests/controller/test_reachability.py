"""A member cut off from its peers while its node record lives: PeerUnreachable, not NodeLost, and
nothing is reconfigured (pure core)."""

from __future__ import annotations

from libs.gen.computedomain.state import v1 as pb
from services.controller import cd_status
from services.controller.observed import DaemonRecord
from services.controller.plan import plan_domain
from tests.controller.test_cd_status import obs, ready_members


def cut(parts: dict, node: str) -> None:
    """`node`'s links are lost both ways: its peers report it DISCONNECTED, it reports them."""
    names = list(parts["members"])
    for name, d in list(parts["daemons"].items()):
        lost = {p for p in names if p != name} if name == node else ({node} if node != name else set())
        parts["daemons"][name] = DaemonRecord(
            d.state,
            d.last_error,
            d.updated_unix_ms,
            d.connected_nodes - lost,
            d.mod_revision + 1,
            disconnected_nodes=frozenset(lost),
        )


def test_a_member_cut_off_with_its_record_alive_is_peer_unreachable_not_lost() -> None:
    parts = ready_members(4)
    cut(parts, "n2")
    o = obs(**parts)
    v = cd_status.ready_condition(o)
    assert (v.ready, v.reason) == (False, cd_status.REASON_PEER_UNREACHABLE)
    assert "n2 (index 2) from 3 of 3 peer(s)" in v.message and "n0" not in v.message
    status = cd_status.desired_status(o, None, 1)
    assert [n.name for n in status.nodes if not n.ready] == ["n0", "n1", "n2", "n3"]
    # Nothing is reconfigured: no member marked lost, no peer touched.
    assert plan_domain(o, 1, 30_000).actions == []


def test_one_lost_link_names_both_ends() -> None:
    parts = ready_members(3)
    for a, b in (("n0", "n1"), ("n1", "n0")):
        d = parts["daemons"][a]
        parts["daemons"][a] = DaemonRecord(
            d.state, "", 0, d.connected_nodes - {b}, d.mod_revision + 1, disconnected_nodes=frozenset({b})
        )
    v = cd_status.ready_condition(obs(**parts))
    assert v.reason == cd_status.REASON_PEER_UNREACHABLE
    assert "n0 (index 0) from 1 of 2 peer(s)" in v.message and "n1 (index 1) from 1 of 2" in v.message


def test_a_cut_member_whose_record_is_gone_too_is_lost() -> None:
    parts = ready_members(3)
    cut(parts, "n2")
    del parts["nodes"]["n2"]
    assert cd_status.ready_condition(obs(**parts)).reason == cd_status.REASON_NODE_LOST


def test_a_peer_never_connected_is_waited_for_not_unreachable() -> None:
    parts = ready_members(3)
    for name, d in list(parts["daemons"].items()):  # n2 joined; no link with it came up yet
        others = d.connected_nodes - {"n2"} if name != "n2" else frozenset()
        parts["daemons"][name] = DaemonRecord(pb.DaemonState.READY, "", 0, others, d.mod_revision + 1)
    assert cd_status.ready_condition(obs(**parts)).reason == cd_status.REASON_WAITING_FOR_PEERS
