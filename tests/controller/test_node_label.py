"""The pure core of the node labels (services/controller/kube/node_label.py).

`desired_nodes` and `plan_labels` decide what to patch for one domain, `may_take` whether a
label naming another domain may be replaced, `NodeLabelCache` keeps what Kubernetes carries.
A hypothesis test plays a whole cluster: whatever the starting labels and the order in which
domains are reconciled, one pass leaves every member's Node labelled with its domain and no
other Node with a label of a known domain; a second pass patches nothing; a label naming a
domain that still holds the node is never replaced.
"""

from __future__ import annotations

from collections.abc import Mapping

from hypothesis import given
from hypothesis import strategies as st

from services.controller.kube.node_label import (
    LabelPlan,
    NodeLabelCache,
    desired_nodes,
    may_take,
    plan_labels,
)
from services.controller.observed import MemberRecord


def member(node: str, lost: bool = False) -> MemberRecord:
    return MemberRecord(
        node=node,
        clique_id="c.1",
        index=-1 if lost else 0,
        lost=lost,
        ip_address="127.0.0.1",
        namespace="ns",
        joined_unix_ms=0,
        mod_revision=1,
    )


def test_members_lost_ones_included_are_desired_while_the_domain_exists() -> None:
    members = {"a": member("a"), "b": member("b", lost=True)}
    assert desired_nodes(True, members) == {"a", "b"}
    # Orphans of a domain whose record is gone are not labelled.
    assert desired_nodes(False, members) == frozenset()


def test_plan_labels_only_the_difference() -> None:
    current = {"a": "U", "b": "V", "d": "U"}
    plan = plan_labels("U", {"a", "b", "c"}, current)
    assert plan == LabelPlan(label=("b", "c"), unlabel=("d",))
    assert plan_labels("U", {"a"}, {"a": "U"}) == LabelPlan()
    assert not plan_labels("U", {"a"}, {"a": "U"})


def test_plan_never_unlabels_another_domains_node() -> None:
    assert plan_labels("U", set(), {"x": "V", "y": "W"}) == LabelPlan()


def test_absent_nodes_cost_nothing() -> None:
    assert plan_labels("U", {"ghost", "a"}, {}, absent={"ghost"}) == LabelPlan(label=("a",))
    assert plan_labels("U", set(), {"ghost": "U"}, absent={"ghost"}) == LabelPlan()


def test_may_take() -> None:
    assert may_take(None, "U", set())
    assert may_take("", "U", {"U"})
    assert may_take("U", "U", {"U"})
    # Left over from a domain the node left (or that is gone): replaced.
    assert may_take("V", "U", {"U"})
    # The other domain still holds the node: left alone.
    assert not may_take("V", "U", {"U", "V"})


def test_cache_tracks_labels_by_node_and_by_uid() -> None:
    cache = NodeLabelCache()
    assert not cache.loaded
    cache.replace({"a": "U", "b": "U", "c": "V"})
    assert cache.loaded and cache.by_uid == {"U": {"a", "b"}, "V": {"c"}}
    cache.record("a", "V")
    cache.record("b", None)
    assert cache.labels == {"a": "V", "c": "V"} and cache.by_uid == {"V": {"a", "c"}}
    cache.mark_absent("c")
    assert cache.absent == {"c"} and cache.by_uid == {"V": {"a"}}
    assert cache.current_for("V", ["a", "z"]) == {"a": "V"}
    assert cache.current_for("U", ["a"]) == {"a": "V"}
    cache.replace({})
    assert cache.absent == set() and cache.labels == {}


# ---- a whole cluster -------------------------------------------------------------------------

NODES = [f"n{i}" for i in range(6)]
UIDS = ["U", "V", "W"]

memberships = st.dictionaries(st.sampled_from(NODES), st.sets(st.sampled_from(UIDS), max_size=2))
labels = st.dictionaries(st.sampled_from(NODES), st.sampled_from([*UIDS, "gone"]))


def _reconcile(
    uid: str,
    existing: set[str],
    member_of: Mapping[str, set[str]],
    cluster: dict[str, str],
    absent: set[str],
) -> LabelPlan:
    """One adapter pass for `uid`, with the API played by `cluster` (node -> label)."""
    members = {n: member(n) for n, uids in member_of.items() if uid in uids}
    desired = desired_nodes(uid in existing, members)
    current = {n: v for n, v in cluster.items() if n in desired or v == uid}
    plan = plan_labels(uid, desired, current, absent)
    for node in plan.label:
        held_by = {u for u in member_of.get(node, set()) if u in existing}
        if may_take(cluster.get(node), uid, held_by):
            cluster[node] = uid
    for node in plan.unlabel:
        if cluster.get(node) == uid:
            del cluster[node]
    return plan


@given(
    memberships,
    labels,
    st.sets(st.sampled_from(UIDS)),
    st.permutations(UIDS),
    st.sets(st.sampled_from(NODES), max_size=2),
)
def test_one_pass_converges_and_never_clobbers(
    member_of: dict[str, set[str]],
    start: dict[str, str],
    existing: set[str],
    order: list[str],
    absent: set[str],
) -> None:
    cluster = {n: v for n, v in start.items() if n not in absent}
    held_at_start = {n: v for n, v in cluster.items() if v in existing and v in member_of.get(n, set())}
    for uid in order:
        _reconcile(uid, existing, member_of, cluster, absent)

    # A label naming a domain that holds its node was never replaced.
    for node, uid in held_at_start.items():
        assert cluster[node] == uid
    for node in NODES:
        if node in absent:
            assert node not in cluster
            continue
        holders = {u for u in member_of.get(node, set()) if u in existing}
        if holders:
            # In exactly one domain (invariant 1): its label; in several: one of them.
            assert cluster.get(node) in holders
            if len(holders) == 1:
                assert cluster[node] == next(iter(holders))
        else:
            # No known domain's label on a node that is in none (foreign values are not ours).
            assert cluster.get(node) in (None, "gone")
    # Level-triggered and idempotent: nothing left to patch.
    before = dict(cluster)
    for uid in UIDS:
        plan = _reconcile(uid, existing, member_of, cluster, absent)
        assert cluster == before
        # Only a node held by another domain may stay in a plan (it is read, never patched).
        for node in plan.label:
            assert cluster.get(node) != uid and cluster.get(node) in member_of.get(node, set())
        assert plan.unlabel == ()
