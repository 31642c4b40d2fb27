"""One consistent read of the whole store, for checking the invariants at an instant.

`check_store_invariants` lists domains, members, bindings and preparations one prefix after the
other; while jobs come and go, those reads see different moments and can report a violation that
never existed (a claim prepared for a domain created after the domains were listed). Here the
whole deployment prefix is read in one range request (one etcd revision) and served from memory
to the same checker, so what it reports held at that revision.
"""

from __future__ import annotations

import bisect

from libs.state.codec import decode
from libs.state.store import M, Store, Versioned


class StoreSnapshot(Store):
    """A read-only Store answering `get` and `list` from one revision (writes are not offered)."""

    def __init__(self, source: Store, kvs: list[tuple[str, bytes, int, int, int]], revision: int) -> None:
        # No connection of its own: everything it answers was read by `take`.
        self.config = source.config
        self.keys = source.keys
        self.revision_read = revision
        self._kvs = sorted(kvs)
        self._keys = [kv[0] for kv in self._kvs]

    @classmethod
    async def take(cls, store: Store) -> StoreSnapshot:
        result = await store.client.get_prefix(store.keys.prefix.encode())
        kvs = [(kv.key.decode(), kv.value, kv.mod_revision, kv.create_revision, kv.lease) for kv in result]
        return cls(store, kvs, int(result.header.revision))

    def __len__(self) -> int:
        return len(self._kvs)

    async def get(self, key: str, cls: type[M], *, strict: bool = False) -> Versioned[M] | None:
        at = bisect.bisect_left(self._keys, key)
        if at == len(self._keys) or self._keys[at] != key:
            return None
        _, data, mod, create, lease = self._kvs[at]
        value = decode(data, cls, key) if strict else self._decode(key, data, cls)
        return None if value is None else Versioned(key, value, mod, create, lease)

    async def list(self, prefix: str, cls: type[M]) -> tuple[list[Versioned[M]], int]:
        items: list[Versioned[M]] = []
        for key, data, mod, create, lease in self._kvs[bisect.bisect_left(self._keys, prefix) :]:
            if not key.startswith(prefix):
                break
            value = self._decode(key, data, cls)
            if value is not None:
                items.append(Versioned(key, value, mod, create, lease))
        return items, self.revision_read
