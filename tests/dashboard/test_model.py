"""The dashboard's view of the store: what each tray and domain shows (pure, no I/O)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from libs.gen.computedomain.state import v1 as pb
from libs.state.keys import Keys
from tests.dashboard import records
from tools.dashboard.model import PALETTE, DashboardView, Resource
from tools.sim.hardware.cluster import ClusterDescription

KEYS = Keys("/cd/v1/")
CLUSTER = ClusterDescription(racks=2, trays_per_rack=18, seed="dash-model")
UID_A = "aaaaaaaa-0000-0000-0000-000000000001"
UID_B = "bbbbbbbb-0000-0000-0000-000000000002"


def key(resource: Resource, *parts: str) -> str:
    base = {
        "domains": KEYS.domains(),
        "members": KEYS.all_members(),
        "daemons": KEYS.all_daemons(),
        "nodes": KEYS.nodes(),
    }[resource]
    return base + "/".join(parts)


def synced_view(cluster: ClusterDescription | None = CLUSTER) -> DashboardView:
    view = DashboardView(KEYS, cluster, clock_ms=lambda: 1000)
    view.resync("nodes", [(key("nodes", n), records.node(CLUSTER, n)) for n in CLUSTER.node_names()])
    for resource in ("domains", "members", "daemons"):
        view.resync(resource, [])
    return view


def tray(doc: dict, node: str) -> dict:
    return next(t for r in doc["racks"] for t in r["trays"] if t["node"] == node)


def join(view: DashboardView, uid: str, nodes: list[str], state: pb.DaemonState) -> None:
    for index, name in enumerate(nodes):
        view.apply("members", key("members", uid, name), records.member(CLUSTER, uid, name, index))
        view.apply("daemons", key("daemons", uid, name), records.daemon(uid, name, state))


def test_every_tray_of_the_cluster_is_drawn_in_its_rack_in_order() -> None:
    doc = synced_view().document()
    assert [r["name"] for r in doc["racks"]] == ["rack0", "rack1"]
    for rack, r in enumerate(doc["racks"]):
        assert [t["node"] for t in r["trays"]] == [f"rack{rack}-tray{t}" for t in range(18)]
        assert r["cliques"] == [CLUSTER.node(f"rack{rack}-tray0").clique]
    assert doc["synced"] and doc["summary"]["nodes"] == doc["summary"]["nodes_up"] == 36
    json.dumps(doc)  # what the server sends


def test_a_tray_whose_node_record_never_came_shows_down() -> None:
    view = DashboardView(KEYS, CLUSTER)
    view.resync("nodes", [(key("nodes", "rack0-tray0"), records.node(CLUSTER, "rack0-tray0"))])
    doc = view.document()
    assert tray(doc, "rack0-tray0")["up"] is True
    assert tray(doc, "rack1-tray17")["up"] is False
    assert doc["synced"] is False  # only one of four resources listed


def test_members_take_their_domains_colour_index_and_daemon_state() -> None:
    view = synced_view()
    view.apply("domains", key("domains", UID_A), records.domain(UID_A, "train-a"))
    join(view, UID_A, ["rack0-tray0", "rack0-tray1"], pb.DaemonState.STARTING)
    doc = view.document()
    [dom] = doc["domains"]
    first, second, free = (tray(doc, f"rack0-tray{i}") for i in range(3))
    assert (first["domain"], first["index"], first["daemon"]) == (UID_A, 0, "STARTING")
    assert (second["domain"], second["index"]) == (UID_A, 1)
    assert free["domain"] == "" and free["index"] is None
    assert (dom["colour"], dom["ink"]) == PALETTE[0]
    assert (dom["members"], dom["ready_members"], dom["reason"]) == (2, 0, "WaitingForNodes")


def test_live_domains_get_distinct_colours_that_stay_for_their_life() -> None:
    view = synced_view()
    uids = [f"{i:08d}-0000-0000-0000-000000000000" for i in range(len(PALETTE))]
    for i, uid in enumerate(uids):
        view.apply("domains", key("domains", uid), records.domain(uid, f"job{i}", created_unix_ms=i))
    colours = {d["uid"]: d["colour"] for d in view.document()["domains"]}
    assert len(set(colours.values())) == len(PALETTE)
    # Deleting one frees its colour for the next domain; the others keep theirs.
    view.apply("domains", key("domains", uids[3]), None)
    view.apply("domains", key("domains", UID_B), records.domain(UID_B, "late", created_unix_ms=99))
    after = {d["uid"]: d["colour"] for d in view.document()["domains"]}
    assert after[UID_B] == colours[uids[3]]
    assert all(after[u] == colours[u] for u in uids if u != uids[3])


def test_a_lost_node_and_a_failing_daemon_are_shown_with_their_reasons() -> None:
    view = synced_view()
    view.apply("domains", key("domains", UID_A), records.domain(UID_A, "train", ready=True))
    join(view, UID_A, ["rack1-tray0", "rack1-tray1", "rack1-tray2"], pb.DaemonState.READY)
    view.apply(
        "members",
        key("members", UID_A, "rack1-tray1"),
        records.member(CLUSTER, UID_A, "rack1-tray1", 1, lost=True),
    )
    view.apply("nodes", key("nodes", "rack1-tray1"), None)
    view.apply(
        "daemons",
        key("daemons", UID_A, "rack1-tray2"),
        records.daemon(
            UID_A, "rack1-tray2", pb.DaemonState.FAILED, error="exited with code 1", log=["a", "b"]
        ),
    )
    message = "node(s) lost (agent lease expired): rack1-tray1"
    view.apply(
        "domains", key("domains", UID_A), records.domain(UID_A, "train", reason="NodeLost", message=message)
    )
    doc = view.document()
    lost, failed = tray(doc, "rack1-tray1"), tray(doc, "rack1-tray2")
    assert (lost["member"], lost["up"], lost["index"]) == ("LOST", False, -1)
    assert (failed["daemon"], failed["daemon_error"], failed["daemon_log"]) == (
        "FAILED",
        "exited with code 1",
        ["a", "b"],
    )
    [dom] = doc["domains"]
    assert (dom["status"], dom["reason"], dom["lost_members"]) == ("NotReady", "NodeLost", ["rack1-tray1"])
    texts = [r["text"] for r in doc["recent"]]
    assert "rack1-tray1 lost from default/train" in texts
    assert any("rack1-tray2: IMEX daemon FAILED" in t and "exited with code 1" in t for t in texts)
    assert any(t.startswith("default/train NotReady (NodeLost: ") for t in texts)
    assert doc["summary"]["nodes_up"] == 35


def test_without_a_cluster_description_racks_are_the_cliques_of_the_node_records() -> None:
    view = DashboardView(KEYS)
    names = ["rack1-tray2", "rack0-tray10", "rack0-tray2", "rack1-tray0", "rack0-tray0"]
    big = ClusterDescription(racks=2, trays_per_rack=11, seed="other")
    for name in names:
        view.apply("nodes", key("nodes", name), records.node(big, name))
    plain = pb.Node(name="cpu-node", ip_address="10.0.0.9")  # no fabric: clique ""
    view.apply("nodes", key("nodes", "cpu-node"), plain)
    doc = view.document()
    cliques = [big.node("rack0-tray0").clique, big.node("rack1-tray0").clique]
    assert [r["name"] for r in doc["racks"]] == [*sorted(cliques), "no NVLink fabric"]
    rack0 = next(r for r in doc["racks"] if r["name"] == cliques[0])
    assert [t["node"] for t in rack0["trays"]] == ["rack0-tray0", "rack0-tray2", "rack0-tray10"]
    # A node whose record goes away stays where it was, shown down.
    view.apply("nodes", key("nodes", "rack0-tray2"), None)
    assert tray(view.document(), "rack0-tray2")["up"] is False


def test_keys_outside_the_watched_layout_are_ignored() -> None:
    view = synced_view()
    before = view.document()
    view.apply("members", KEYS.all_members() + "only-a-uid", records.member(CLUSTER, UID_A, "rack0-tray0", 0))
    view.apply("nodes", "/other-prefix/nodes/rack0-tray0", None)
    after = view.document()
    assert after["racks"] == before["racks"] and after["version"] == before["version"] + 2


# ---- level-triggered: any event history renders like a fresh listing of its end state ----

NODES = ["rack0-tray0", "rack0-tray1", "rack1-tray0"]
UIDS = [UID_A, UID_B]
DAEMON_STATES = [pb.DaemonState.STARTING, pb.DaemonState.READY, pb.DaemonState.FAILED]

events = st.one_of(
    st.tuples(st.just("domains"), st.sampled_from(UIDS), st.just(""), st.booleans(), st.integers(0, 2)),
    st.tuples(
        st.just("members"), st.sampled_from(UIDS), st.sampled_from(NODES), st.booleans(), st.integers(0, 2)
    ),
    st.tuples(
        st.just("daemons"), st.sampled_from(UIDS), st.sampled_from(NODES), st.booleans(), st.integers(0, 2)
    ),
    st.tuples(st.just("nodes"), st.just(""), st.sampled_from(NODES), st.booleans(), st.integers(0, 2)),
)


def _event(resource: str, uid: str, node: str, present: bool, variant: int) -> tuple[Resource, str, object]:
    if resource == "domains":
        value = records.domain(uid, f"d-{uid[:4]}", ready=variant == 1, reason=["A", "B", "C"][variant])
        return "domains", key("domains", uid), value if present else None
    if resource == "members":
        value = records.member(CLUSTER, uid, node, variant, lost=variant == 2)
        return "members", key("members", uid, node), value if present else None
    if resource == "daemons":
        value = records.daemon(uid, node, DAEMON_STATES[variant], error=str(variant))
        return "daemons", key("daemons", uid, node), value if present else None
    return "nodes", key("nodes", node), records.node(CLUSTER, node) if present else None


def _picture(doc: dict) -> dict:
    return {"racks": doc["racks"], "domains": doc["domains"], "summary": doc["summary"]}


@settings(max_examples=60, deadline=None)
@given(st.lists(events, max_size=30))
def test_any_event_history_renders_like_a_listing_of_its_end_state(history: list[tuple]) -> None:
    streamed = synced_view()
    final: dict[str, dict[str, object]] = {r: {} for r in ("domains", "members", "daemons", "nodes")}
    for k, v in streamed.nodes.items():
        final["nodes"][key("nodes", k)] = v
    for event in history:
        resource, k, value = _event(*event)
        streamed.apply(resource, k, value)  # type: ignore[arg-type]
        if value is None:
            final[resource].pop(k, None)
        else:
            final[resource][k] = value
    listed = DashboardView(KEYS, CLUSTER)
    for resource in ("domains", "members", "daemons", "nodes"):
        items = list(final[resource].items())
        listed.resync(resource, items)  # type: ignore[arg-type]
    a, b = _picture(streamed.document()), _picture(listed.document())
    # Colours depend on history (a domain keeps its colour); everything else must match.
    for doc in (a, b):
        for d in doc["domains"]:
            d.pop("colour"), d.pop("ink")
    assert a == b
