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
    # when the job's workload had imported memory from every other member, and how many imports
    imported_ms: int = 0
    imports: int = 0

    def _at(self, ms: int) -> str:
        return f"{max(0, ms - self.started_ms):>7d} ms"

    def lines(self, total_nodes: int) -> list[str]:
        """The milestones in time order."""
        events: list[tuple[int, str]] = []
        if self.placed_ms:
            events.append((self.placed_ms, f"placed: {self.placement_note}"))
        if self.created_ms:
            events.append((self.created_ms, f"created: {self.created_note}"))
        if self.joined:
            first_node, (first_ms, first_index) = min(self.joined.items(), key=lambda kv: kv[1][0])
            last_ms = max(ms for ms, _ in self.joined.values())
            events.append((first_ms, f"first node joined the domain: {first_node} (index {first_index})"))
            events.append((last_ms, f"{len(self.joined)}/{total_nodes} nodes joined"))
        if self.daemon_ready:
            first_node, first_ms = min(self.daemon_ready.items(), key=lambda kv: kv[1])
            events.append((first_ms, f"first IMEX daemon READY: {first_node}"))
            events.append(
                (
                    max(self.daemon_ready.values()),
                    f"{len(self.daemon_ready)}/{total_nodes} IMEX daemons READY",
                )
            )
        if self.prepared:
            last_ms = max(ms for ms, _ in self.prepared.values())
            retried = sum(1 for _, attempts in self.prepared.values() if attempts > 1)
            extra = f" ({retried} needed kubelet retries)" if retried else " (no retries)"
            events.append((last_ms, f"{len(self.prepared)}/{total_nodes} channel claims prepared{extra}"))
        if self.domain_ready_ms:
            events.append((self.domain_ready_ms, "ComputeDomain status: Ready"))
        if self.imported_ms:
            events.append(
                (self.imported_ms, f"workload imported memory: {self.imports} imports between members")
            )
        # Stable sort: equal times keep the causal order they were listed in.
        return [f"{self._at(ms)}  {text}" for ms, text in sorted(events, key=lambda e: e[0])]
