"""Typed access to the state model in etcd.

Reads return `Versioned` values that carry their mod revision; writes that
depend on a read go through `txn` with revision comparisons (`Unchanged`,
`Absent`), so concurrent writers never lose each other's updates.
Undecodable values are logged with their key and skipped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import aetcd
import aetcd.exceptions
import aetcd.utils
import betterproto
import structlog
from aetcd import rpc

from libs.runtime.backoff import Backoff
from libs.runtime.errors import RetryableError
from libs.state.client import TlsCapableClient
from libs.state.codec import UndecodableValue, decode, encode
from libs.state.config import EtcdConfig
from libs.state.keys import Keys

log = structlog.get_logger(__name__)

M = TypeVar("M", bound=betterproto.Message)

# Errors after which the same call may succeed later (etcd restarting, leader change).
# ConnectionFailedError is also what connecting to an unreachable etcd raises (with or
# without TLS). UnauthenticatedError (etcd's "invalid auth token") reaches a caller only
# when a token refused by a restarted etcd was replaced and the new one was refused too
# (etcd restarted again in between): the next attempt authenticates again.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    aetcd.exceptions.ConnectionFailedError,
    aetcd.exceptions.ConnectionTimeoutError,
    aetcd.exceptions.InternalError,
    aetcd.exceptions.UnauthenticatedError,
    asyncio.TimeoutError,
)


class StoreFailure(RetryableError):
    """The store did not do what was asked, and the same call may succeed later."""


class StoreUnavailable(StoreFailure, RuntimeError):
    """etcd could not be reached within the retry budget."""


class ConflictError(StoreFailure, RuntimeError):
    """A compare-and-swap kept losing to concurrent writers beyond its attempt cap."""


@dataclass(frozen=True, slots=True)
class Versioned(Generic[M]):
    key: str
    value: M
    mod_revision: int
    create_revision: int
    lease: int = 0


# ---- transaction building blocks -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Absent:
    """Compare: the key does not exist (with `prefix`: no key under it exists)."""

    key: str
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class Present:
    """Compare: the key exists."""

    key: str


@dataclass(frozen=True, slots=True)
class Unchanged:
    """Compare: the key's mod revision is still `mod_revision` (0 = absent)."""

    key: str
    mod_revision: int


@dataclass(frozen=True, slots=True)
class CreatedAt:
    """Compare: the key's create revision is `create_revision` (fencing on a leader key)."""

    key: str
    create_revision: int


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    # A message, or bytes already encoded as a stored value (`libs.state.codec`).
    value: betterproto.Message | bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: str
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class Read:
    """A read inside a transaction (a key, or every key under a prefix); results in `TxnResult.reads`."""

    key: str
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class FirstAbsent:
    """Nested transactions: apply the writes of the first alternative whose guard key does not exist.

    `alternatives` are (guard key, writes) pairs tried in order inside etcd, in one round trip;
    `TxnResult.chosen` says which one was applied (None: every guard key existed). This is how
    many concurrent joiners each take the lowest free index without a herd of retries.
    """

    alternatives: tuple[tuple[str, tuple[Put | Delete, ...]], ...]


Compare = Absent | Present | Unchanged | CreatedAt
Op = Put | Delete | Read | FirstAbsent


@dataclass(frozen=True, slots=True)
class RawKV:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    # One list per Read op of the branch that ran, in order.
    reads: tuple[list[RawKV], ...] = ()
    # Which alternative of a FirstAbsent op in the branch that ran was applied (None: none).
    chosen: int | None = None


def txn_request(compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> Any:
    """etcd's ``TxnRequest`` for these compares and branches (pure).

    Each message is filled in place, top down: a `FirstAbsent` of n alternatives is n
    transactions nested in each other's failure branch, and protobuf copies a sub-message handed
    to a constructor, so building it bottom up (as aetcd's helpers do) copied the chain n times,
    which dominated the joins of a 256-node formation."""
    txn = rpc.TxnRequest()
    _add_compares(txn.compare, compares)
    _add_ops(txn.success, success)
    _add_ops(txn.failure, failure)
    return txn


def independent_txns_request(txns: Sequence[tuple[Sequence[Compare], Sequence[Op]]]) -> Any:
    """One ``TxnRequest`` running each (compares, writes) pair as its own nested transaction (pure).

    The outer transaction has no compares, so every nested one is decided on its own compares:
    one etcd round trip (and one raft entry) for many unrelated guarded writes. etcd rejects a
    request that writes one key in two of them (duplicate key), and caps each level at
    --max-txn-ops operations (128 by default): callers keep within both."""
    txn = rpc.TxnRequest()
    for compares, ops in txns:
        nested = txn.success.add().request_txn
        _add_compares(nested.compare, compares)
        _add_ops(nested.success, ops)
    return txn


def txn_result(response: Any) -> TxnResult:
    """A ``TxnResponse`` in the store's terms."""
    reads: list[list[RawKV]] = []
    chosen: int | None = None
    for item in response.responses:
        kind = item.WhichOneof("response")
        if kind == "response_txn":
            chosen = _chosen_alternative(item.response_txn)
        elif kind == "response_range":
            reads.append(
                [
                    RawKV(
                        kv.key.decode(),
                        kv.value,
                        int(kv.mod_revision),
                        int(kv.create_revision),
                        int(kv.lease),
                    )
                    for kv in item.response_range.kvs
                ]
            )
    return TxnResult(bool(response.succeeded), int(response.header.revision), tuple(reads), chosen)


def _add_compares(into: Any, compares: Sequence[Compare]) -> None:
    for c in compares:
        message = into.add()
        message.key = c.key.encode()
        message.result = rpc.Compare.EQUAL
        if isinstance(c, Absent):
            message.target = rpc.Compare.CREATE
            message.create_revision = 0
            if c.prefix:
                # etcd holds a range compare true when every key in the range meets it, and when
                # the range is empty; no key has create revision 0, so: no key under the prefix.
                message.range_end = _prefix_end(message.key)
        elif isinstance(c, Present):
            message.result = rpc.Compare.GREATER
            message.target = rpc.Compare.VERSION
            message.version = 0
        elif isinstance(c, Unchanged):
            message.target = rpc.Compare.MOD
            message.mod_revision = c.mod_revision
        else:
            message.target = rpc.Compare.CREATE
            message.create_revision = c.create_revision


def _add_ops(into: Any, ops: Sequence[Op]) -> None:
    for op in ops:
        if isinstance(op, FirstAbsent):
            _add_first_absent(into, op)
            continue
        message = into.add()
        key = op.key.encode()
        if isinstance(op, Put):
            put = message.request_put
            put.key = key
            put.value = op.value if isinstance(op.value, bytes) else encode(op.value)
            put.lease = op.lease
        elif isinstance(op, Read):
            get = message.request_range
            get.key = key
            if op.prefix:
                get.range_end = _prefix_end(key)
        else:
            delete = message.request_delete_range
            delete.key = key
            if op.prefix:
                delete.range_end = _prefix_end(key)


def _add_first_absent(into: Any, op: FirstAbsent) -> None:
    """One transaction per alternative, each nested in the previous one's failure branch."""
    branch = into
    for guard, writes in op.alternatives:
        nested = branch.add().request_txn
        _add_compares(nested.compare, [Absent(guard)])
        _add_ops(nested.success, writes)
        branch = nested.failure


def _chosen_alternative(response: Any) -> int | None:
    """Depth of the nested transaction that succeeded in a FirstAbsent chain (None: none did)."""
    depth = 0
    while not response.succeeded:
        inner = [r.response_txn for r in response.responses if r.WhichOneof("response") == "response_txn"]
        if not inner:
            return None
        response, depth = inner[0], depth + 1
    return depth


def _prefix_end(prefix: bytes) -> bytes:
    return aetcd.utils.prefix_range_end(prefix)


class Store:
    """One connection to etcd, with the key layout of one deployment."""

    def __init__(self, config: EtcdConfig) -> None:
        self.config = config
        self.keys = Keys(config.prefix)
        self.client = TlsCapableClient(config)

    async def connect(self) -> None:
        await self.client.connect()

    async def close(self) -> None:
        await self.client.close()

    async def __aenter__(self) -> Store:
        await self.connect()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    # ---- reads ----------------------------------------------------------------

    def _decode(self, key: str, data: bytes, cls: type[M]) -> M | None:
        try:
            return decode(data, cls, key)
        except UndecodableValue as exc:
            log.error("skipping undecodable value", key=key, reason=exc.reason)
            return None

    async def get(self, key: str, cls: type[M], *, strict: bool = False) -> Versioned[M] | None:
        """The value at `key` (None if absent). An undecodable value reads as absent (logged), or
        with `strict` raises `UndecodableValue` naming the key: a writer must not take it for
        absent, its write would only fail against the key that is there."""
        result = await self.client.get(key.encode())
        if result is None:
            return None
        value = decode(result.value, cls, key) if strict else self._decode(key, result.value, cls)
        if value is None:
            return None
        return Versioned(key, value, result.mod_revision, result.create_revision, result.lease)

    async def list(self, prefix: str, cls: type[M]) -> tuple[list[Versioned[M]], int]:
        """All decodable values under `prefix` (sorted by key) and the store revision of the read."""
        result = await self.client.get_prefix(prefix.encode())
        items: list[Versioned[M]] = []
        for kv in result:
            key = kv.key.decode()
            value = self._decode(key, kv.value, cls)
            if value is not None:
                items.append(Versioned(key, value, kv.mod_revision, kv.create_revision, kv.lease))
        return items, int(result.header.revision)

    async def revision(self) -> int:
        # A small range every component may read (the prefix as a whole is not: see roles.py).
        result = await self.client.get_prefix(self.keys.domains().encode(), keys_only=True)
        return int(result.header.revision)

    # ---- writes ---------------------------------------------------------------

    async def put(self, key: str, value: betterproto.Message, lease: int = 0) -> int:
        result = await self.client.put(key.encode(), encode(value), lease=lease or None)
        return int(result.header.revision)

    async def put_raw(self, key: str, data: bytes) -> None:
        """Write bytes as they are (tests use it to plant an undecodable value)."""
        await self.client.put(key.encode(), data)

    async def delete(self, key: str) -> bool:
        result = await self.client.delete(key.encode())
        return result is not None and bool(result.deleted)

    async def delete_prefix(self, prefix: str) -> int:
        result = await self.client.delete_prefix(prefix.encode())
        return int(result.deleted) if result is not None else 0

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        return txn_result(await self.client.txn(txn_request(compares, success, failure)))

    async def txn_each(
        self, txns: Sequence[tuple[Sequence[Compare], Sequence[Op]]]
    ) -> tuple[Sequence[bool], int]:
        """Run independent guarded transactions in one round trip (`independent_txns_request`):
        whether each one's compares held (and its writes were applied), and the revision."""
        response = await self.client.txn(independent_txns_request(txns))
        succeeded = [bool(item.response_txn.succeeded) for item in response.responses]
        return succeeded, int(response.header.revision)

    def decode_kv(self, kv: RawKV, cls: type[M], *, strict: bool = False) -> Versioned[M] | None:
        """Decode a value read in a transaction (None, logged, if undecodable; with `strict`,
        `UndecodableValue` naming the key)."""
        value = decode(kv.value, cls, kv.key) if strict else self._decode(kv.key, kv.value, cls)
        return (
            None if value is None else Versioned(kv.key, value, kv.mod_revision, kv.create_revision, kv.lease)
        )

    async def create(self, key: str, value: betterproto.Message, lease: int = 0) -> bool:
        """Write only if the key does not exist yet."""
        return (await self.txn([Absent(key)], [Put(key, value, lease)])).succeeded

    async def compare_and_swap(
        self, key: str, value: betterproto.Message, expected_mod_revision: int, lease: int = 0
    ) -> bool:
        """Write only if the key is still at `expected_mod_revision` (0 = absent)."""
        return (await self.txn([Unchanged(key, expected_mod_revision)], [Put(key, value, lease)])).succeeded

    async def compare_and_delete(self, key: str, expected_mod_revision: int) -> bool:
        return (await self.txn([Unchanged(key, expected_mod_revision)], [Delete(key)])).succeeded

    async def update(
        self,
        key: str,
        cls: type[M],
        mutate: Callable[[M | None], M | None],
        max_attempts: int = 50,
    ) -> M | None:
        """Read-modify-write with CAS, retried on conflict with backoff.

        `mutate` gets the current value (None if absent) and returns the new
        value, or None to leave the key as it is. Returns what was written.
        An undecodable value fails at once with `UndecodableValue` naming the key.
        """
        backoff = Backoff(initial=0.002, cap=0.2)
        for _ in range(max_attempts):
            current = await self.get(key, cls, strict=True)
            new = mutate(current.value if current else None)
            if new is None:
                return None
            if await self.compare_and_swap(key, new, current.mod_revision if current else 0):
                return new
            await asyncio.sleep(backoff.next_delay())
        raise ConflictError(f"update of {key} lost {max_attempts} compare-and-swap races")

    # ---- leases ---------------------------------------------------------------

    async def grant_lease(self, ttl_s: int) -> int:
        lease = await self.client.lease(ttl_s)
        return int(lease.id)

    async def refresh_lease(self, lease_id: int) -> int:
        """Keep a lease alive once; returns the remaining TTL (0 = the lease is gone)."""
        reply = await self.client.refresh_lease(lease_id)
        return int(reply.TTL) if reply is not None else 0

    async def revoke_lease(self, lease_id: int) -> None:
        try:
            await self.client.revoke_lease(lease_id)
        except aetcd.exceptions.ClientError as exc:
            log.warning("lease revoke failed", lease=lease_id, error=str(exc))


async def with_retries(
    call: Callable[[], Awaitable[Any]], what: str, deadline_s: float = 30.0, backoff: Backoff | None = None
) -> Any:
    """Run `call`, retrying transient store errors with capped backoff until `deadline_s`."""
    delays = backoff or Backoff(initial=0.05, cap=2.0)
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        try:
            return await call()
        except TRANSIENT_ERRORS as exc:
            if loop.time() >= end:
                raise StoreUnavailable(f"{what}: etcd unavailable for {deadline_s:.0f}s ({exc})") from exc
            delay = delays.next_delay()
            log.warning(
                "store call failed; retrying",
                what=what,
                error=str(exc) or type(exc).__name__,
                retry_in_s=round(delay, 3),
            )
            await asyncio.sleep(delay)
