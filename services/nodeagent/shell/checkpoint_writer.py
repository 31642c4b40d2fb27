"""Saves of the node agent's checkpoint, coalesced (group commit) and off the event loop.

Every prepare and unprepare must have its change in the checkpoint file before it answers
kubelet. With many claims in flight, one write per change wrote the same file over and over,
and the rename that replaces it can wait milliseconds for the filesystem's journal (ext4 commits
it for every fsync on the disk, etcd's included), which on the loop stalled every call.

Changes come through :meth:`CheckpointWriter.update`, which applies one at once and saves it.
A save is a request: the caller waits for a write whose content was encoded after its
request, which therefore holds its change. Requests that arrive while a write is in flight share
the next one. Writes run one at a time, in order, on the checkpoint's own thread (the loop serves
other calls meanwhile), so the file always ends at the latest state. The content is encoded on
the loop, where the checkpoint is changed, so every write is a consistent snapshot; hashed and
written on the thread. A write that fails undoes its changes in memory (newest first) before its
callers hear of it, so a retry repeats the whole step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from libs.fsio.atomic import write_atomic
from services.nodeagent.core.checkpoint import Change, Checkpoint, sign

# A write that takes longer (a hung disk) fails its waiters; they may retry.
DEFAULT_WRITE_TIMEOUT_S = 10.0

T = TypeVar("T")


class CheckpointWriter:
    """Group-committed saves of one :class:`Checkpoint` (use from one event loop)."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        *,
        fsync: bool,
        timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
        on_saved: Callable[[], None] | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        # False (the default the agent ships): atomic rename without fsync; docs/operations.md
        # ("Checkpoint durability") says why that survives everything the checkpoint must.
        self.fsync = fsync
        self.timeout_s = timeout_s
        self._on_saved = on_saved
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        # The write that the next requests join (not encoded yet), and the task doing writes.
        self._pending: asyncio.Future[None] | None = None
        self._pending_changes: list[Change] = []  # what the next write holds, to undo if it fails
        self._task: asyncio.Task[None] | None = None
        self._dir_made = False
        self.writes = 0  # files written, against save requests: how much was coalesced
        self.requests = 0

    def update(self, mutate: Callable[[Checkpoint], T]) -> Coroutine[Any, Any, T]:
        """Apply ``mutate`` to the checkpoint now and return what to await for its save: it gives
        ``mutate``'s result once the change is in the file. Applied before this returns, so a
        caller holding a lock makes the change under it and may wait for the write outside.

        The await raises ``OSError`` when the write failed (the change is then undone in
        memory), ``TimeoutError`` when it took longer than ``timeout_s`` (the write may still
        land). A ``mutate`` that raises changes nothing and its exception propagates here."""
        result, change = self.checkpoint.apply(mutate)
        waiter = self._request()
        self._pending_changes.append(change)
        return self._result_when_written(waiter, result)

    async def save(self) -> None:
        """Return once the checkpoint as it is now is in the file (no change of its own). Raises
        ``OSError`` when the write failed, ``TimeoutError`` when it took longer than ``timeout_s``."""
        await self._wait(self._request())

    def _request(self) -> asyncio.Future[None]:
        """The write the caller waits for: the next one, whose content is encoded later."""
        self.requests += 1
        waiter = self._pending
        if waiter is None:
            waiter = self._pending = asyncio.get_running_loop().create_future()
            # Retrieved here so that a failure nobody waits for any more is not logged as lost.
            waiter.add_done_callback(_retrieve)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._write_pending(), name="checkpoint-writer")
        return waiter

    async def _wait(self, waiter: asyncio.Future[None]) -> None:
        # Shielded: a caller that gives up (kubelet's deadline) must not cancel a shared write.
        async with asyncio.timeout(self.timeout_s):
            await asyncio.shield(waiter)

    async def _result_when_written(self, waiter: asyncio.Future[None], result: T) -> T:
        await self._wait(waiter)
        return result

    async def _write_pending(self) -> None:
        """Write until no request is pending. Each write's content is encoded when it is taken,
        so it holds every change made before any of its requests."""
        loop = asyncio.get_running_loop()
        while self._pending is not None:
            waiter, self._pending = self._pending, None
            changes, self._pending_changes = self._pending_changes, []
            try:
                self.checkpoint.prune_tombstones()
                text = self.checkpoint.unsigned_text()
                await loop.run_in_executor(self._executor, self._write, text)
            except BaseException as exc:
                if isinstance(exc, Exception):
                    self._undo(changes)
                if not waiter.done():
                    waiter.set_exception(exc if isinstance(exc, Exception) else OSError(str(exc)))
                if isinstance(exc, asyncio.CancelledError):
                    self._fail_pending(exc)
                    raise
                continue
            self.writes += 1
            if self._on_saved is not None:
                self._on_saved()
            if not waiter.done():
                waiter.set_result(None)

    def _fail_pending(self, exc: BaseException) -> None:
        self._undo(self._pending_changes)  # never encoded: not in the file
        self._pending_changes = []
        if self._pending is not None and not self._pending.done():
            self._pending.set_exception(OSError(f"checkpoint writer stopped: {type(exc).__name__}"))
        self._pending = None

    def _undo(self, changes: list[Change]) -> None:
        for change in reversed(changes):
            self.checkpoint.revert(change)

    def _write(self, text: str) -> None:
        data = sign(text)  # the hash of a large file (many tombstones) costs the loop nothing
        path = self.checkpoint.path
        if not self._dir_made:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._dir_made = True
        write_atomic(path, data, 0o600, durable=self.fsync)

    def close(self) -> None:
        """Stop the writer thread once the writes queued so far are done (no new ones start)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._executor.shutdown(wait=False)


def _retrieve(future: asyncio.Future[None]) -> None:
    with contextlib.suppress(BaseException):
        future.exception()
