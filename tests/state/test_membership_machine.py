"""Stateful property test of the real membership functions against a real etcd.

Hypothesis plays joins (one at a time, racing each other for two domains, or cut off by a crash
at any point of their run), leaves and node losses, calling `join_domain`, `leave_domain` and
`mark_member_lost` themselves. After every step the store must hold the invariants the strict
checker knows (one domain per node, unique indices inside the clique bound, bindings and index
claims matching the members), and a small model cross-checks what a user would notice: a member
keeps its index for as long as it exists, lost or not; a lost node that joins again takes its old
index back.

The same machine, run with a copy of `join_domain` that has one guard removed (the compare on
the node's binding), must fail: the test proves it can find such a bug.
"""

from __future__ import annotations

import asyncio
import inspect
import textwrap
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import check_store_invariants
from libs.state import membership
from libs.state.config import EtcdConfig
from libs.state.membership import (
    CliqueFull,
    DomainUnavailable,
    IndexConflict,
    NodeBusy,
    join_domain,
    leave_domain,
    mark_member_lost,
)
from libs.state.store import ConflictError, Store
from tests.conftest import unique_prefix

T = TypeVar("T")
LIMIT = 3  # members per clique: small, so that "clique full" happens
NODES = {"a0": "A.1", "a1": "A.1", "a2": "A.1", "a3": "A.1", "b0": "B.1", "c0": ""}
DOMAINS = ("d0", "d1")
# Expected refusals of a join (the store says no, and nothing is written).
REFUSED = (NodeBusy, CliqueFull, DomainUnavailable, IndexConflict, ConflictError)

JoinFn = Callable[..., Awaitable[membership.JoinResult]]


def node(name: str) -> pb.Node:
    return pb.Node(name=name, clique_id=NODES[name], ip_address=f"127.77.0.{list(NODES).index(name) + 1}")


class MembershipMachine(RuleBasedStateMachine):
    def __init__(self, etcd: EtcdConfig, join: JoinFn = join_domain) -> None:
        super().__init__()
        self.join = join
        self.loop = asyncio.new_event_loop()
        self.store = Store(EtcdConfig(endpoint=etcd.endpoint, prefix=unique_prefix(), timeout_s=5.0))
        self.run(self.store.connect())
        for uid in DOMAINS:
            self.run(self.store.put(self.store.keys.domain(uid), pb.ComputeDomain(uid=uid, namespace="ns")))
        # (domain, node) -> index, for every member seen at the last check.
        self.indices: dict[tuple[str, str], int] = {}
        # Nodes lost from a domain, with the index they held: a rejoin must take it back.
        self.lost: dict[tuple[str, str], int] = {}

    def run(self, work: Awaitable[T]) -> T:
        return self.loop.run_until_complete(work)

    def run_all(self, *works: Awaitable[Any]) -> list[Any]:
        async def together() -> list[Any]:
            return list(await asyncio.gather(*works))

        return self.run(together())

    def teardown(self) -> None:
        try:
            self.run(self.store.delete_prefix(self.store.keys.prefix))
            self.run(self.store.close())
        finally:
            self.loop.close()

    async def _join(self, name: str, uid: str) -> membership.JoinResult | None:
        try:
            return await self.join(self.store, uid, "ns", node(name), max_nodes_per_clique=LIMIT)
        except REFUSED:
            return None

    # ---- steps ---------------------------------------------------------------------------

    @rule(name=st.sampled_from(sorted(NODES)), uid=st.sampled_from(DOMAINS))
    def join(self, name: str, uid: str) -> None:
        result = self.run(self._join(name, uid))
        lost_index = self.lost.pop((uid, name), None)
        if result is not None and lost_index is not None and NODES[name]:
            assert result.member.index == lost_index, (
                f"{name} came back at {result.member.index}, not {lost_index}"
            )

    @rule(name=st.sampled_from(sorted(NODES)))
    def race_joins(self, name: str) -> None:
        """The same node joins both domains at once: at most one may win."""
        self.run_all(*(self._join(name, uid) for uid in DOMAINS))

    @rule(
        names=st.lists(st.sampled_from(sorted(NODES)), min_size=2, max_size=4, unique=True),
        uid=st.sampled_from(DOMAINS),
    )
    def concurrent_joins(self, names: list[str], uid: str) -> None:
        """Nodes of one clique join one domain at once: distinct indices, the lowest free first."""
        self.run_all(*(self._join(n, uid) for n in names))

    @rule(name=st.sampled_from(sorted(NODES)), uid=st.sampled_from(DOMAINS), cut_after=st.integers(0, 12))
    def crashed_join(self, name: str, uid: str, cut_after: int) -> None:
        """The agent dies `cut_after` loop turns into a join: whatever reached etcd is all there is."""

        async def cut() -> None:
            task = asyncio.ensure_future(self._join(name, uid))
            for _ in range(cut_after):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        self.run(cut())
        self.lost.pop((uid, name), None)  # may or may not have rejoined: the invariants judge

    @rule(name=st.sampled_from(sorted(NODES)), uid=st.sampled_from(DOMAINS))
    def leave(self, name: str, uid: str) -> None:
        self.run(leave_domain(self.store, uid, name))
        self.lost.pop((uid, name), None)

    @rule(name=st.sampled_from(sorted(NODES)), uid=st.sampled_from(DOMAINS))
    def node_lost(self, name: str, uid: str) -> None:
        if self.run(mark_member_lost(self.store, uid, name)):
            self.lost[(uid, name)] = self.indices[(uid, name)]

    # ---- checks --------------------------------------------------------------------------

    @invariant()
    def store_holds_the_invariants(self) -> None:
        violations = self.run(check_store_invariants(self.store, max_per_clique=LIMIT))
        assert violations == [], violations

    @invariant()
    def a_member_keeps_its_index(self) -> None:
        members, _ = self.run(self.store.list(self.store.keys.all_members(), pb.Member))
        now = {(m.value.domain_uid, m.value.node_name): m.value.index for m in members}
        for key, index in now.items():
            before = self.indices.get(key)
            assert before is None or before == index, f"member {key} moved from index {before} to {index}"
        self.indices = now


MACHINE_SETTINGS = settings(
    max_examples=25,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_the_real_membership_functions_keep_the_invariants(etcd_config: EtcdConfig) -> None:
    run_state_machine_as_test(lambda: MembershipMachine(etcd_config), settings=MACHINE_SETTINGS)


# ---- the seeded bug --------------------------------------------------------------------------

_GUARD = "Unchanged(binding_key, binding.mod_revision) if binding else Absent(binding_key),"


def join_without_binding_guard() -> JoinFn:
    """`join_domain` as it is, but for the compare that keeps a node out of two domains."""
    source = textwrap.dedent(inspect.getsource(join_domain))
    assert _GUARD in source, "the guard this test removes is not in join_domain any more"
    namespace: dict[str, Any] = dict(vars(membership))
    exec(compile(source.replace(_GUARD, ""), membership.__file__, "exec"), namespace)
    seeded: JoinFn = namespace["join_domain"]
    return seeded


def test_the_machine_finds_a_join_that_lost_its_binding_guard(etcd_config: EtcdConfig) -> None:
    seeded = join_without_binding_guard()
    with pytest.raises((AssertionError, Flaky)) as found:
        run_state_machine_as_test(
            lambda: MembershipMachine(etcd_config, join=seeded),
            settings=settings(MACHINE_SETTINGS, max_examples=60),
        )
    assert "inv1" in str(found.value) or "member of" in str(found.value), str(found.value)[:2000]
