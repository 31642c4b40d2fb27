"""Nodes this advisor keeps out of the free sets before the store says they are taken (pure).

Two kinds: a hold, while this process writes a reservation for the nodes (released when the write
is over, whatever its outcome); and a hint, when another writer took them and our watch has not
shown it yet (dropped when the watch shows the binding or reservation, or when it expires).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class LocalHolds:
    def __init__(self) -> None:
        # node -> hold token; token -> its nodes
        self._holds: dict[str, int] = {}
        self._hold_nodes: dict[int, list[str]] = {}
        self._next_token = 1
        # node -> hint expiry, and the expiries in order
        self._hints: dict[str, float] = {}
        self._hint_heap: list[tuple[float, str]] = []

    def __contains__(self, name: str) -> bool:
        """The node is held or hinted taken."""
        return name in self._holds or name in self._hints

    def hold(self, names: list[str]) -> int:
        """Hold the nodes; the token releases them."""
        token = self._next_token
        self._next_token += 1
        self._hold_nodes[token] = names
        for name in names:
            self._holds[name] = token
        return token

    def release(self, token: int) -> list[str]:
        """The nodes the token still held (a later hold of a node keeps it)."""
        released = [n for n in self._hold_nodes.pop(token, []) if self._holds.get(n) == token]
        for name in released:
            del self._holds[name]
        return released

    def hint(self, names: Iterable[str], expiry: float) -> None:
        for name in names:
            self._hints[name] = expiry
            heapq.heappush(self._hint_heap, (expiry, name))

    def drop_hint(self, name: str) -> None:
        self._hints.pop(name, None)

    def expire(self, now: float) -> list[str]:
        """Drop the hints due at `now`; the nodes whose hint went (a renewed hint stays)."""
        expired: list[str] = []
        while self._hint_heap and self._hint_heap[0][0] <= now:
            expiry, name = heapq.heappop(self._hint_heap)
            if self._hints.get(name) == expiry:
                del self._hints[name]
                expired.append(name)
        return expired

    @property
    def hints_pending(self) -> bool:
        return bool(self._hint_heap)
