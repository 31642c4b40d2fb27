"""The node agent's pure prepare, unprepare and reconcile plans (services/nodeagent/core/),
driven as the shell drives them, with no etcd, no files and no processes: the checkpoint changes
are applied in memory, joins and leaves are a set, time is a fake clock.

The state machine interleaves the two halves of a prepare (the start under the domain lock, the
completion after the daemon wait) with unprepares, other claims and the passing of time, and
checks what a user of the node would notice: a node is a member of a domain exactly while it
holds a claim of it, never of two domains, and a claim unprepared moments ago is not brought back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from libs.cdi.spec import claim_cdi_device_id
from libs.contract.names import (
    CHANNEL_DEVICE,
    DRIVER_NAME,
    REASON_DRIVER_TOO_OLD,
    REASON_WAITING_FOR_RECOVERY,
)
from libs.gen.computedomain.state import v1 as pb
from services.nodeagent.core.checkpoint import (
    Checkpoint,
    ClaimEntry,
    ClaimState,
    StalePrepareError,
    Tombstone,
)
from services.nodeagent.core.claim import ClaimRef, DeviceResult, OpaqueParameters, ResolvedClaim
from services.nodeagent.core.domain_header import DomainHeader
from services.nodeagent.core.errors import PermanentClaimError, RetryableClaimError
from services.nodeagent.core.prepare_plan import (
    PreparePlan,
    StartStep,
    admit_claim,
    finished_answer,
    membership_held,
    not_ready_message,
    plan_prepare,
    plan_start,
)
from services.nodeagent.core.reconcile_plan import (
    DropRecord,
    RebuildEntry,
    domain_to_leave,
    plan_records,
    record_problem,
    restored_record,
)
from services.nodeagent.core.unprepare_plan import UnprepareStep, forget, leaves_domain, plan_unprepare
from tests.nodeagent.agent_fakes import channel_parameters, fabric_node

T = TypeVar("T")

NODE = fabric_node("rack0-tray0")
NAMESPACE = "team-a"
TTL_S = 300.0
DOMAINS = ("cd-0", "cd-1")
CLAIMS = tuple(f"0000000{i}-0000-4000-8000-000000000000" for i in range(4))


def domain_of(uid: str) -> str:
    return DOMAINS[CLAIMS.index(uid) % 2]


def resolved(uid: str, version: str, domain: str, node: str = NODE.name) -> ResolvedClaim:
    return ResolvedClaim(
        ref=ClaimRef(NAMESPACE, f"claim-{uid[7]}", uid),
        version=version,
        results=(DeviceResult("channel", DRIVER_NAME, node, CHANNEL_DEVICE),),
        configs=(OpaqueParameters(DRIVER_NAME, (), channel_parameters(domain)),),
    )


def header(domain: str, namespace: str = NAMESPACE, deleting: bool = False) -> DomainHeader:
    return DomainHeader(uid=domain, namespace=namespace, name=domain, deleting=deleting)


@dataclass
class Unprepared:
    at: float
    version: str | None  # None: an unknown claim's tombstone, which refuses every version


class NodeClaims(RuleBasedStateMachine):
    """One node's claims as DeviceState decides them, the store and disk left out."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1_000.0
        self.checkpoint = Checkpoint(
            Path("never-written.json"), boot_id="boot", tombstone_ttl_s=TTL_S, clock=lambda: self.now
        )
        self.members: set[str] = set()
        self.versions = dict.fromkeys(CLAIMS, "1")
        self.in_flight: dict[str, PreparePlan] = {}
        self.unprepared: dict[str, Unprepared] = {}

    def change(self, mutate: Callable[[Checkpoint], T]) -> T:
        """A checkpoint change as the shell makes it, minus the file."""
        return self.checkpoint.apply(mutate)[0]

    @rule(uid=st.sampled_from(CLAIMS))
    def start_prepare(self, uid: str) -> None:
        """The first half of DeviceState._prepare: checks, then the start under the domain lock."""
        if uid in self.in_flight:
            return  # kubelet's calls of one claim are serialized
        claim = resolved(uid, self.versions[uid], domain_of(uid))
        finished = finished_answer(self.checkpoint.get(uid))
        if finished is not None:
            assert finished[0].cdi_device_ids == (claim_cdi_device_id(uid),)
            return
        tombstoned = self.checkpoint.is_tombstoned(uid, claim_version=claim.version)
        recent = self.unprepared.get(uid)
        assert tombstoned == (
            recent is not None and recent.version in (None, claim.version) and self.now < recent.at + TTL_S
        )
        try:
            request = admit_claim(claim.ref, claim, NODE.name, tombstoned)
        except PermanentClaimError as exc:
            assert tombstoned and "unprepared recently" in str(exc)
            return
        plan = plan_prepare(request, header(domain_of(uid)), NODE)
        assert plan.fabric and list(plan.channels) == [0]
        held = membership_held(self.checkpoint.entries.values(), plan.domain_uid, besides=uid)
        step = plan_start(plan, self.checkpoint.get(uid), held)
        try:
            self.change(plan.start)  # RIDE_ALONG: saved with the completion; JOIN: before the join
        except StalePrepareError:
            assert tombstoned, "the checkpoint refused a prepare the plan admitted"
            return
        if step is StartStep.RIDE_ALONG:
            assert plan.domain_uid in self.members  # the membership it rides on exists
        else:
            if self.members - {plan.domain_uid}:
                return  # join refused (NodeBusy): retryable, the started entry stays
            self.members.add(plan.domain_uid)
        self.in_flight[uid] = plan

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def complete_prepare(self, data: st.DataObject) -> None:
        """The second half: after the daemon wait, PrepareCompleted."""
        uid = data.draw(st.sampled_from(sorted(self.in_flight)))
        plan = self.in_flight.pop(uid)
        try:
            entry = self.change(plan.complete)
        except StalePrepareError:
            assert uid in self.unprepared and self.checkpoint.get(uid) is None  # unprepared meanwhile
            return
        assert entry.state is ClaimState.PREPARE_COMPLETED
        assert entry.cdi_device_ids == (claim_cdi_device_id(uid),)
        assert plan.domain_uid in self.members

    @rule(uid=st.sampled_from(CLAIMS))
    def unprepare(self, uid: str) -> None:
        entry = self.checkpoint.get(uid)
        step = plan_unprepare(entry, uid in self.checkpoint.tombstones)
        if step is UnprepareStep.DELETE_RECORD:
            assert entry is None
            return
        if step is UnprepareStep.RELEASE:
            assert entry is not None
            if leaves_domain(self.checkpoint.entries.values(), entry):
                self.members.discard(entry.domain_uid)
        else:
            assert step is UnprepareStep.TOMBSTONE and entry is None
        self.change(forget(uid))
        self.unprepared[uid] = Unprepared(self.now, entry.claim_version if entry is not None else None)

    @rule(uid=st.sampled_from(CLAIMS))
    def reuse_claim(self, uid: str) -> None:
        """A shared claim used again by a new pod: same UID, a new version."""
        if uid not in self.in_flight and self.checkpoint.get(uid) is None:
            self.versions[uid] = str(int(self.versions[uid]) + 1)

    @rule(seconds=st.sampled_from([1.0, 60.0, TTL_S]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    @invariant()
    def member_exactly_while_a_claim_is_held(self) -> None:
        held = {e.domain_uid for e in self.checkpoint.entries.values()}
        assert self.members <= held
        completed = {
            e.domain_uid for e in self.checkpoint.entries.values() if e.state is ClaimState.PREPARE_COMPLETED
        }
        assert completed <= self.members

    @invariant()
    def one_domain_at_a_time(self) -> None:
        assert len(self.members) <= 1

    @invariant()
    def no_claim_comes_back_from_a_recent_unprepare(self) -> None:
        for uid, gone in self.unprepared.items():
            entry = self.checkpoint.get(uid)
            if entry is not None and self.now < gone.at + TTL_S:
                assert gone.version is not None and entry.claim_version != gone.version
                assert entry.started_at >= gone.at


NodeClaims.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_node_claims = NodeClaims.TestCase


def test_a_claim_is_refused_before_anything_is_planned() -> None:
    uid = CLAIMS[0]
    claim = resolved(uid, "1", "cd-0")
    with pytest.raises(PermanentClaimError, match="no device of driver"):
        admit_claim(claim.ref, resolved(uid, "1", "cd-0", node="other-node"), NODE.name, False)
    request = admit_claim(claim.ref, claim, NODE.name, False)
    with pytest.raises(PermanentClaimError, match="does not exist"):
        plan_prepare(request, None, NODE)
    with pytest.raises(PermanentClaimError, match="is not in namespace team-a") as refused:
        plan_prepare(request, header("cd-0", namespace="team-b"), NODE)
    assert "team-b" not in str(refused.value)  # the other tenant's namespace is not told
    with pytest.raises(PermanentClaimError, match="being deleted"):
        plan_prepare(request, header("cd-0", deleting=True), NODE)
    with pytest.raises(RetryableClaimError, match="clique not known yet"):
        plan_prepare(
            request, header("cd-0"), pb.Node(name=NODE.name, fabric_message="fabric manager starting")
        )
    plain = plan_prepare(request, header("cd-0"), pb.Node(name=NODE.name))
    assert not plain.fabric and list(plain.channels) == []


def test_a_claim_started_for_another_domain_is_refused() -> None:
    uid = CLAIMS[0]
    claim = resolved(uid, "1", "cd-0")
    plan = plan_prepare(admit_claim(claim.ref, claim, NODE.name, False), header("cd-0"), NODE)
    other = resolved(uid, "1", "cd-1")
    checkpoint = Checkpoint(Path("never-written.json"), boot_id="boot")
    started = checkpoint.apply(
        plan_prepare(admit_claim(other.ref, other, NODE.name, False), header("cd-1"), NODE).start
    )[0]
    with pytest.raises(PermanentClaimError, match="started for domain cd-1, now names cd-0"):
        plan_start(plan, started, membership_held=False)


def _entry(uid: str, state: ClaimState = ClaimState.PREPARE_COMPLETED) -> ClaimEntry:
    return ClaimEntry(uid, state, NAMESPACE, "c", domain_of(uid), NODE.name, "1", ("id",), ("r",), 1.0, 2.0)


def _record(uid: str, state: pb.PreparedState = pb.PreparedState.PREPARE_COMPLETED) -> pb.PreparedClaim:
    return pb.PreparedClaim(
        claim_uid=uid,
        namespace=NAMESPACE,
        name="c",
        node_name=NODE.name,
        domain_uid=domain_of(uid),
        state=state,
    )


@settings(max_examples=200, deadline=None)
@given(
    held=st.sets(st.sampled_from(CLAIMS)),
    tombstoned=st.sets(st.sampled_from(CLAIMS)),
    recorded=st.lists(st.sampled_from(CLAIMS), unique=True),
    on_disk=st.sets(st.sampled_from(CLAIMS)),
)
def test_the_reconcile_plan_takes_back_what_the_checkpoint_lacks(
    held: set[str], tombstoned: set[str], recorded: list[str], on_disk: set[str]
) -> None:
    """Each store record of a claim the checkpoint does not hold is dropped if the claim was
    unprepared here, taken back otherwise, in record order; held claims' records are left."""
    tombstoned -= held
    entries = {uid: _entry(uid) for uid in held}
    tombs = {uid: Tombstone(uid, 5.0, None) for uid in tombstoned}
    steps = plan_records([(f"key/{uid}", _record(uid)) for uid in recorded], entries, tombs, on_disk)
    expected = [uid for uid in recorded if uid not in held]
    assert [s.claim_uid if isinstance(s, DropRecord) else s.record.claim_uid for s in steps] == expected
    for step in steps:
        if isinstance(step, DropRecord):
            assert step.claim_uid in tombstoned and step.key == f"key/{step.claim_uid}"
        else:
            assert isinstance(step, RebuildEntry) and step.record.claim_uid not in tombstoned
            assert step.has_cdi_spec == (step.record.claim_uid in on_disk)


def test_a_rebuilt_entry_is_completed_only_with_its_spec_and_request_names() -> None:
    uid = CLAIMS[1]
    checkpoint = Checkpoint(Path("never-written.json"), boot_id="boot")
    completed = _record(uid)
    completed.cdi_device_ids = [claim_cdi_device_id(uid)]
    assert not RebuildEntry(completed, has_cdi_spec=False).wants_request_names
    assert not RebuildEntry(
        _record(uid, pb.PreparedState.PREPARE_STARTED), has_cdi_spec=True
    ).wants_request_names
    step = RebuildEntry(completed, has_cdi_spec=True)
    assert step.wants_request_names
    checkpoint.apply(lambda c: step.rebuild(c, ("gpu-channel",)))
    entry = checkpoint.get(uid)
    assert entry is not None and entry.state is ClaimState.PREPARE_COMPLETED
    assert entry.request_names == ("gpu-channel",) and entry.domain_uid == domain_of(uid)
    other = CLAIMS[2]
    checkpoint.apply(lambda c: RebuildEntry(_record(other), has_cdi_spec=True).rebuild(c, None))
    rebuilt = checkpoint.get(other)
    assert rebuilt is not None and rebuilt.state is ClaimState.PREPARE_STARTED


def test_the_membership_left_and_the_record_restored() -> None:
    entry = _entry(CLAIMS[0])
    assert domain_to_leave(None, [entry]) is None
    assert domain_to_leave(entry.domain_uid, [entry]) is None
    assert domain_to_leave("cd-gone", [entry]) == "cd-gone"
    assert record_problem(entry, NODE.name, None) == "is missing (deleted)"
    assert record_problem(entry, NODE.name, _record(CLAIMS[0])) is None
    moved = _record(CLAIMS[0])
    moved.node_name = "rack0-tray1"
    assert record_problem(entry, NODE.name, moved) == f"names domain {entry.domain_uid} on node rack0-tray1"
    restored = restored_record(entry, NODE.name, 7)
    assert (restored.state, restored.cdi_device_ids, restored.updated_unix_ms) == (
        pb.PreparedState.PREPARE_COMPLETED,
        ["id"],
        7,
    )
    started = restored_record(_entry(CLAIMS[0], ClaimState.PREPARE_STARTED), NODE.name, 7)
    assert (started.state, started.cdi_device_ids) == (pb.PreparedState.PREPARE_STARTED, [])


def _claim_with(config: OpaqueParameters | None, device: str = CHANNEL_DEVICE) -> ResolvedClaim:
    uid = CLAIMS[0]
    return ResolvedClaim(
        ref=ClaimRef(NAMESPACE, "claim-0", uid),
        version="1",
        results=(DeviceResult("channel", DRIVER_NAME, NODE.name, device),),
        configs=() if config is None else (config,),
    )


@pytest.mark.parametrize(
    ("claim", "named"),
    [
        (_claim_with(None), "no opaque config for request 'channel'"),
        (
            _claim_with(OpaqueParameters(DRIVER_NAME, (), channel_parameters("cd-0", "Some"))),
            "allocationMode",
        ),
        (
            _claim_with(OpaqueParameters(DRIVER_NAME, (), {"domainID": "cd-0"})),
            'missing required field "apiVersion"',
        ),
        (
            _claim_with(OpaqueParameters(DRIVER_NAME, (), channel_parameters("cd-0")), "gpu-0"),
            "unknown device 'gpu-0'",
        ),
    ],
)
def test_an_unusable_claim_is_refused_naming_what_is_wrong(claim: ResolvedClaim, named: str) -> None:
    with pytest.raises(PermanentClaimError) as refused:
        admit_claim(claim.ref, claim, NODE.name, tombstoned=False)
    assert named in str(refused.value)


def test_allocation_mode_all_plans_every_channel_and_a_repeat_answers_from_the_entry() -> None:
    claim = _claim_with(OpaqueParameters(DRIVER_NAME, (), channel_parameters("cd-0", "All")))
    plan = plan_prepare(admit_claim(claim.ref, claim, NODE.name, False), header("cd-0"), NODE)
    assert list(plan.channels) == list(range(2048))
    checkpoint = Checkpoint(Path("never-written.json"), boot_id="boot")
    assert finished_answer(None) is None
    assert finished_answer(checkpoint.apply(plan.start)[0]) is None
    [device] = finished_answer(checkpoint.apply(plan.complete)[0]) or []
    assert (device.request_names, device.pool_name, device.device_name, device.cdi_device_ids) == (
        ("channel",),
        NODE.name,
        CHANNEL_DEVICE,
        (claim_cdi_device_id(claim.ref.uid),),
    )


def test_the_not_ready_message_says_what_the_daemon_reported() -> None:
    def status(state: pb.DaemonState, reason: str = "", last_error: str = "") -> pb.DaemonStatus:
        return pb.DaemonStatus(
            domain_uid="cd-0", node_name=NODE.name, state=state, reason=reason, last_error=last_error
        )

    base = f"IMEX daemon for domain cd-0 on node {NODE.name} not READY within 0.2s"
    assert not_ready_message("cd-0", NODE.name, 0.2, None, read=False) == base
    assert not_ready_message("cd-0", NODE.name, 0.2, None) == base + " (no daemon status yet)"
    waiting = status(
        pb.DaemonState.STARTING, REASON_WAITING_FOR_RECOVERY, "members not connected now: rack0-tray1"
    )
    assert not_ready_message("cd-0", NODE.name, 0.2, waiting) == (
        f"{base} (daemon STARTING, {REASON_WAITING_FOR_RECOVERY}; members not connected now: rack0-tray1)"
    )
    too_old = not_ready_message("cd-0", NODE.name, 0.2, status(pb.DaemonState.FAILED, REASON_DRIVER_TOO_OLD))
    assert (
        too_old
        == f"IMEX daemon for domain cd-0 cannot run on node {NODE.name} (daemon FAILED, {REASON_DRIVER_TOO_OLD})"
    )


@pytest.mark.parametrize(
    ("entry", "has_tombstone", "step"),
    [
        (None, True, UnprepareStep.DELETE_RECORD),
        (None, False, UnprepareStep.TOMBSTONE),
        (_entry(CLAIMS[0]), False, UnprepareStep.RELEASE),
        (
            ClaimEntry(
                CLAIMS[0],
                ClaimState.PREPARE_COMPLETED,
                NAMESPACE,
                "c",
                "",
                NODE.name,
                None,
                (),
                (),
                1.0,
                2.0,
                "nvidia-v2",
            ),
            False,
            UnprepareStep.FORGET_MIGRATED,
        ),
    ],
)
def test_the_unprepare_plan(entry: ClaimEntry | None, has_tombstone: bool, step: UnprepareStep) -> None:
    assert plan_unprepare(entry, has_tombstone) is step
