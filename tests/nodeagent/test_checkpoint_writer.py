"""Group-committed checkpoint updates: each caller's change is in the file when its update
returns, concurrent updates share writes, a failed write reaches its callers with their changes
undone in memory and their retries recover; and unprepares of one domain do not queue behind
each other's store round trips."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from services.nodeagent.core.checkpoint import Checkpoint, ClaimEntry, ClaimState, checkpoint_path
from services.nodeagent.core.errors import RetryableClaimError
from services.nodeagent.shell.checkpoint_writer import CheckpointWriter
from tests.nodeagent.agent_fakes import fabric_node, make_device_state, new_uid, put_claim, put_domain


def _checkpoint(tmp_path: Path) -> Checkpoint:
    boot_id = tmp_path / "boot_id"
    boot_id.write_text("boot-1\n")
    return Checkpoint.load(checkpoint_path(tmp_path / "kubelet"), boot_id)


def _reload(checkpoint: Checkpoint, tmp_path: Path) -> Checkpoint:
    return Checkpoint.load(checkpoint.path, tmp_path / "boot_id")


def _start(uid: str) -> Callable[[Checkpoint], ClaimEntry]:
    def start(checkpoint: Checkpoint) -> ClaimEntry:
        return checkpoint.mark_prepare_started(
            uid, namespace="ns", name=f"c-{uid[:8]}", domain_uid="cd-1", node="n1"
        )

    return start


def _fail_writes_holding(writer: CheckpointWriter, marker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes whose content holds ``marker`` fail as a full disk would."""
    real = writer._write

    def write(text: str) -> None:
        if marker in text:
            raise OSError(28, "No space left on device")
        real(text)

    monkeypatch.setattr(writer, "_write", write)


def _entry_of(uid: str) -> str:
    return f'"{uid}":{{"cdiDeviceIDs"'  # an entry's canonical JSON (a tombstone's has no such key)


def _break_plugin_dir(checkpoint: Checkpoint) -> None:
    checkpoint.path.parent.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.path.parent.write_text("not a directory")  # the plugin directory cannot exist


@pytest.mark.parametrize("fsync", [False, True])
async def test_each_save_returns_with_its_change_on_disk_and_concurrent_saves_share_writes(
    tmp_path: Path, fsync: bool
) -> None:
    checkpoint = _checkpoint(tmp_path)
    writer = CheckpointWriter(checkpoint, fsync=fsync)
    missing: list[str] = []

    async def change_and_save(uid: str) -> None:
        await asyncio.sleep(0)
        entry = await writer.update(_start(uid))
        assert entry.claim_uid == uid
        if _reload(checkpoint, tmp_path).get(uid) is None:
            missing.append(uid)

    uids = [new_uid() for _ in range(32)]
    await asyncio.gather(*(change_and_save(u) for u in uids))

    assert missing == [], "a save returned before its change was in the file"
    assert set(_reload(checkpoint, tmp_path).entries) == set(uids)
    assert writer.requests == 32
    # 32 saves at once: the first write holds the first change, the next the other 31.
    assert writer.writes <= 3, f"{writer.writes} writes for 32 concurrent saves"
    writer.close()


async def test_a_change_made_while_a_write_is_in_flight_goes_in_the_next_write(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path)
    writer = CheckpointWriter(checkpoint, fsync=False)
    first, second = new_uid(), new_uid()
    saving_first = asyncio.ensure_future(writer.update(_start(first)))
    await asyncio.sleep(0)  # the first write has taken its content
    saving_second = asyncio.ensure_future(writer.update(_start(second)))
    await saving_first
    await saving_second
    assert set(_reload(checkpoint, tmp_path).entries) == {first, second}
    assert writer.writes == 2
    writer.close()


async def test_a_failed_write_fails_its_callers_undoes_their_changes_and_their_retries_write_them(
    tmp_path: Path,
) -> None:
    checkpoint = _checkpoint(tmp_path)
    writer = CheckpointWriter(checkpoint, fsync=False)
    _break_plugin_dir(checkpoint)
    uids = [new_uid() for _ in range(3)]
    results = await asyncio.gather(*(writer.update(_start(u)) for u in uids), return_exceptions=True)
    assert all(isinstance(r, OSError) for r in results), results
    assert writer.writes == 0
    assert dict(checkpoint.entries) == {}, "a change whose write failed stayed in memory"

    checkpoint.path.parent.unlink()
    await asyncio.gather(*(writer.update(_start(u)) for u in uids))  # the callers' retries
    assert set(_reload(checkpoint, tmp_path).entries) == set(uids)
    writer.close()


async def test_a_change_made_during_a_failing_write_is_kept_and_written_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = _checkpoint(tmp_path)
    writer = CheckpointWriter(checkpoint, fsync=False)
    kept, failing, later = new_uid(), new_uid(), new_uid()
    await writer.update(_start(kept))
    _fail_writes_holding(writer, _entry_of(failing), monkeypatch)
    first = asyncio.ensure_future(writer.update(_start(failing)))
    await asyncio.sleep(0)  # the failing write has taken its content
    second = asyncio.ensure_future(writer.update(_start(later)))
    with pytest.raises(OSError):
        await first
    await second
    assert set(checkpoint.entries) == {kept, later}
    assert set(_reload(checkpoint, tmp_path).entries) == {kept, later}
    writer.close()


async def test_a_failed_write_does_not_undo_a_later_change_of_the_same_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = _checkpoint(tmp_path)
    writer = CheckpointWriter(checkpoint, fsync=False)
    uid = new_uid()
    _fail_writes_holding(writer, _entry_of(uid), monkeypatch)
    started = asyncio.ensure_future(writer.update(_start(uid)))
    await asyncio.sleep(0)  # the failing write has taken its content
    removed = asyncio.ensure_future(writer.update(lambda c: c.remove(uid)))  # an unprepare meanwhile
    with pytest.raises(OSError):
        await started
    assert (await removed) is not None
    for view in (checkpoint, _reload(checkpoint, tmp_path)):
        assert view.get(uid) is None and view.is_tombstoned(uid)
    writer.close()


async def test_a_change_that_raises_changes_nothing_and_writes_nothing(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path)
    writer = CheckpointWriter(checkpoint, fsync=False)
    uid, unknown = new_uid(), new_uid()

    def half(c: Checkpoint) -> None:
        _start(uid)(c)
        c.mark_prepare_completed(unknown, ["id"])  # KeyError: never started

    with pytest.raises(KeyError):
        await writer.update(half)
    assert checkpoint.get(uid) is None and writer.requests == 0
    writer.close()


async def test_device_state_reports_a_failed_checkpoint_write_as_retryable(
    store: Store, tmp_path: Path
) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain = await put_domain(store)
    ref = await put_claim(store, "rack0-tray0", domain.uid)
    plugin_dir = checkpoint_path(n.kubelet_dir).parent
    plugin_dir.parent.mkdir(parents=True, exist_ok=True)
    plugin_dir.write_text("not a directory")
    with pytest.raises(RetryableClaimError, match="cannot write the checkpoint"):
        await n.state.prepare(ref)
    plugin_dir.unlink()
    await n.state.prepare(ref)  # kubelet's retry
    entry = n.reload_checkpoint().get(ref.uid)
    assert entry is not None and entry.state is ClaimState.PREPARE_COMPLETED


async def test_a_prepare_whose_completion_was_not_written_is_completed_by_the_retry(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain = await put_domain(store)
    ref = await put_claim(store, "rack0-tray0", domain.uid)
    _fail_writes_holding(n.state.checkpoint_writer, ClaimState.PREPARE_COMPLETED.value, monkeypatch)
    with pytest.raises(RetryableClaimError, match="cannot write the checkpoint"):
        await n.state.prepare(ref)
    entry = n.state.checkpoint.get(ref.uid)
    assert entry is not None and entry.state is ClaimState.PREPARE_STARTED, "memory ran ahead of the file"

    monkeypatch.undo()
    await n.state.prepare(ref)  # kubelet's retry must not be answered from memory alone
    on_disk = n.reload_checkpoint().get(ref.uid)
    assert on_disk is not None and on_disk.state is ClaimState.PREPARE_COMPLETED
    record = await store.get(store.keys.preparation("rack0-tray0", ref.uid), pb.PreparedClaim)
    assert record is not None and record.value.state == pb.PreparedState.PREPARE_COMPLETED


async def test_unprepares_of_one_domain_do_not_wait_for_each_others_store_round_trips(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = make_device_state(store, tmp_path, fabric_node("rack0-tray0"))
    domain = await put_domain(store)
    anchor = await put_claim(store, "rack0-tray0", domain.uid)
    await n.state.prepare(anchor)
    refs = [await put_claim(store, "rack0-tray0", domain.uid) for _ in range(8)]
    await asyncio.gather(*(n.state.prepare(r) for r in refs))
    # A slow store (a loaded etcd): each delete takes 0.25 s more.
    delay_s = 0.25
    real_delete = store.delete

    async def slow_delete(key: str) -> bool:
        await asyncio.sleep(delay_s)
        return await real_delete(key)

    monkeypatch.setattr(store, "delete", slow_delete)
    start = time.monotonic()
    await asyncio.gather(*(n.state.unprepare(r) for r in refs))
    elapsed = time.monotonic() - start
    # One after another they would take 8 x 0.25 s.
    assert elapsed < 3 * delay_s, f"8 concurrent unprepares took {elapsed:.2f}s"
    for r in refs:
        assert await store.get(store.keys.preparation("rack0-tray0", r.uid), pb.PreparedClaim) is None
    assert list(n.reload_checkpoint().entries) == [anchor.uid]
    assert all(n.reload_checkpoint().is_tombstoned(r.uid) for r in refs)
