"""First start after NVIDIA's driver: its checkpoint (same path as ours) is migrated, or refused.

The fixtures in tests/nodeagent/fixtures/ are checkpoints as NVIDIA's compute-domain kubelet
plugin writes them (see services/nodeagent/core/nvidia_checkpoint.py for the format and its source).
When they were made they were decoded with the Go types of k8s.io/api v0.36.0-rc.0, re-marshalled
byte for byte identical, and their checksums recomputed with go-spew and hash/fnv as kubelet's
checkpointmanager does; the known answers below come from that run.

- nvidia-checkpoint-v2.json (current writer: V1 and V2): claim A, a completed channel claim of
  ComputeDomain D; claim B, NVIDIA's own IMEX daemon pod claim (completed, a "daemon" device: no
  mapping); claim C, a channel claim of D left PrepareStarted. Node rack0-tray0, boot id boot-1.
- nvidia-checkpoint-v1.json (driver 25.3: V1 only): claims A and B.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import check_store_invariants
from libs.state.store import Store
from services.nodeagent.core.checkpoint import Checkpoint, ClaimState, checkpoint_path
from services.nodeagent.core.claim import ClaimRef
from services.nodeagent.core.nvidia_checkpoint import (
    NvidiaCheckpointError,
    parse_nvidia_checkpoint,
    upstream_checksum,
)
from services.nodeagent.core.prepare_plan import PreparedDevice
from services.nodeagent.wire.driver import ClaimDispatcher
from tests.nodeagent.agent_fakes import (
    NodeUnderTest,
    fabric_node,
    file_tree,
    make_device_state,
    put_claim,
    put_domain,
    store_dump,
)

FIXTURES = Path(__file__).parent / "fixtures"
V2_FIXTURE = FIXTURES / "nvidia-checkpoint-v2.json"
V1_FIXTURE = FIXTURES / "nvidia-checkpoint-v1.json"
NODE = "rack0-tray0"
DOMAIN = "5b7f3c1e-2d4a-4b6c-9e8f-0a1b2c3d4e5f"
CLAIM_A = "9f4e1c2a-3b5d-4e6f-8a7b-1c2d3e4f5a60"
CLAIM_B = "0c8d7e6f-5a4b-4c3d-8e2f-1a0b9c8d7e61"
CLAIM_C = "e1d2c3b4-a596-4877-8695-a4b3c2d1e062"
CDI_A = f"k8s.compute-domain.nvidia.com/claim={CLAIM_A}-channel-0"
CDI_B = (
    "k8s.compute-domain.nvidia.com/device=all",
    f"k8s.compute-domain.nvidia.com/claim={CLAIM_B}-daemon-0",
)
# NVIDIA's plugin writes claim specs through the CDI cache: the transient spec name plus .yaml.
NVIDIA_SPEC_A = f"k8s.compute-domain.nvidia.com-claim_{CLAIM_A}.yaml"


def install(kubelet_dir: Path, fixture: Path | bytes) -> bytes:
    """Put a checkpoint where NVIDIA's plugin (and ours) keeps it; returns its bytes."""
    raw = fixture if isinstance(fixture, bytes) else fixture.read_bytes()
    path = checkpoint_path(kubelet_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)
    return raw


def aside(kubelet_dir: Path, label: str) -> list[Path]:
    # "<label>-<UTC stamp>": the digit keeps "nvidia" from matching "nvidia-refused".
    return sorted(checkpoint_path(kubelet_dir).parent.glob(f"checkpoint.json.{label}-[0-9]*"))


def start_node(store: Store, tmp_path: Path, fixture: Path | bytes) -> tuple[NodeUnderTest, bytes]:
    """The node's agent state, built the way the agent builds it, over a kubelet directory that
    holds NVIDIA's checkpoint and NVIDIA's CDI spec of claim A."""
    kubelet_dir = tmp_path / NODE / "kubelet"
    raw = install(kubelet_dir, fixture)
    cdi_root = tmp_path / NODE / "cdi"
    cdi_root.mkdir(parents=True)
    (cdi_root / NVIDIA_SPEC_A).write_text(
        f"cdiVersion: 0.5.0\nkind: k8s.compute-domain.nvidia.com/claim\ndevices:\n- name: {CLAIM_A}-channel-0\n"
        "  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia-caps-imex-channels/channel0\n"
    )
    return make_device_state(store, tmp_path, fabric_node(NODE)), raw


def resign(doc: dict[str, Any]) -> bytes:
    """Compact Go-style JSON of ``doc`` with both checksums set as NVIDIA's writer sets them."""

    def dumps(value: Any) -> str:
        return json.dumps(value, separators=(",", ":"))

    if isinstance(doc.get("v2"), dict):
        doc["v2"]["checksum"] = 0
        doc["v2"]["checksum"] = upstream_checksum(dumps(doc["v2"]).encode())
    without_v2 = {"checksum": 0, **({"v1": doc["v1"]} if doc.get("v1") is not None else {})}
    doc["checksum"] = upstream_checksum(dumps(without_v2).encode())
    return dumps(doc).encode()


# ---- the format ----------------------------------------------------------------------------------


def test_checksum_is_kubelet_checkpointmanagers() -> None:
    # Known answers from go-spew (k8s.io/utils/dump ForHash settings) and hash/fnv in Go.
    assert upstream_checksum(b'{"a":1}') == 1187653614
    doc = json.loads(V2_FIXTURE.read_bytes())
    assert (doc["checksum"], doc["v2"]["checksum"]) == (3799346272, 4096236313)
    parsed = parse_nvidia_checkpoint(V2_FIXTURE.read_bytes())
    assert parsed.version == "v2" and parsed.boot_id == "boot-1"
    assert [c.claim_uid for c in parsed.claims] == sorted([CLAIM_A, CLAIM_B, CLAIM_C])
    # Re-signing the decoded document reproduces the file: our encoder matches the Go writer here.
    assert resign(json.loads(V2_FIXTURE.read_bytes())) == V2_FIXTURE.read_bytes()
    assert resign(json.loads(V1_FIXTURE.read_bytes())) == V1_FIXTURE.read_bytes()


# ---- migration through the agent's own start-up ----------------------------------------------------


async def test_first_start_migrates_prepared_claims(store: Store, tmp_path: Path) -> None:
    with capture_logs() as logs:
        n, raw = start_node(store, tmp_path, V2_FIXTURE)
    entries = n.state.checkpoint.entries
    assert set(entries) == {CLAIM_A, CLAIM_B, CLAIM_C}
    a, b, c = entries[CLAIM_A], entries[CLAIM_B], entries[CLAIM_C]
    assert (a.state, a.domain_uid, a.cdi_device_ids, a.request_names, a.node, a.migrated_from) == (
        ClaimState.PREPARE_COMPLETED,
        DOMAIN,
        (CDI_A,),
        ("channel",),
        NODE,
        "nvidia-v2",
    )
    # NVIDIA's daemon pod claim: kept (kubelet will unprepare it), with no domain of ours.
    assert (b.state, b.domain_uid, b.cdi_device_ids) == (ClaimState.PREPARE_COMPLETED, "", CDI_B)
    # A started claim keeps its name (NVIDIA writes it only then) and its domain from the allocation.
    assert (c.state, c.namespace, c.name, c.domain_uid) == (
        ClaimState.PREPARE_STARTED,
        "team-a",
        "job-1-channel-x7k2q",
        DOMAIN,
    )

    # NVIDIA's file is kept byte for byte; ours took its place and reads back the same.
    [kept] = aside(n.kubelet_dir, "nvidia")
    assert kept.read_bytes() == raw
    assert json.loads(checkpoint_path(n.kubelet_dir).read_bytes())["version"] == 1
    assert n.reload_checkpoint().entries == entries

    unmapped = [e for e in logs if e.get("claim_uid") == CLAIM_B]
    assert unmapped and unmapped[0]["log_level"] == "warning" and "daemon" in unmapped[0]["reason"]
    assert any(e.get("claim_uid") == CLAIM_A and e["log_level"] == "info" for e in logs)

    # Start-up reconcile: claim C's claim no longer exists, so its half prepare is undone; A's
    # and B's are kept, and so is the CDI spec NVIDIA wrote for A (running containers use it).
    report = await n.state.reconcile()
    assert report.unprepared_gone == [CLAIM_C] and report.removed_cdi_specs == []
    assert (n.cdi_root / NVIDIA_SPEC_A).exists()
    assert await check_store_invariants(store) == []


async def test_kubelet_prepare_again_and_unprepare_after_the_switch(store: Store, tmp_path: Path) -> None:
    n, _ = start_node(store, tmp_path, V2_FIXTURE)
    await n.state.reconcile()
    dispatcher = ClaimDispatcher(n.state, n.state.metrics)
    ref_a = ClaimRef("team-a", "job-0-channel-q9r2s", CLAIM_A)
    ref_b = ClaimRef("team-a", "cd1-daemon-claim", CLAIM_B)
    before_store, before_files = await store_dump(store), file_tree(tmp_path)

    # A kubelet restart prepares running pods' claims again: the same answer, nothing done.
    again = await dispatcher.prepare_claims([ref_a])
    assert again == {CLAIM_A: ([PreparedDevice(("channel",), NODE, "channel-0", (CDI_A,))], "")}
    assert await store_dump(store) == before_store and file_tree(tmp_path) == before_files

    # Pods end: kubelet unprepares, and both succeed (NVIDIA's spec of A goes with its claim).
    assert await dispatcher.unprepare_claims([ref_a, ref_b]) == {CLAIM_A: "", CLAIM_B: ""}
    assert n.state.checkpoint.entries == {}
    assert not (n.cdi_root / NVIDIA_SPEC_A).exists()
    assert await store_dump(store) == before_store  # they had nothing in the store
    assert n.reload_checkpoint().entries == {}


async def test_domain_of_a_migrated_claim_is_joined_and_left_for_a_new_claim(
    store: Store, tmp_path: Path
) -> None:
    n, _ = start_node(store, tmp_path, V2_FIXTURE)
    await put_domain(store, uid=DOMAIN)
    # Claim C is still allocated: kubelet prepares it again, and this agent finishes the prepare.
    ref_c = await put_claim(store, NODE, DOMAIN, name="job-1-channel-x7k2q", uid=CLAIM_C)
    await n.state.reconcile()
    fresh = await put_claim(store, NODE, DOMAIN)
    for ref in (ref_c, fresh):
        [device] = await n.state.prepare(ref)
        assert device.cdi_device_ids == (f"k8s.compute-domain.nvidia.com/claim={ref.uid}-channel-0",)
    # Migrated claim A made no membership of ours: the new claims joined the domain themselves.
    member = await store.get(store.keys.member(DOMAIN, NODE), pb.Member)
    assert member is not None and member.value.state == pb.MemberState.ACTIVE

    await n.state.unprepare(fresh)
    await n.state.unprepare(ref_c)
    # A still holds the node in the domain (its workload may use the channel) ...
    assert await store.get(store.keys.member(DOMAIN, NODE), pb.Member) is not None
    await n.state.unprepare(ClaimRef("team-a", "job-0-channel-q9r2s", CLAIM_A))
    # ... and its unprepare, the last claim of the domain here, leaves it.
    assert await store.get(store.keys.member(DOMAIN, NODE), pb.Member) is None
    assert await check_store_invariants(store) == []


async def test_second_start_does_not_migrate_again(store: Store, tmp_path: Path) -> None:
    n, _ = start_node(store, tmp_path, V2_FIXTURE)
    await n.state.reconcile()
    await n.state.unprepare(ClaimRef("team-a", "job-0-channel-q9r2s", CLAIM_A))
    ours = checkpoint_path(n.kubelet_dir).read_bytes()
    with capture_logs() as logs:
        again = n.reload_checkpoint()
    assert set(again.entries) == {CLAIM_B} and CLAIM_A in again.tombstones
    assert not any("NVIDIA" in e["event"] for e in logs)
    assert len(aside(n.kubelet_dir, "nvidia")) == 1
    assert checkpoint_path(n.kubelet_dir).read_bytes() == ours


async def test_v1_checkpoint_of_driver_25_3_is_migrated(store: Store, tmp_path: Path) -> None:
    n, _ = start_node(store, tmp_path, V1_FIXTURE)
    entries = n.state.checkpoint.entries
    assert set(entries) == {CLAIM_A, CLAIM_B}
    assert all(
        e.state is ClaimState.PREPARE_COMPLETED and e.migrated_from == "nvidia-v1" for e in entries.values()
    )
    assert (entries[CLAIM_A].domain_uid, entries[CLAIM_A].cdi_device_ids) == (DOMAIN, (CDI_A,))
    assert entries[CLAIM_A].name == "" and entries[CLAIM_B].domain_uid == ""
    ref = ClaimRef("team-a", "job-0-channel-q9r2s", CLAIM_A)
    assert await n.state.prepare(ref) == [PreparedDevice(("channel",), NODE, "channel-0", (CDI_A,))]
    await n.state.unprepare(ref)
    assert set(n.reload_checkpoint().entries) == {CLAIM_B}


async def test_claims_of_a_previous_boot_are_not_migrated(store: Store, tmp_path: Path) -> None:
    doc = json.loads(V2_FIXTURE.read_bytes())
    doc["v2"]["nodeBootID"] = "boot-0"
    with capture_logs() as logs:
        n, raw = start_node(store, tmp_path, resign(doc))
    assert n.state.checkpoint.entries == {}
    [kept] = aside(n.kubelet_dir, "nvidia")
    assert kept.read_bytes() == raw
    assert any("previous boot" in e["event"] for e in logs)
    # Ours is written, so the next start does not look at NVIDIA's claims again.
    assert json.loads(checkpoint_path(n.kubelet_dir).read_bytes())["entries"] == {}


# ---- bad input: refused, named, nothing half-done, the agent still starts ------------------------


def _tampered_v2() -> bytes:
    # Claim C lives only in V2: the top-level (V1) checksum still holds, V2's does not.
    return V2_FIXTURE.read_bytes().replace(b"job-1-worker-0", b"job-1-worker-9")


def _tampered_v1() -> bytes:
    return V2_FIXTURE.read_bytes().replace(b"cd1-daemon-7xk2p", b"cd1-daemon-xxxxx", 1)


def _unknown_version() -> bytes:
    doc = json.loads(V2_FIXTURE.read_bytes())
    doc["v3"] = {"checksum": 0, "preparedClaims": {}}
    return resign(doc)


def _rc2_layout() -> bytes:
    doc = json.loads(V1_FIXTURE.read_bytes())
    doc["v1"]["preparedClaims"] = {
        uid: c["preparedDevices"] for uid, c in doc["v1"]["preparedClaims"].items()
    }
    return resign(doc)


def _malformed() -> bytes:
    doc = json.loads(V2_FIXTURE.read_bytes())
    doc["v2"]["preparedClaims"][CLAIM_A]["preparedDevices"] = "channel-0"
    return resign(doc)


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (_tampered_v2, "v2 checksum mismatch"),
        (_tampered_v1, "checksum mismatch: file says 3799346272"),
        (_unknown_version, "unknown checkpoint version or field(s) ['v3']"),
        (_rc2_layout, "25.3.0-rc.2 layout"),
        (_malformed, "malformed content"),
    ],
    ids=["v2-checksum", "top-checksum", "unknown-version", "rc2-layout", "malformed"],
)
async def test_unreadable_nvidia_checkpoint_is_refused_and_kept(
    store: Store, tmp_path: Path, content: Any, named: str
) -> None:
    raw = content()
    with pytest.raises(NvidiaCheckpointError) as refusal:
        parse_nvidia_checkpoint(raw)
    assert named in str(refusal.value)
    with capture_logs() as logs:
        n, _ = start_node(store, tmp_path, raw)
    path = checkpoint_path(n.kubelet_dir)
    [refused] = [e for e in logs if e["log_level"] == "error"]
    assert "NVIDIA driver checkpoint refused" in refused["event"]
    assert refused["path"] == str(path) and named in refused["reason"]
    # Nothing migrated, nothing written: the file moved aside unchanged, no copy, no checkpoint.
    assert n.state.checkpoint.entries == {}
    [moved] = aside(n.kubelet_dir, "nvidia-refused")
    assert moved.read_bytes() == raw and refused["moved_to"] == str(moved)
    assert not path.exists() and aside(n.kubelet_dir, "nvidia") == []
    # The agent still starts: reconcile runs (NVIDIA's spec of an unknown claim is cleared then).
    report = await n.state.reconcile()
    assert report.removed_cdi_specs == [CLAIM_A]


async def test_torn_checkpoint_is_moved_aside_naming_the_file(store: Store, tmp_path: Path) -> None:
    raw = V2_FIXTURE.read_bytes()[:1000]
    with capture_logs() as logs:
        n, _ = start_node(store, tmp_path, raw)
    path = checkpoint_path(n.kubelet_dir)
    [error] = [e for e in logs if e["log_level"] == "error"]
    assert "NVIDIA" in error["event"] and error["path"] == str(path) and "invalid JSON" in error["reason"]
    [moved] = aside(n.kubelet_dir, "corrupt")
    assert moved.read_bytes() == raw and n.state.checkpoint.entries == {}
    await n.state.reconcile()


def test_crash_before_our_checkpoint_was_written_migrates_again(tmp_path: Path) -> None:
    """The copy is made before the replace: a crash between them leaves NVIDIA's file in place."""
    kubelet_dir = tmp_path / "kubelet"
    raw = install(kubelet_dir, V2_FIXTURE)
    boot = tmp_path / "boot_id"
    boot.write_text("boot-1\n")
    path = checkpoint_path(kubelet_dir)
    # The state right after the copy: NVIDIA's file still at the path, one copy beside it.
    shutil.copy(path, path.with_name("checkpoint.json.nvidia-20260101T000000.000000Z"))
    cp = Checkpoint.load(path, boot, node=NODE)
    assert set(cp.entries) == {CLAIM_A, CLAIM_B, CLAIM_C}
    assert [p.read_bytes() for p in aside(kubelet_dir, "nvidia")] == [raw, raw]
