"""Each node's way through a Kubernetes formation, from a kept benchmark directory's logs.

Run `formation_k8s` with ``CD_BENCH_KEEP=1 CD_BENCH_LOG_LEVEL=debug``, then

    python -m tools.bench.k8s_timeline <the kept directory>

Per node it puts together: the pod's binding (the API server's audit log), the join and the first
prepare's wait (the node agent), the binding seen, the daemon started, READY, its status written
(the IMEX agent), the status seen and the claim prepared (the node agent), the pod Running (the
kubelet shim). It prints each step's p10/p50/p90/max over the nodes, the times of each step since
the Job's creation, and the nodes that finished last. Debug logging costs CPU: compare runs at the
same level.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from tools.bench.stats import percentile

# Log event -> step; a condition on the record where one event marks several states.
_HOST_EVENTS = {
    "prepare: node joined domain": "joined",
    "waiting for the daemon": "waiting",
    "IMEX daemon started": "started",
    "claim prepared": "prepared",
}
STEPS = ("bound", "joined", "binding_seen", "started", "ready", "written", "seen", "prepared", "running")
STAGES = (
    ("bound", "joined"),
    ("joined", "binding_seen"),
    ("binding_seen", "started"),
    ("started", "ready"),
    ("ready", "written"),
    ("written", "seen"),
    ("seen", "prepared"),
    ("prepared", "running"),
)


@dataclass
class NodeTimeline:
    node: str
    pod: str = ""
    at: dict[str, float] = field(default_factory=dict)

    def mark(self, step: str, when: float) -> None:
        self.at.setdefault(step, when)  # the first time: later ones belong to teardown or retries


def _timestamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _records(path: Path) -> Iterator[dict[str, object]]:
    with path.open() as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line from a library that does not log JSON
            if isinstance(record, dict):
                yield record


def host_step(record: dict[str, object]) -> str | None:
    """The step a scale host's log record marks (None: none)."""
    event = record.get("event")
    if event in _HOST_EVENTS:
        return _HOST_EVENTS[str(event)]
    if event == "IMEX daemon state" and record.get("state") == "READY":
        return "ready"
    if event == "daemon status written" and record.get("state") == "READY":
        return "written"
    if event == "daemon status seen" and record.get("state") == "READY":
        return "seen"
    if event == "binding seen" and record.get("cd_uid"):
        return "binding_seen"
    return None


def collect(base: Path) -> tuple[float, dict[str, NodeTimeline]]:
    """(the Job's creation time, each node's timeline) from a kept formation_k8s directory."""
    job_created = 0.0
    bound: dict[str, float] = {}
    for record in _records(base / "audit.log"):
        uri = str(record.get("requestURI", ""))
        ref = record.get("objectRef") or {}
        if record.get("verb") != "create" or not isinstance(ref, dict):
            continue
        if uri.endswith("/binding"):
            bound[str(ref.get("name"))] = _timestamp(str(record["stageTimestamp"]))
        elif ref.get("resource") == "jobs" and not ref.get("subresource") and not job_created:
            job_created = _timestamp(str(record["requestReceivedTimestamp"]))
    nodes: dict[str, NodeTimeline] = {}

    def node(name: object) -> NodeTimeline:
        return nodes.setdefault(str(name), NodeTimeline(str(name)))

    for record in _records(base / "kubeletshim.log"):
        if record.get("event") == "claims prepared" and not node(record.get("node")).pod:
            node(record.get("node")).pod = str(record.get("pod", "")).rpartition("/")[2]
        elif record.get("event") == "pod running":
            node(record.get("node")).mark("running", _timestamp(str(record["timestamp"])))
    for log in sorted(base.glob("host*.log")):
        for record in _records(log):
            step = host_step(record)
            if step is not None and record.get("node"):
                node(record["node"]).mark(step, _timestamp(str(record["timestamp"])))
    for timeline in nodes.values():
        if timeline.pod in bound:
            timeline.mark("bound", bound[timeline.pod])
    return job_created, {name: t for name, t in nodes.items() if t.pod}


def report(job_created: float, nodes: dict[str, NodeTimeline], last: int = 5) -> str:
    lines = [f"{len(nodes)} nodes"]
    for a, b in STAGES:
        spans = [t.at[b] - t.at[a] for t in nodes.values() if a in t.at and b in t.at]
        if spans:
            lines.append(
                f"{a:>12} -> {b:<12} n={len(spans):4d} p10 {percentile(spans, 10):6.2f}  "
                f"p50 {percentile(spans, 50):6.2f}  p90 {percentile(spans, 90):6.2f}  max {max(spans):6.2f} s"
            )
    if job_created:
        lines.append("since the Job's creation:")
        for step in STEPS:
            times = [t.at[step] - job_created for t in nodes.values() if step in t.at]
            if times:
                lines.append(
                    f"{step:>12}  first {min(times):6.2f}  p50 {percentile(times, 50):6.2f}  "
                    f"p90 {percentile(times, 90):6.2f}  last {max(times):6.2f} s"
                )
        lines.append("last to run:")
        ordered = sorted(nodes.values(), key=lambda t: t.at.get("running", float("inf")))
        for t in ordered[-last:]:
            steps = " ".join(f"{s}={t.at[s] - job_created:.2f}" for s in STEPS if s in t.at)
            lines.append(f"  {t.node}: {steps}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k8s_timeline", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("directory", type=Path, help="a formation_k8s directory kept with CD_BENCH_KEEP=1")
    args = parser.parse_args(argv)
    if not (args.directory / "audit.log").is_file():
        parser.error(f"{args.directory} has no audit.log: not a kept formation_k8s directory")
    job_created, nodes = collect(args.directory)
    if not nodes:
        print(f"no node finished a prepare in {args.directory}'s logs", file=sys.stderr)
        return 1
    print(report(job_created, nodes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
