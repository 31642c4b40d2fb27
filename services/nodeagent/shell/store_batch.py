"""The node agent's single-key store reads and writes of concurrent claims, sent together.

With many claims in flight (kubelet starts a node's pods together), each prepare read the same
domain record and wrote its own prepared-claim record, and each unprepare deleted one: one etcd
round trip apiece, whose client work was a large part of a call's CPU. Here the operations of
concurrent calls are queued and sent as one transaction (group commit): reads in a read-only
transaction (etcd serves it as a linearizable read), writes in one that commits atomically.

A caller's operation is sent after its call (never answered by a request already on the way),
so a read sees every write that committed before it was asked for. One transaction of each kind
is in flight at a time; operations arriving meanwhile wait for it and go together in the next.
Reads of one key in one transaction are asked once; a write to a key already in the waiting
transaction goes into a later one (etcd refuses a key twice in a transaction), so writes of one
key apply in call order. A failed transaction fails each of its operations with its error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass, field

import betterproto

from libs.state.codec import decode
from libs.state.store import Delete, M, Put, RawKV, Read, Store, TxnResult, Versioned

# etcd refuses transactions of more than 128 operations (its --max-txn-ops default).
MAX_OPS = 128


@dataclass
class _Txn:
    ops: list[Put | Delete | Read] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)  # key -> position of its op
    done: asyncio.Future[TxnResult] | None = None


class _Queue:
    """Transactions of one kind waiting to be sent, and the task sending them in order."""

    def __init__(self, store: Store, kind: str) -> None:
        self.store = store
        self.kind = kind
        self.waiting: deque[_Txn] = deque()
        self.sender: asyncio.Task[None] | None = None
        self.sent = 0

    def add(self, op: Put | Delete | Read, *, share: bool) -> tuple[_Txn, int]:
        """Queue `op`; (its transaction, its position there). With `share`, an op on a key
        already waiting is answered by that op (reads)."""
        txn = self.waiting[-1] if self.waiting else None
        if txn is not None and op.key in txn.index:
            if share:
                return txn, txn.index[op.key]
            txn = None
        if txn is None or len(txn.ops) >= MAX_OPS:
            txn = _Txn(done=asyncio.get_running_loop().create_future())
            assert txn.done is not None
            txn.done.add_done_callback(_retrieve)
            self.waiting.append(txn)
        txn.index[op.key] = len(txn.ops)
        txn.ops.append(op)
        if self.sender is None or self.sender.done():
            self.sender = asyncio.create_task(self._send_all(), name=f"store-batch-{self.kind}")
        return txn, txn.index[op.key]

    async def _send_all(self) -> None:
        while self.waiting:
            txn = self.waiting.popleft()
            assert txn.done is not None
            try:
                result = await self.store.txn([], txn.ops)
            except BaseException as exc:
                if not txn.done.done():
                    txn.done.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
                if isinstance(exc, asyncio.CancelledError):
                    self._fail_waiting()
                    raise
                continue
            self.sent += 1
            if not txn.done.done():
                txn.done.set_result(result)

    def _fail_waiting(self) -> None:
        while self.waiting:
            done = self.waiting.popleft().done
            if done is not None and not done.done():
                done.set_exception(RuntimeError("store batch sender stopped"))


class StoreBatch:
    """Reads and writes of single keys, each sent with the concurrent others of its kind."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._reads = _Queue(store, "reads")
        self._writes = _Queue(store, "writes")
        self.operations = 0

    @property
    def transactions(self) -> int:
        """Transactions sent so far (against `operations`: how much was batched)."""
        return self._reads.sent + self._writes.sent

    async def get(self, key: str) -> RawKV | None:
        """The key's value as stored (None: absent)."""
        txn, position = self._reads.add(Read(key), share=True)
        reads = (await self._wait(txn)).reads
        # Reads are the only ops of a read transaction: their results are in op order.
        found = reads[position]
        return found[0] if found else None

    async def put(self, key: str, value: betterproto.Message | bytes) -> int:
        """Write the key; returns the store revision of the write."""
        txn, _ = self._writes.add(Put(key, value), share=False)
        return (await self._wait(txn)).revision

    async def delete(self, key: str) -> int:
        """Delete the key (absent is fine); returns the store revision of the delete."""
        txn, _ = self._writes.add(Delete(key), share=False)
        return (await self._wait(txn)).revision

    async def _wait(self, txn: _Txn) -> TxnResult:
        self.operations += 1
        assert txn.done is not None
        # Shielded: a caller that gives up must not cancel the others' transaction.
        return await asyncio.shield(txn.done)


class BatchedReads(Store):
    """The batch's store whose `get` joins the batch's reads (for a reader written against
    `Store`, such as the store claim source); everything else is the store's own."""

    def __init__(self, batch: StoreBatch) -> None:  # shares the store's client: no new connection
        store = batch.store
        self.config, self.keys, self.client = store.config, store.keys, store.client
        self.batch = batch

    async def get(self, key: str, cls: type[M], *, strict: bool = False) -> Versioned[M] | None:
        found = await self.batch.get(key)
        if found is None:
            return None
        value = decode(found.value, cls, key) if strict else self._decode(key, found.value, cls)
        if value is None:
            return None
        return Versioned(key, value, found.mod_revision, found.create_revision, found.lease)


def _retrieve(future: asyncio.Future[TxnResult]) -> None:
    with contextlib.suppress(BaseException):
        future.exception()
