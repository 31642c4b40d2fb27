"""The controller's in-memory view: events and resyncs map to the right domains."""

from __future__ import annotations

from libs.gen.computedomain.state import v1 as pb
from libs.state.domain_record import DomainRecord
from libs.state.keys import Keys
from libs.state.store import Versioned
from libs.state.watch import Resync, WatchEvent
from services.controller.view import StoreView

K = Keys("/p/")


def member(uid: str, node: str, lost: bool = False) -> pb.Member:
    state = pb.MemberState.LOST if lost else pb.MemberState.ACTIVE
    return pb.Member(domain_uid=uid, node_name=node, clique_id="c.1", index=0, state=state)


def test_node_delete_affects_every_domain_the_node_is_in() -> None:
    view = StoreView(K)
    view.apply_members(WatchEvent("put", K.member("d1", "n1"), member("d1", "n1"), 5))
    view.apply_members(WatchEvent("put", K.member("d2", "n1"), member("d2", "n1", lost=True), 6))
    view.apply_nodes(WatchEvent("put", K.node("n1"), pb.Node(name="n1", ip_address="1.2.3.4"), 7))
    assert view.apply_nodes(WatchEvent("delete", K.node("n1"), None, 8)) == {"d1", "d2"}
    assert view.observe("d1").nodes == {}
    # A node record refreshed with the same content changes nothing.
    view.apply_nodes(WatchEvent("put", K.node("n1"), pb.Node(name="n1"), 9))
    assert view.apply_nodes(WatchEvent("put", K.node("n1"), pb.Node(name="n1"), 10)) == set()


def test_preparation_delete_is_attributed_to_its_domain() -> None:
    view = StoreView(K)
    prep = pb.PreparedClaim(claim_uid="c1", node_name="n1", domain_uid="d1")
    assert view.apply_preparations(WatchEvent("put", K.preparation("n1", "c1"), prep, 3)) == {"d1"}
    assert view.observe("d1").preparations == {"n1": frozenset({"c1"})}
    # The delete event carries no value: the view remembers which domain the claim was for.
    assert view.apply_preparations(WatchEvent("delete", K.preparation("n1", "c1"), None, 4)) == {"d1"}
    assert view.observe("d1").preparations == {}
    assert view.domain_preparations == {} and view.preparations == {}


def test_resync_replaces_the_view_and_reports_vanished_domains() -> None:
    view = StoreView(K)
    view.apply_members(WatchEvent("put", K.member("old", "n1"), member("old", "n1"), 2))
    fresh = Versioned(K.member("new", "n2"), member("new", "n2"), 9, 9)
    assert view.apply_members(Resync([fresh], 9)) == {"old", "new"}
    assert set(view.members) == {"new"} and view.node_domains == {"n2": {"new"}}


def test_own_status_write_is_not_undone_by_an_older_echo() -> None:
    view = StoreView(K)
    view.put_domain("d1", DomainRecord(uid="d1", name="after"), 20)
    view.apply_domains(WatchEvent("put", K.domain("d1"), DomainRecord(uid="d1", name="before"), 15))
    assert view.domains["d1"].value.name == "after"
    assert view.observe("d1").domain_revision == 20


def test_keys_outside_the_layout_are_ignored() -> None:
    view = StoreView(K)
    assert view.apply_members(WatchEvent("put", "/p/members/d1", member("d1", "x"), 3)) == set()
    assert view.apply_daemons(WatchEvent("delete", "/p/daemons/d1/n1/extra", None, 4)) == set()


def test_daemon_status_keeps_what_it_reports_connected_and_its_revision() -> None:
    view = StoreView(K)
    status = pb.DaemonStatus(
        domain_uid="d1", node_name="n1", state=pb.DaemonState.READY, connected_nodes=["n2"]
    )
    assert view.apply_daemons(WatchEvent("put", K.daemon("d1", "n1"), status, 12)) == {"d1"}
    seen = view.observe("d1").daemons["n1"]
    assert (seen.connected_nodes, seen.mod_revision) == (frozenset({"n2"}), 12)
    view.apply_daemons(Resync([Versioned(K.daemon("d1", "n1"), status, 15, 3)], 20))
    assert view.observe("d1").daemons["n1"].mod_revision == 15
