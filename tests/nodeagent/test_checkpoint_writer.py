"""Group-committed checkpoint saves: each caller's change is in the file when its save returns,
concurrent saves share writes, a failed write reaches its callers and the next save recovers;
and unprepares of one domain do not queue behind each other's store round trips."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from services.nodeagent.checkpoint import Checkpoint, ClaimState, checkpoint_path
from services.nodeagent.checkpointwriter import CheckpointWriter
from services.nodeagent.errors import RetryableError
from tests.nodeagent.agent_fakes import fabric_node, make_device_state, new_uid, put_claim, put_domain


def _checkpoint(tmp_path: Path) -> Checkpoint:
    boot_id = tmp_path / "boot_id"
    boot_id.write_text("boot-1\n")
    return Checkpoint.load(checkpoint_path(tmp_path / "kubelet"), boot_id)


def _reload(checkpoint: Checkpoint, tmp_path: Path) -> Checkpoint:
    return Checkpoint.load(checkpoint.path, tmp_path / "boot_id")


def _start(checkpoint: Checkpoint, uid: str) -> None:
    checkpoint.mark_prepare_started(uid, namespace="ns", name=f"c-{uid[:8]}", domain_uid="cd-1", node="n1")


@pytest.mark.parametrize("fsync", [False, True])
async def test_each_save_returns_with_its_change_on_disk_and_concurrent_saves_share_writes(
    tmp_path: Path, fsync: bool
) -> None:
    checkpoint = _checkpoint(tmp_path)
    writer = CheckpointWriter(checkpoint, fsync=fsync)
    missing: list[str] = []

    async def change_and_save(uid: str) -> None:
        await asyncio.sleep(0)
        _start(checkpoint, uid)
        await writer.save()
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
    _start(checkpoint, first)
    saving_first = asyncio.create_task(writer.save())
    await asyncio.sleep(0)  # the first write has taken its content
    _start(checkpoint, second)
    saving_second = asyncio.create_task(writer.save())
    await saving_first
    await saving_second
    assert set(_reload(checkpoint, tmp_path).entries) == {first, second}
    assert writer.writes == 2
    writer.close()


async def test_a_failed_write_fails_its_callers_and_the_next_save_writes_everything(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path)
    writer = CheckpointWriter(checkpoint, fsync=False)
    checkpoint.path.parent.parent.mkdir(parents=True)
    checkpoint.path.parent.write_text("not a directory")  # the plugin directory cannot exist
    uids = [new_uid() for _ in range(3)]
    for uid in uids:
        _start(checkpoint, uid)
    results = await asyncio.gather(*(writer.save() for _ in uids), return_exceptions=True)
    assert all(isinstance(r, OSError) for r in results), results
    assert writer.writes == 0

    checkpoint.path.parent.unlink()
    await writer.save()
    assert set(_reload(checkpoint, tmp_path).entries) == set(uids)
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
    with pytest.raises(RetryableError, match="cannot write the checkpoint"):
        await n.state.prepare(ref)
    plugin_dir.unlink()
    await n.state.prepare(ref)  # kubelet's retry
    entry = n.reload_checkpoint().get(ref.uid)
    assert entry is not None and entry.state is ClaimState.PREPARE_COMPLETED


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
