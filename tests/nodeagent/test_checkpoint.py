"""The node agent's prepare checkpoint: persistence, corruption, reboot, tombstones, atomicity."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from services.nodeagent.core.checkpoint import (
    Checkpoint,
    ClaimState,
    StalePrepareError,
    _checksum,
    checkpoint_path,
)

UID_A = "4914da61-1a20-42b3-bf26-981025df4289"
UID_B = "8a1c2b3d-0000-4000-8000-000000000002"
UID_C = "0b1c2b3d-0000-4000-8000-000000000003"
DOMAIN_1 = "cd-uid-1"
DOMAIN_2 = "cd-uid-2"


class FakeClock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def boot_id_file(tmp_path: Path) -> Path:
    path = tmp_path / "boot_id"
    path.write_text("6f1f0c53-3c1c-4a3e-9d84-000000000001\n")
    return path


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def cp_path(tmp_path: Path) -> Path:
    return checkpoint_path(tmp_path / "kubelet")


def load(cp_path: Path, boot_id_file: Path, clock: FakeClock) -> Checkpoint:
    return Checkpoint.load(cp_path, boot_id_file, clock=clock)


def started(cp: Checkpoint, uid: str, domain: str = DOMAIN_1, version: str | None = None) -> None:
    cp.mark_prepare_started(
        uid,
        namespace="team-a",
        name=f"claim-{uid[:4]}",
        domain_uid=domain,
        node="rack0-tray1",
        claim_version=version,
    )


def test_checkpoint_lives_in_the_driver_plugin_directory(tmp_path: Path) -> None:
    assert checkpoint_path(tmp_path) == tmp_path / "plugins" / "compute-domain.nvidia.com" / "checkpoint.json"


def test_round_trip_keeps_entries_and_tombstones(cp_path: Path, boot_id_file: Path, clock: FakeClock) -> None:
    cp = load(cp_path, boot_id_file, clock)
    started(cp, UID_A, version="100")
    cp.mark_prepare_completed(
        UID_A, [f"k8s.compute-domain.nvidia.com/claim={UID_A}-channel-0"], request_names=["channel"]
    )
    clock.now += 1.5
    started(cp, UID_B, DOMAIN_2)
    started(cp, UID_C)
    cp.remove(UID_C)
    cp.save()

    again = load(cp_path, boot_id_file, clock)
    assert again.entries == cp.entries
    assert again.tombstones == cp.tombstones
    a = again.entries[UID_A]
    assert a.state is ClaimState.PREPARE_COMPLETED
    assert (a.namespace, a.domain_uid, a.node, a.claim_version) == ("team-a", DOMAIN_1, "rack0-tray1", "100")
    assert a.cdi_device_ids == (f"k8s.compute-domain.nvidia.com/claim={UID_A}-channel-0",)
    assert a.request_names == ("channel",)
    assert a.completed_at == clock.now - 1.5
    assert again.entries[UID_B].state is ClaimState.PREPARE_STARTED
    assert again.is_tombstoned(UID_C)
    assert oct(os.stat(cp_path).st_mode & 0o777) == oct(0o600)


def test_file_has_the_documented_top_level_shape(cp_path: Path, boot_id_file: Path, clock: FakeClock) -> None:
    cp = load(cp_path, boot_id_file, clock)
    started(cp, UID_A)
    cp.save()
    doc = json.loads(cp_path.read_bytes())
    assert doc["version"] == 1
    assert doc["bootID"] == "6f1f0c53-3c1c-4a3e-9d84-000000000001"
    assert doc["checksum"].startswith("sha256:")
    assert doc["entries"][UID_A]["state"] == "PrepareStarted"


def test_successive_saves_after_changes_load_back_exactly(
    cp_path: Path, boot_id_file: Path, clock: FakeClock
) -> None:
    # Encoding reuses per-entry fragments; a changed entry must not be written from a stale one.
    cp = load(cp_path, boot_id_file, clock)
    started(cp, UID_A)
    started(cp, UID_B)
    cp.save()
    cp.mark_prepare_completed(UID_A, ["id-a"])
    cp.remove(UID_B)
    started(cp, UID_C, DOMAIN_2)
    cp.save()
    again = load(cp_path, boot_id_file, clock)
    assert again.entries == cp.entries
    assert again.entries[UID_A].cdi_device_ids == ("id-a",)
    assert UID_B not in again.entries


def corrupt_checksum(path: Path) -> None:
    doc = json.loads(path.read_bytes())
    doc["entries"][UID_A]["domainUID"] = "someone-elses-domain"  # still valid JSON
    path.write_text(json.dumps(doc))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:40])


def wrong_version(path: Path) -> None:
    doc = json.loads(path.read_bytes())
    doc["version"] = 2
    path.write_text(json.dumps(doc))


def bad_structure(path: Path) -> None:
    # Consistent checksum but a field of the wrong type: a bug or a hand edit, still unusable.
    doc = json.loads(path.read_bytes())
    doc["entries"][UID_A]["startedAt"] = "yesterday"
    doc["checksum"] = _checksum(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (corrupt_checksum, "checksum mismatch"),
        (truncate, "invalid JSON"),
        (wrong_version, "unsupported version 2"),
        (bad_structure, "malformed content"),
    ],
)
def test_corrupt_file_is_moved_aside_with_a_log_line_and_an_empty_checkpoint_is_returned(
    cp_path: Path, boot_id_file: Path, clock: FakeClock, damage: Any, reason: str
) -> None:
    cp = load(cp_path, boot_id_file, clock)
    started(cp, UID_A)
    cp.save()
    damage(cp_path)
    damaged = cp_path.read_bytes()

    with capture_logs() as logs:
        loaded = load(cp_path, boot_id_file, clock)

    assert loaded.entries == {} and loaded.tombstones == {}
    assert not cp_path.exists()
    [aside] = list(cp_path.parent.glob("checkpoint.json.corrupt-*"))
    assert aside.read_bytes() == damaged  # kept for inspection
    [line] = [entry for entry in logs if entry["log_level"] == "error"]
    assert "corrupt" in line["event"]
    assert line["path"] == str(cp_path)
    assert line["moved_to"] == str(aside)
    assert reason in line["reason"]
    # The agent can carry on: the next save writes a fresh, valid checkpoint.
    started(loaded, UID_B)
    loaded.save()
    assert set(load(cp_path, boot_id_file, clock).entries) == {UID_B}


def test_reboot_discards_entries_and_tombstones(cp_path: Path, boot_id_file: Path, clock: FakeClock) -> None:
    cp = load(cp_path, boot_id_file, clock)
    started(cp, UID_A)
    started(cp, UID_B)
    cp.remove(UID_B)
    cp.save()
    boot_id_file.write_text("6f1f0c53-3c1c-4a3e-9d84-000000000002\n")

    with capture_logs() as logs:
        after = load(cp_path, boot_id_file, clock)

    assert after.entries == {} and after.tombstones == {}
    assert after.boot_id == "6f1f0c53-3c1c-4a3e-9d84-000000000002"
    [line] = [entry for entry in logs if "rebooted" in entry["event"]]
    assert line["discarded_claims"] == [UID_A]
    after.save()
    assert json.loads(cp_path.read_bytes())["bootID"] == "6f1f0c53-3c1c-4a3e-9d84-000000000002"


def test_unreadable_boot_id_keeps_entries(
    cp_path: Path, boot_id_file: Path, clock: FakeClock, tmp_path: Path
) -> None:
    cp = load(cp_path, boot_id_file, clock)
    started(cp, UID_A)
    cp.save()
    with capture_logs() as logs:
        again = Checkpoint.load(cp_path, tmp_path / "no-such-boot-id", clock=clock)
    assert set(again.entries) == {UID_A}
    assert any("boot id" in entry["event"] for entry in logs)


def test_missing_file_gives_an_empty_checkpoint(cp_path: Path, boot_id_file: Path, clock: FakeClock) -> None:
    cp = load(cp_path, boot_id_file, clock)
    assert cp.entries == {}
    assert not cp_path.exists()


def test_prepare_after_unprepare_is_refused_until_the_tombstone_expires(
    cp_path: Path, boot_id_file: Path, clock: FakeClock
) -> None:
    cp = Checkpoint.load(cp_path, boot_id_file, clock=clock, tombstone_ttl_s=60)
    started(cp, UID_A)
    cp.mark_prepare_completed(UID_A, ["id"])
    assert cp.remove(UID_A) is not None
    assert UID_A not in cp.entries

    clock.now += 59
    assert cp.is_tombstoned(UID_A)
    with pytest.raises(StalePrepareError, match=UID_A):
        started(cp, UID_A)
    assert UID_A not in cp.entries

    clock.now += 1
    assert not cp.is_tombstoned(UID_A)
    started(cp, UID_A)
    assert cp.entries[UID_A].state is ClaimState.PREPARE_STARTED
    assert UID_A not in cp.tombstones


def test_prepare_in_flight_during_unprepare_cannot_complete(
    cp_path: Path, boot_id_file: Path, clock: FakeClock
) -> None:
    # Upstream #1162: prepare started, unprepare ran meanwhile, the prepare then finishes.
    cp = load(cp_path, boot_id_file, clock)
    started(cp, UID_A)
    cp.remove(UID_A)
    with pytest.raises(StalePrepareError):
        cp.mark_prepare_completed(UID_A, ["id"])
    assert UID_A not in cp.entries


def test_tombstones_survive_a_restart_and_expire_by_wall_clock(
    cp_path: Path, boot_id_file: Path, clock: FakeClock
) -> None:
    cp = Checkpoint.load(cp_path, boot_id_file, clock=clock, tombstone_ttl_s=300)
    started(cp, UID_A)
    cp.remove(UID_A)
    cp.save()

    clock.now += 100
    restarted = Checkpoint.load(cp_path, boot_id_file, clock=clock, tombstone_ttl_s=300)
    with pytest.raises(StalePrepareError):
        started(restarted, UID_A)

    clock.now += 200
    later = Checkpoint.load(cp_path, boot_id_file, clock=clock, tombstone_ttl_s=300)
    assert later.tombstones == {}  # pruned on load
    started(later, UID_A)


def test_tombstone_with_claim_version_refuses_only_that_version(
    cp_path: Path, boot_id_file: Path, clock: FakeClock
) -> None:
    cp = load(cp_path, boot_id_file, clock)
    started(cp, UID_A, version="100")
    cp.remove(UID_A)
    assert cp.is_tombstoned(UID_A, claim_version="100")
    assert cp.is_tombstoned(UID_A)  # version unknown: refuse
    with pytest.raises(StalePrepareError):
        started(cp, UID_A, version="100")
    # The same claim reused later by a new pod has a new version: allowed at once.
    assert not cp.is_tombstoned(UID_A, claim_version="105")
    started(cp, UID_A, version="105")
    assert cp.entries[UID_A].claim_version == "105"


def test_stale_completion_of_an_older_version_is_refused(
    cp_path: Path, boot_id_file: Path, clock: FakeClock
) -> None:
    cp = load(cp_path, boot_id_file, clock)
    started(cp, UID_A, version="100")
    cp.remove(UID_A)
    started(cp, UID_A, version="105")
    with pytest.raises(StalePrepareError, match="superseded"):
        cp.mark_prepare_completed(UID_A, ["id"], claim_version="100")
    assert cp.entries[UID_A].state is ClaimState.PREPARE_STARTED


def test_unprepare_of_unknown_claim_still_guards_against_a_late_prepare(
    cp_path: Path, boot_id_file: Path, clock: FakeClock
) -> None:
    cp = load(cp_path, boot_id_file, clock)
    assert cp.remove(UID_A) is None
    with pytest.raises(StalePrepareError):
        started(cp, UID_A)


def test_repeated_prepare_does_not_regress_a_completed_claim(
    cp_path: Path, boot_id_file: Path, clock: FakeClock
) -> None:
    cp = load(cp_path, boot_id_file, clock)
    started(cp, UID_A)
    done = cp.mark_prepare_completed(UID_A, ["id"])
    assert cp.mark_prepare_started(UID_A, namespace="x", name="y", domain_uid="z", node="n") == done
    assert cp.entries[UID_A] == done


def test_completing_a_never_started_claim_is_a_key_error(
    cp_path: Path, boot_id_file: Path, clock: FakeClock
) -> None:
    cp = load(cp_path, boot_id_file, clock)
    with pytest.raises(KeyError):
        cp.mark_prepare_completed(UID_A, ["id"])


def test_prepared_claims_of_domain(cp_path: Path, boot_id_file: Path, clock: FakeClock) -> None:
    cp = load(cp_path, boot_id_file, clock)
    started(cp, UID_B, DOMAIN_1)
    started(cp, UID_A, DOMAIN_1)
    cp.mark_prepare_completed(UID_A, ["id"])
    started(cp, UID_C, DOMAIN_2)
    assert [e.claim_uid for e in cp.prepared_claims_of_domain(DOMAIN_1)] == [UID_A, UID_B]
    cp.remove(UID_A)
    assert [e.claim_uid for e in cp.prepared_claims_of_domain(DOMAIN_1)] == [UID_B]
    assert cp.prepared_claims_of_domain("unknown") == []


def test_failed_rename_leaves_the_previous_checkpoint_intact(
    cp_path: Path, boot_id_file: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    cp = load(cp_path, boot_id_file, clock)
    started(cp, UID_A)
    cp.save()
    before = cp_path.read_bytes()

    def crash(src: str, dst: str) -> None:
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    started(cp, UID_B)
    with pytest.raises(OSError, match="simulated crash"):
        cp.save()
    monkeypatch.undo()

    assert cp_path.read_bytes() == before
    assert sorted(p.name for p in cp_path.parent.iterdir()) == ["checkpoint.json"]  # no temp litter
    assert set(load(cp_path, boot_id_file, clock).entries) == {UID_A}


def test_successive_saves_with_changing_tombstones_load_back_exactly(
    cp_path: Path, boot_id_file: Path, clock: FakeClock
) -> None:
    # Encoding reuses per-tombstone fragments; added, replaced and expired tombstones must all
    # end up in the file as they are now (a stale fragment would fail the checksum on load).
    cp = Checkpoint.load(cp_path, boot_id_file, clock=clock, tombstone_ttl_s=60)
    started(cp, UID_A)
    started(cp, UID_B)
    cp.remove(UID_A)
    cp.save()
    clock.now += 30
    cp.remove(UID_B)
    cp.remove(UID_A, claim_version="7")  # replaces A's tombstone with a later expiry
    cp.save()
    assert Checkpoint.load(cp_path, boot_id_file, clock=clock, tombstone_ttl_s=60).tombstones == cp.tombstones
    clock.now += 70  # A's first expiry long gone, the replacement and B's also expired now
    started(cp, UID_C)
    cp.save()
    again = Checkpoint.load(cp_path, boot_id_file, clock=clock, tombstone_ttl_s=60)
    assert again.tombstones == {} and set(again.entries) == {UID_C}


def _fresh(tmp_path: Path) -> tuple[Checkpoint, Path, FakeClock]:
    """An empty checkpoint in a directory of its own (one per hypothesis example), its boot id
    file and its clock; tombstones live 10 s."""
    directory = Path(tempfile.mkdtemp(dir=tmp_path))
    boot = directory / "boot_id"
    boot.write_text("6f1f0c53-3c1c-4a3e-9d84-000000000001\n")
    clock = FakeClock()
    return (
        Checkpoint.load(checkpoint_path(directory / "kubelet"), boot, clock=clock, tombstone_ttl_s=10),
        boot,
        clock,
    )


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["start", "complete", "remove", "advance", "save"]),
        st.integers(min_value=0, max_value=5),
        st.sampled_from([None, "1", "2"]),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_any_sequence_of_changes_and_saves_loads_back_exactly(
    ops: list[tuple[str, int, str | None]], tmp_path: Path
) -> None:
    # Saves reuse cached fragments, the cached tombstone section and a lower bound on the earliest
    # expiry: whatever happened in between, the file must load back (valid checksum) as it is now.
    cp, boot, clock = _fresh(tmp_path)
    path = cp.path
    uids = [f"0000000{i}-0000-4000-8000-000000000000" for i in range(6)]
    for op, i, version in ops:
        uid = uids[i]
        try:
            if op == "start":
                started(cp, uid, version=version)
            elif op == "complete":
                cp.mark_prepare_completed(uid, [f"id-{i}"], claim_version=version)
            elif op == "remove":
                cp.remove(uid, claim_version=version)
            elif op == "advance":
                clock.now += 4
            else:
                cp.save()
                again = Checkpoint.load(path, boot, clock=clock, tombstone_ttl_s=10)
                assert again.entries == cp.entries
                assert again.tombstones == cp.tombstones
                assert all(t.expires_at > clock.now for t in again.tombstones.values())
        except (StalePrepareError, KeyError):
            pass  # refusals are part of the behaviour, not of this property


_UPDATES = st.lists(
    st.tuples(
        st.sampled_from(["start", "complete", "remove", "start-and-complete", "advance"]),
        st.integers(min_value=0, max_value=3),
        st.sampled_from([None, "1", "2"]),
        st.booleans(),  # whether this update's save fails
    ),
    max_size=30,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(updates=_UPDATES)
def test_an_update_is_in_memory_and_in_the_file_or_nowhere(
    updates: list[tuple[str, int, str | None, bool]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whatever fails (the save, or the change itself half-way), the checkpoint in memory is as
    # before the update, and what the next save writes is as if the update was never made.
    cp, boot, clock = _fresh(tmp_path)
    path = cp.path
    uids = [f"0000000{i}-0000-4000-8000-000000000000" for i in range(4)]
    failing = False
    real_write = Checkpoint.write

    def write(self: Checkpoint, data: bytes) -> None:
        if failing:
            raise OSError(28, "No space left on device")
        real_write(self, data)

    monkeypatch.setattr(Checkpoint, "write", write)
    for op, i, version, failing in updates:
        uid = uids[i]
        if op == "advance":
            clock.now += 4
            continue

        def change(c: Checkpoint, op: str = op, uid: str = uid, version: str | None = version) -> None:
            if op in ("start", "start-and-complete"):
                started(c, uid, version=version)
            if op in ("complete", "start-and-complete"):
                c.mark_prepare_completed(uid, [f"id-{uid[:8]}"], claim_version=version)
            if op == "remove":
                c.remove(uid, claim_version=version)

        cp.prune_tombstones()
        before = (dict(cp.entries), dict(cp.tombstones), cp.encode())
        try:
            cp.update(change)
        except (OSError, StalePrepareError, KeyError):
            assert (dict(cp.entries), dict(cp.tombstones), cp.encode()) == before
            continue
        assert not failing
        again = Checkpoint.load(path, boot, clock=clock, tombstone_ttl_s=10)
        assert (again.entries, again.tombstones) == (cp.entries, cp.tombstones)
