"""When a daemon gives up on a peer it lost: ``IMEX_NODE_DISCONNECTED_GRACE_TIME`` (pure).

NVIDIA's IMEX guide ("Connections, Quorum, and Clean up", and the key's description in the
config file): a daemon that loses its connection to a node keeps every reference to it. If the
connection comes back to the *same* instance, nothing is cleaned up; a *new* instance is cleaned
up at once (``ImportTable.exporter_seen``). With the grace time set, the imports and exports of a
node that stayed disconnected that long are cleaned up: -1 (the default) waits forever, 0 cleans
up at once, N > 0 after N seconds.

A node counts as connected while any link with it is open (this daemon's outgoing link or one of
the node's incoming links): SIGUSR1 re-dials only the outgoing links, so a daemon that restarts
its connections does not look disconnected to anyone. Only a node that was connected in this
instance's life can be lost; a node never reached holds no reference.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable


class DisconnectClock:
    """Per peer node ID: since when it is disconnected, and whether its grace time ran out."""

    __slots__ = ("cleaned", "grace_s", "since")

    def __init__(self, grace_s: int) -> None:
        self.grace_s = grace_s  # < 0: wait forever
        self.since: dict[int, float] = {}  # node ID -> when it was first seen disconnected
        self.cleaned: set[int] = set()  # grace ran out; until the node is connected again

    @property
    def enabled(self) -> bool:
        return self.grace_s >= 0

    def observe(self, connected: Iterable[int], known: Iterable[int], now: float) -> list[int]:
        """Feed which of the `known` (once connected) nodes are connected now; return the nodes
        whose grace time ran out just now (clean them up once)."""
        up = set(connected)
        expired = []
        for node_id in known:
            if node_id in up:
                self.since.pop(node_id, None)
                self.cleaned.discard(node_id)
                continue
            since = self.since.setdefault(node_id, now)
            if self.enabled and node_id not in self.cleaned and now - since >= self.grace_s:
                self.cleaned.add(node_id)
                expired.append(node_id)
        return expired

    def next_deadline(self) -> float | None:
        """When the earliest pending grace time runs out (None: nothing pending)."""
        if not self.enabled:
            return None
        pending = [t + self.grace_s for n, t in self.since.items() if n not in self.cleaned]
        return min(pending) if pending else None
