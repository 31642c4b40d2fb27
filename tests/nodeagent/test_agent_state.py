"""Prepare / unprepare / reconcile of the kubelet plugin against a real etcd (daemon readiness faked)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from libs.cdi.spec import CHANNELS_ENV, claim_cdi_device_id
from libs.contract.names import REASON_WAITING_FOR_RECOVERY
from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import check_store_invariants
from libs.state.membership import join_domain
from libs.state.store import Store
from services.nodeagent.core.checkpoint import ClaimState, checkpoint_path
from services.nodeagent.core.claim import ClaimRef
from services.nodeagent.core.errors import PermanentClaimError, RetryableClaimError
from services.nodeagent.core.prepare_plan import PreparedDevice
from tests.nodeagent.agent_fakes import (
    MAJOR,
    FakeDaemons,
    fabric_node,
    file_tree,
    make_device_state,
    new_uid,
    non_fabric_node,
    put_claim,
    put_domain,
    store_dump,
)


def spec_of(cdi_root: Path, claim_uid: str) -> dict:
    return json.loads((cdi_root / f"k8s.compute-domain.nvidia.com-claim_{claim_uid}.json").read_text())


async def member(store: Store, domain_uid: str, node: str) -> pb.Member | None:
    got = await store.get(store.keys.member(domain_uid, node), pb.Member)
    return got.value if got else None


async def test_prepare_single_on_fabric_node(store: Store, tmp_path: Path) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain = await put_domain(store)
    ref = await put_claim(store, "rack0-tray0", domain.uid)

    devices = await n.state.prepare(ref)

    cdi_id = f"k8s.compute-domain.nvidia.com/claim={ref.uid}-channel-0"
    assert devices == [PreparedDevice(("channel",), "rack0-tray0", "channel-0", (cdi_id,))]
    spec = spec_of(n.cdi_root, ref.uid)
    nodes = spec["devices"][0]["containerEdits"]["deviceNodes"]
    assert [(d["path"], d["type"], d["major"], d["minor"]) for d in nodes] == [
        ("/dev/nvidia-caps-imex-channels/channel0", "c", MAJOR, 0)
    ]
    m = await member(store, domain.uid, "rack0-tray0")
    assert m is not None and m.state == pb.MemberState.ACTIVE and m.index == 0 and m.namespace == "team-a"
    prep = await store.get(store.keys.preparation("rack0-tray0", ref.uid), pb.PreparedClaim)
    assert prep is not None and prep.value.state == pb.PreparedState.PREPARE_COMPLETED
    assert list(prep.value.cdi_device_ids) == [cdi_id]
    entry = n.reload_checkpoint().get(ref.uid)
    assert (
        entry is not None and entry.state is ClaimState.PREPARE_COMPLETED and entry.domain_uid == domain.uid
    )
    assert n.daemons.waited == [domain.uid]
    assert n.hardware.ensured == {0}
    assert await check_store_invariants(store) == []


class _NoRoundTrips:
    """Stands in for the etcd client's KV stub: any call through it fails the test."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"a repeated prepare made a store round trip ({name})")


async def test_repeat_prepare_answers_the_same_without_side_effects(store: Store, tmp_path: Path) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain = await put_domain(store)
    ref = await put_claim(store, "rack0-tray0", domain.uid)
    first = await n.state.prepare(ref)
    before_store, before_files = await store_dump(store), file_tree(tmp_path)
    cp_mtime = checkpoint_path(n.kubelet_dir).stat().st_mtime_ns
    # No store round trip may happen: every KV call (get, put, txn) goes through this stub.
    kvstub = store.client.kvstub
    store.client.kvstub = _NoRoundTrips()
    try:
        again = await n.state.prepare(ref)
    finally:
        store.client.kvstub = kvstub
    assert again == first
    assert checkpoint_path(n.kubelet_dir).stat().st_mtime_ns == cp_mtime
    assert file_tree(tmp_path) == before_files
    assert await store_dump(store) == before_store


async def test_allocation_mode_all_injects_2048_channels(store: Store, tmp_path: Path) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain = await put_domain(store)
    ref = await put_claim(store, "rack0-tray0", domain.uid, mode="All")
    await n.state.prepare(ref)
    edits = spec_of(n.cdi_root, ref.uid)["devices"][0]["containerEdits"]
    assert [d["minor"] for d in edits["deviceNodes"]] == list(range(2048))
    assert {d["path"] for d in edits["deviceNodes"]} == {
        f"/dev/nvidia-caps-imex-channels/channel{i}" for i in range(2048)
    }
    assert f"{CHANNELS_ENV}=all" in edits["env"]


async def test_non_fabric_node_gets_no_device_node_and_does_not_wait(store: Store, tmp_path: Path) -> None:
    n = make_device_state(store, tmp_path, non_fabric_node("rack0-tray1"), daemons=FakeDaemons(ready=False))
    domain = await put_domain(store)
    ref = await put_claim(store, "rack0-tray1", domain.uid, mode="All")
    devices = await n.state.prepare(ref)
    assert devices[0].cdi_device_ids == (claim_cdi_device_id(ref.uid),)
    edits = spec_of(n.cdi_root, ref.uid)["devices"][0]["containerEdits"]
    assert "deviceNodes" not in edits and f"{CHANNELS_ENV}=none" in edits["env"]
    assert n.daemons.waited == []
    m = await member(store, domain.uid, "rack0-tray1")
    assert m is not None and m.index == -1 and m.clique_id == ""


async def test_claim_naming_a_domain_of_another_namespace_changes_nothing(
    store: Store, tmp_path: Path
) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain_a = await put_domain(store, namespace="team-a", name="secret-cd")
    ref = await put_claim(store, "rack0-tray0", domain_a.uid, namespace="team-b")
    before_store, before_files = await store_dump(store), file_tree(tmp_path)

    with pytest.raises(PermanentClaimError) as info:
        await n.state.prepare(ref)

    message = str(info.value)
    assert "not in namespace team-b" in message and domain_a.uid in message
    assert "team-a" not in message and "secret-cd" not in message  # the other tenant's names stay hidden
    assert await store_dump(store) == before_store
    assert file_tree(tmp_path) == before_files
    assert n.daemons.waited == []


async def test_missing_domain_is_a_permanent_error(store: Store, tmp_path: Path) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    ref = await put_claim(store, "rack0-tray0", new_uid())
    before = await store_dump(store)
    with pytest.raises(PermanentClaimError, match="does not exist"):
        await n.state.prepare(ref)
    assert await store_dump(store) == before


@pytest.mark.parametrize(
    ("parameters", "named"),
    [
        (
            {
                "apiVersion": "resource.nvidia.com/v1beta1",
                "kind": "ComputeDomainChannelConfig",
                "domainID": "x",
                "numNodes": 2,
            },
            '"numNodes"',
        ),
        (
            {
                "apiVersion": "resource.nvidia.com/v1beta1",
                "kind": "ComputeDomainChannelConfig",
                "domainId": "x",
            },
            '"domainId"',
        ),
        (
            {
                "apiVersion": "resource.nvidia.com/v1beta1",
                "kind": "ComputeDomainChannelConfig",
                "domainID": "x",
                "allocationMode": "Some",
            },
            '"allocationMode"',
        ),
        (
            {"apiVersion": "resource.nvidia.com/v1", "kind": "ComputeDomainChannelConfig", "domainID": "x"},
            '"apiVersion"',
        ),
        (
            '{"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig", "domainID": "x", "domainID": "y"}',
            '"domainID"',
        ),
    ],
)
async def test_malformed_opaque_config_is_permanent_and_names_the_field(
    store: Store, tmp_path: Path, parameters: object, named: str
) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    ref = await put_claim(store, "rack0-tray0", "x", parameters=parameters)
    before = await store_dump(store)
    with pytest.raises(PermanentClaimError) as info:
        await n.state.prepare(ref)
    assert named in str(info.value)
    assert await store_dump(store) == before
    assert file_tree(n.cdi_root) == {}


async def test_claim_allocated_on_another_node_is_refused(store: Store, tmp_path: Path) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain = await put_domain(store)
    ref = await put_claim(store, "rack0-tray5", domain.uid)
    with pytest.raises(
        PermanentClaimError,
        match=r"no device of driver compute-domain\.nvidia\.com allocated on node rack0-tray0",
    ):
        await n.state.prepare(ref)


async def test_claim_identity_must_match_the_record(store: Store, tmp_path: Path) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain = await put_domain(store)
    ref = await put_claim(store, "rack0-tray0", domain.uid)
    with pytest.raises(PermanentClaimError, match="kubelet named it team-a/other"):
        await n.state.prepare(ClaimRef(ref.namespace, "other", ref.uid))
    with pytest.raises(PermanentClaimError, match="does not exist"):
        await n.state.prepare(ClaimRef(ref.namespace, ref.name, new_uid()))


async def test_node_in_another_domain_is_busy_then_succeeds_after_it_leaves(
    store: Store, tmp_path: Path
) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    d1, d2 = await put_domain(store, name="one"), await put_domain(store, name="two")
    first = await put_claim(store, "rack0-tray0", d1.uid)
    second = await put_claim(store, "rack0-tray0", d2.uid)
    await n.state.prepare(first)
    with pytest.raises(RetryableClaimError, match="node busy"):
        await n.state.prepare(second)
    await n.state.unprepare(first)
    devices = await n.state.prepare(second)  # kubelet's retry
    assert devices[0].cdi_device_ids == (claim_cdi_device_id(second.uid),)
    assert await member(store, d1.uid, "rack0-tray0") is None
    assert await check_store_invariants(store) == []


async def test_daemon_not_ready_in_budget_is_retryable_and_retry_completes_once(
    store: Store, tmp_path: Path
) -> None:
    daemons = FakeDaemons(ready=False)
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"), daemons=daemons, budget_s=0.2)
    domain = await put_domain(store)
    ref = await put_claim(store, "rack0-tray0", domain.uid)
    with pytest.raises(RetryableClaimError, match=r"not READY within 0\.2s"):
        await n.state.prepare(ref)
    entry = n.reload_checkpoint().get(ref.uid)
    assert entry is not None and entry.state is ClaimState.PREPARE_STARTED
    assert not (n.cdi_root / f"k8s.compute-domain.nvidia.com-claim_{ref.uid}.json").exists()
    prep = await store.get(store.keys.preparation("rack0-tray0", ref.uid), pb.PreparedClaim)
    assert prep is not None and prep.value.state == pb.PreparedState.PREPARE_STARTED

    daemons.ready = True
    await n.state.prepare(ref)
    members, _ = await store.list(store.keys.members(domain.uid), pb.Member)
    assert [m.value.node_name for m in members] == ["rack0-tray0"]
    preps, _ = await store.list(store.keys.preparations("rack0-tray0"), pb.PreparedClaim)
    assert len(preps) == 1 and preps[0].value.state == pb.PreparedState.PREPARE_COMPLETED


async def test_unprepare_leaves_the_domain_only_with_the_last_claim(store: Store, tmp_path: Path) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain = await put_domain(store)
    a = await put_claim(store, "rack0-tray0", domain.uid)
    b = await put_claim(store, "rack0-tray0", domain.uid)
    await n.state.prepare(a)
    await n.state.prepare(b)

    await n.state.unprepare(a)
    assert not (n.cdi_root / f"k8s.compute-domain.nvidia.com-claim_{a.uid}.json").exists()
    assert await store.get(store.keys.preparation("rack0-tray0", a.uid), pb.PreparedClaim) is None
    assert (
        m := await member(store, domain.uid, "rack0-tray0")
    ) is not None and m.state == pb.MemberState.ACTIVE

    await n.state.unprepare(b)
    assert await member(store, domain.uid, "rack0-tray0") is None
    assert await store.get(store.keys.node_binding("rack0-tray0"), pb.NodeBinding) is None
    assert file_tree(n.cdi_root) == {}
    assert n.reload_checkpoint().entries == {}
    await n.state.unprepare(b)  # idempotent


async def test_unknown_claim_unprepare_succeeds_and_blocks_a_late_prepare(
    store: Store, tmp_path: Path
) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain = await put_domain(store)
    ref = await put_claim(store, "rack0-tray0", domain.uid)
    await n.state.unprepare(ref)  # never prepared here: success
    with pytest.raises(PermanentClaimError, match="unprepared recently"):
        await n.state.prepare(ref)
    assert await member(store, domain.uid, "rack0-tray0") is None


async def test_prepare_after_unprepare_is_refused_and_resurrects_nothing(
    store: Store, tmp_path: Path
) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain = await put_domain(store)
    ref = await put_claim(store, "rack0-tray0", domain.uid)
    await n.state.prepare(ref)
    await n.state.unprepare(ref)
    before_store, before_files = await store_dump(store), file_tree(n.cdi_root)
    with pytest.raises(PermanentClaimError, match="refusing a stale prepare"):
        await n.state.prepare(ref)
    assert await store_dump(store) == before_store
    assert file_tree(n.cdi_root) == before_files == {}
    # The tombstone survives a restart of the agent.
    assert n.reload_checkpoint().is_tombstoned(ref.uid)


async def test_reused_claim_at_a_new_version_is_not_refused(store: Store, tmp_path: Path) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain = await put_domain(store)
    ref = await put_claim(store, "rack0-tray0", domain.uid)
    await n.state.prepare(ref)
    await n.state.unprepare(ref)
    # The claim object changes (a new pod reserved the shared claim): a new version.
    await put_claim(store, "rack0-tray0", domain.uid, name=ref.name, uid=ref.uid)
    await n.state.prepare(ref)
    assert (await member(store, domain.uid, "rack0-tray0")) is not None


async def test_concurrent_prepare_and_last_unprepare_of_one_domain_keep_membership(
    store: Store, tmp_path: Path
) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain = await put_domain(store)
    for _ in range(10):
        old = await put_claim(store, "rack0-tray0", domain.uid)
        new = await put_claim(store, "rack0-tray0", domain.uid)
        await n.state.prepare(old)
        await asyncio.gather(n.state.unprepare(old), n.state.prepare(new))
        m = await member(store, domain.uid, "rack0-tray0")
        assert m is not None and m.state == pb.MemberState.ACTIVE, (
            "a prepared claim lost its domain membership"
        )
        assert await check_store_invariants(store) == []
        await n.state.unprepare(new)


async def test_concurrent_prepares_of_one_domain_join_once(store: Store, tmp_path: Path) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain = await put_domain(store)
    refs = [await put_claim(store, "rack0-tray0", domain.uid) for _ in range(8)]
    answers = await asyncio.gather(*(n.state.prepare(r) for r in refs))
    assert [a[0].cdi_device_ids for a in answers] == [(claim_cdi_device_id(r.uid),) for r in refs]
    assert sorted(n.state.cdi.claim_uids()) == sorted(r.uid for r in refs)
    indices, _ = await store.list(store.keys.member_indices(domain.uid), pb.IndexClaim)
    assert len(indices) == 1


# ---- reconcile at start ----------------------------------------------------------------------


async def test_corrupt_checkpoint_is_rebuilt_from_the_store(store: Store, tmp_path: Path) -> None:
    node = fabric_node("rack0-tray0")
    n = make_device_state(store, tmp_path, node)
    domain = await put_domain(store)
    done = await put_claim(store, "rack0-tray0", domain.uid)
    first = await n.state.prepare(done)
    checkpoint_path(n.kubelet_dir).write_text('{"version": 1, "entries": {"trunc')

    restarted = make_device_state(store, tmp_path, node)
    report = await restarted.state.reconcile()

    assert report.rebuilt_from_store == [done.uid]
    entry = restarted.state.checkpoint.get(done.uid)
    assert entry is not None and entry.state is ClaimState.PREPARE_COMPLETED
    assert await restarted.state.prepare(done) == first
    assert (n.cdi_root / f"k8s.compute-domain.nvidia.com-claim_{done.uid}.json").exists()
    # The unprepare after the rebuild still leaves the domain.
    await restarted.state.unprepare(done)
    assert await member(store, domain.uid, "rack0-tray0") is None


async def test_reconcile_unprepares_half_prepared_claims_that_are_gone(store: Store, tmp_path: Path) -> None:
    node = fabric_node("rack0-tray0")
    n = make_device_state(store, tmp_path, node, daemons=FakeDaemons(ready=False), budget_s=0.1)
    domain = await put_domain(store)
    ref = await put_claim(store, "rack0-tray0", domain.uid)
    with pytest.raises(RetryableClaimError):
        await n.state.prepare(ref)  # PrepareStarted, joined, daemon never ready
    assert await member(store, domain.uid, "rack0-tray0") is not None
    await store.delete(store.keys.claim(ref.uid))  # the claim was deleted meanwhile

    restarted = make_device_state(store, tmp_path, node)
    report = await restarted.state.reconcile()

    assert report.unprepared_gone == [ref.uid]
    assert restarted.reload_checkpoint().entries == {}
    assert await store.get(store.keys.preparation("rack0-tray0", ref.uid), pb.PreparedClaim) is None
    assert await member(store, domain.uid, "rack0-tray0") is None


async def test_reconcile_keeps_half_prepared_claims_that_still_exist(store: Store, tmp_path: Path) -> None:
    node = fabric_node("rack0-tray0")
    n = make_device_state(store, tmp_path, node, daemons=FakeDaemons(ready=False), budget_s=0.1)
    domain = await put_domain(store)
    ref = await put_claim(store, "rack0-tray0", domain.uid)
    with pytest.raises(RetryableClaimError):
        await n.state.prepare(ref)
    restarted = make_device_state(store, tmp_path, node)
    report = await restarted.state.reconcile()
    assert report.unprepared_gone == [] and report.left_domains == []
    await restarted.state.prepare(ref)  # kubelet's retry completes it
    preps, _ = await store.list(store.keys.preparations("rack0-tray0"), pb.PreparedClaim)
    assert [p.value.state for p in preps] == [pb.PreparedState.PREPARE_COMPLETED]


async def test_reconcile_removes_stray_cdi_specs_and_memberships(store: Store, tmp_path: Path) -> None:
    node = fabric_node("rack0-tray0")
    n = make_device_state(store, tmp_path, node)
    domain = await put_domain(store)
    stray = new_uid()
    n.state.cdi.write(stray, channels=[0], major=MAJOR)
    await join_domain(store, domain.uid, "team-a", node)  # a membership no claim holds

    report = await n.state.reconcile()

    assert report.removed_cdi_specs == [stray] and report.left_domains == [domain.uid]
    assert file_tree(n.cdi_root) == {}
    assert await member(store, domain.uid, "rack0-tray0") is None


async def test_reboot_discards_the_checkpoint_but_keeps_claims_as_started(
    store: Store, tmp_path: Path
) -> None:
    node = fabric_node("rack0-tray0")
    n = make_device_state(store, tmp_path, node)
    domain = await put_domain(store)
    ref = await put_claim(store, "rack0-tray0", domain.uid)
    await n.state.prepare(ref)
    for spec in n.cdi_root.iterdir():  # /var/run is tmpfs: gone after a reboot
        spec.unlink()

    rebooted = make_device_state(store, tmp_path, node, boot_id="boot-2")
    report = await rebooted.state.reconcile()

    assert report.rebuilt_from_store == [ref.uid]
    entry = rebooted.state.checkpoint.get(ref.uid)
    assert entry is not None and entry.state is ClaimState.PREPARE_STARTED  # not answered from memory
    await rebooted.state.prepare(ref)  # kubelet prepares again after the reboot
    assert (n.cdi_root / f"k8s.compute-domain.nvidia.com-claim_{ref.uid}.json").exists()


async def test_restart_reconcile_writes_nothing_when_all_agrees(store: Store, tmp_path: Path) -> None:
    """A plugin restart or upgrade changes nothing in the store: not even a LOST membership,
    which is the controller's to revive once the node record is back."""
    from libs.state.membership import mark_member_lost

    node = fabric_node("rack0-tray0")
    n = make_device_state(store, tmp_path, node, daemons=FakeDaemons(ready=False), budget_s=0.1)
    domain = await put_domain(store)
    done, started = (
        await put_claim(store, "rack0-tray0", domain.uid),
        await put_claim(store, "rack0-tray0", domain.uid),
    )
    n.daemons.ready = True
    first = await n.state.prepare(done)
    n.daemons.ready = False
    with pytest.raises(RetryableClaimError):
        await n.state.prepare(started)  # stays PrepareStarted: its claim still exists
    assert await mark_member_lost(store, domain.uid, "rack0-tray0")
    before_store, before_files = await store_dump(store), file_tree(tmp_path)

    restarted = make_device_state(store, tmp_path, node)
    report = await restarted.state.reconcile()

    assert report == type(report)()
    assert await store_dump(store) == before_store
    assert file_tree(tmp_path) == before_files
    assert await restarted.state.prepare(done) == first  # answered from the checkpoint
    m = await member(store, domain.uid, "rack0-tray0")
    assert m is not None and m.state == pb.MemberState.LOST


async def test_failed_store_delete_in_unprepare_is_finished_by_the_retry(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import aetcd.exceptions

    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain = await put_domain(store)
    keep, drop = (
        await put_claim(store, "rack0-tray0", domain.uid),
        await put_claim(store, "rack0-tray0", domain.uid),
    )
    await n.state.prepare(keep)
    await n.state.prepare(drop)
    real_delete, real_txn = store.delete, store.txn

    async def unavailable(*args: object) -> bool:
        raise aetcd.exceptions.ConnectionFailedError("etcd restarting")

    # Deletes go alone or batched with concurrent calls' (a transaction): both fail.
    monkeypatch.setattr(store, "delete", unavailable)
    monkeypatch.setattr(store, "txn", unavailable)
    with pytest.raises(RetryableClaimError, match="state store unavailable"):
        await n.state.unprepare(drop)
    monkeypatch.setattr(store, "delete", real_delete)
    monkeypatch.setattr(store, "txn", real_txn)
    assert await store.get(store.keys.preparation("rack0-tray0", drop.uid), pb.PreparedClaim) is not None

    await n.state.unprepare(drop)  # kubelet's retry
    assert await store.get(store.keys.preparation("rack0-tray0", drop.uid), pb.PreparedClaim) is None
    assert list(n.reload_checkpoint().entries) == [keep.uid]
    assert await check_store_invariants(store) == []


async def test_failed_local_write_does_not_leave_a_completed_record(store: Store, tmp_path: Path) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain = await put_domain(store)
    first, second = (
        await put_claim(store, "rack0-tray0", domain.uid),
        await put_claim(store, "rack0-tray0", domain.uid),
    )
    await n.state.prepare(first)
    blocked = n.cdi_root / f"k8s.compute-domain.nvidia.com-claim_{second.uid}.json"
    blocked.mkdir()  # the spec file cannot be replaced: the write fails
    with pytest.raises(RetryableClaimError, match="cannot write CDI spec"):
        await n.state.prepare(second)
    prep = await store.get(store.keys.preparation("rack0-tray0", second.uid), pb.PreparedClaim)
    assert prep is None or prep.value.state != pb.PreparedState.PREPARE_COMPLETED
    assert await check_store_invariants(store) == []
    blocked.rmdir()
    assert (await n.state.prepare(second))[0].cdi_device_ids == (claim_cdi_device_id(second.uid),)
    prep = await store.get(store.keys.preparation("rack0-tray0", second.uid), pb.PreparedClaim)
    assert prep is not None and prep.value.state == pb.PreparedState.PREPARE_COMPLETED


def test_checkpoint_replacement_leaves_no_temp_files(tmp_path: Path) -> None:
    from libs.fsio.atomic import remove_stale_temps, write_atomic

    target = tmp_path / "plugins" / "checkpoint.json"
    target.parent.mkdir()
    write_atomic(target, b"one", 0o600, durable=False)
    write_atomic(target, b"two", 0o600, durable=False)
    assert target.read_bytes() == b"two" and oct(target.stat().st_mode & 0o777) == "0o600"
    assert [p.name for p in target.parent.iterdir()] == ["checkpoint.json"]
    assert remove_stale_temps(target.parent) == []


async def test_a_domain_marked_for_deletion_refuses_the_next_prepare_of_a_member_node(
    store: Store, tmp_path: Path
) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain = await put_domain(store)
    first, second = (
        await put_claim(store, "rack0-tray0", domain.uid),
        await put_claim(store, "rack0-tray0", domain.uid),
    )
    await n.state.prepare(first)  # the node is a member; the domain's record was read and decoded
    domain.deleting = True
    await store.put(store.keys.domain(domain.uid), domain)
    with pytest.raises(PermanentClaimError, match="is being deleted"):
        await n.state.prepare(second)
    assert n.reload_checkpoint().get(second.uid) is None


async def test_a_prepare_on_a_node_whose_daemon_waits_for_recovery_names_the_wait(
    store: Store, tmp_path: Path
) -> None:
    n = make_device_state(
        store, tmp_path, fabric_node("rack0-tray0"), daemons=FakeDaemons(ready=False), budget_s=0.2
    )
    domain = await put_domain(store)
    waiting = pb.DaemonStatus(
        domain_uid=domain.uid,
        node_name="rack0-tray0",
        state=pb.DaemonState.STARTING,
        reason=REASON_WAITING_FOR_RECOVERY,
        last_error="IMEX daemon WAITING_FOR_RECOVERY: ...; members not connected now: rack0-tray1 (slot 1)",
    )
    await store.put(store.keys.daemon(domain.uid, "rack0-tray0"), waiting)
    ref = await put_claim(store, "rack0-tray0", domain.uid)
    with pytest.raises(RetryableClaimError) as raised:
        await n.state.prepare(ref)
    message = str(raised.value)
    assert "daemon STARTING, ImexDaemonWaitingForRecovery" in message
    assert "members not connected now: rack0-tray1 (slot 1)" in message
