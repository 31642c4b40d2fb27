"""The timeline a job submission prints: what happened when, in ms after `submit` (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SubmitTimeline:
    """Wall-clock milliseconds of the milestones of one submission."""

    started_ms: int
    placed_ms: int = 0
    placement_note: str = ""
    created_ms: int = 0
    created_note: str = ""
    # node -> when it became a member (Member.joined_unix_ms) and its index
    joined: dict[str, tuple[int, int]] = field(default_factory=dict)
    # node -> when its IMEX daemon was first seen READY
    daemon_ready: dict[str, int] = field(default_factory=dict)
    # node -> when kubelet's prepare succeeded, and how many calls it took
    prepared: dict[str, tuple[int, int]] = field(default_factory=dict)
    domain_ready_ms: int = 0

    def _at(self, ms: int) -> str:
        return f"{max(0, ms - self.started_ms):>7d} ms"

    def lines(self, total_nodes: int) -> list[str]:
        out: list[str] = []
        if self.placed_ms:
            out.append(f"{self._at(self.placed_ms)}  placed: {self.placement_note}")
        if self.created_ms:
            out.append(f"{self._at(self.created_ms)}  created: {self.created_note}")
        if self.joined:
            first_node, (first_ms, first_index) = min(self.joined.items(), key=lambda kv: kv[1][0])
            last_ms = max(ms for ms, _ in self.joined.values())
            out.append(
                f"{self._at(first_ms)}  first node joined the domain: {first_node} (index {first_index})"
            )
            out.append(f"{self._at(last_ms)}  {len(self.joined)}/{total_nodes} nodes joined")
        if self.daemon_ready:
            first_node, first_ms = min(self.daemon_ready.items(), key=lambda kv: kv[1])
            last_ms = max(self.daemon_ready.values())
            out.append(f"{self._at(first_ms)}  first IMEX daemon READY: {first_node}")
            out.append(f"{self._at(last_ms)}  {len(self.daemon_ready)}/{total_nodes} IMEX daemons READY")
        if self.prepared:
            last_ms = max(ms for ms, _ in self.prepared.values())
            retried = sum(1 for _, attempts in self.prepared.values() if attempts > 1)
            extra = f" ({retried} needed kubelet retries)" if retried else " (no retries)"
            out.append(
                f"{self._at(last_ms)}  {len(self.prepared)}/{total_nodes} channel claims prepared{extra}"
            )
        if self.domain_ready_ms:
            out.append(f"{self._at(self.domain_ready_ms)}  ComputeDomain status: Ready")
        return out
