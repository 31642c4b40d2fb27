"""Writes to the API server, read from its audit log (JSON lines, one per completed request).

Each write is attributed by its user agent: ours (`cd-controller/<identity>`, the scale hosts'
`cd-node-agent/scalesim`), Kubernetes' own (kube-scheduler, kube-controller-manager), the kubelet
shim (the Python client's default agent; the placement advisor shares it but only reads), this
benchmark playing the user, and anything else.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
OURS = ("cd-controller", "cd-node-agent")
BENCH_USER_AGENT = "formation-k8s-bench"
_CLASSES = (
    ("cd-controller", "cd-controller"),
    ("cd-node-agent", "cd-node-agent"),
    ("kube-scheduler", "kube-scheduler"),
    ("kube-controller-manager", "kube-controller-manager"),
    (BENCH_USER_AGENT, "benchmark (user)"),
    ("kubectl", "benchmark (user)"),
    ("OpenAPI-Generator", "kubelet shim"),
)


def component(user_agent: str) -> str:
    """Who made a request, from its user agent."""
    for prefix, name in _CLASSES:
        if user_agent.startswith(prefix):
            return name
    return "other"


@dataclass(frozen=True)
class Write:
    at: float  # unix seconds the API server received it
    component: str
    verb: str
    resource: str  # e.g. "computedomains/status", "nodes"
    code: int
    agent: str = ""

    @property
    def ours(self) -> bool:
        return self.component in OURS


def parse_line(line: str) -> Write | None:
    """A completed write of one audit line; None for anything else (other stages, reads)."""
    try:
        entry: dict[str, Any] = json.loads(line)
    except ValueError:
        return None
    if entry.get("stage") != "ResponseComplete" or entry.get("verb") not in WRITE_VERBS:
        return None
    ref = entry.get("objectRef") or {}
    resource = str(ref.get("resource", ""))
    if ref.get("subresource"):
        resource = f"{resource}/{ref['subresource']}"
    received = str(entry.get("requestReceivedTimestamp", "")).replace("Z", "+00:00")
    try:
        at = datetime.fromisoformat(received).timestamp()
    except ValueError:
        return None
    return Write(
        at=at,
        component=component(str(entry.get("userAgent", ""))),
        verb=str(entry["verb"]),
        resource=resource,
        code=int((entry.get("responseStatus") or {}).get("code") or 0),
        agent=str(entry.get("userAgent", "")),
    )


@dataclass
class AuditReader:
    """Reads an audit log as it grows (a line is parsed once)."""

    path: Path
    writes: list[Write] = field(default_factory=list)
    _offset: int = 0
    _partial: str = ""

    def poll(self) -> None:
        try:
            with self.path.open("r", encoding="utf-8", errors="replace") as f:
                f.seek(self._offset)
                text = f.read()
                self._offset = f.tell()
        except FileNotFoundError:
            return
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()  # an unfinished last line waits for its end
        for line in lines:
            write = parse_line(line)
            if write is not None:
                self.writes.append(write)

    def between(self, start: float, end: float) -> list[Write]:
        self.poll()
        return [w for w in self.writes if start <= w.at <= end]


def summarize(writes: list[Write], nodes: int) -> dict[str, Any]:
    """Writes of one window: ours per node, and who wrote what."""
    ours = [w for w in writes if w.ours]
    by_component = Counter(w.component for w in writes)
    breakdown = Counter(f"{w.component} {w.verb} {w.resource}" for w in ours)
    return {
        "ours": len(ours),
        "ours_per_node": round(len(ours) / nodes, 3) if nodes else 0.0,
        "ours_failed": sum(1 for w in ours if w.code >= 400),
        "ours_by_kind": dict(breakdown.most_common()),
        "all": len(writes),
        "by_component": dict(by_component.most_common()),
        "other_agents": dict(Counter(w.agent for w in writes if w.component == "other").most_common(5)),
    }


def stages(writes: list[Write], t0: float) -> dict[str, list[float]]:
    """When each kind of write happened, relative to `t0` (unix seconds): first, median and last
    of each `component verb resource` with at least one write, in order of first appearance. It
    shows where a formation waits (pods made, claims made, claims allocated, pods bound, ...)."""
    times: dict[str, list[float]] = {}
    for w in sorted(writes, key=lambda w: w.at):
        times.setdefault(f"{w.component} {w.verb} {w.resource}", []).append(w.at - t0)
    return {
        kind: [round(ts[0], 2), round(ts[len(ts) // 2], 2), round(ts[-1], 2), len(ts)]
        for kind, ts in times.items()
    }
