"""What the soak checks, besides the invariant checker of `libs.invariants.checker`.

* invariants 1-3 on one consistent snapshot of the store (they must hold at every instant);
* no IMEX daemon left running for a domain its node is no longer in (at quiescence);
* that no service died other than by the soak's own hand (restarts beyond the kills it made);
* which error lines the services logged (reported, not judged: faults cause some).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from libs.gen.computedomain.state import v1 as pb
from libs.invariants import checker as invariants
from libs.state.store import Store
from tools.cdsim import proc_scan
from tools.cdsim.layout import StateLayout
from tools.chaos.snapshot import StoreSnapshot

_ERROR_LEVELS = ("error", "critical", "exception")


async def instant_violations(store: Store) -> tuple[list[str], int]:
    """Invariants 1-3 at one store revision: (violations, revision)."""
    snapshot = await StoreSnapshot.take(store)
    violations = await invariants.check_store_invariants(snapshot, quiescent=False)
    return violations, snapshot.revision_read


async def quiescent_violations(store: Store, nodes: Iterable[invariants.NodeLocalPaths]) -> list[str]:
    """Invariants 1-4 (with the nodes' config files) at one store revision."""
    snapshot = await StoreSnapshot.take(store)
    return await invariants.check_store_invariants(snapshot, quiescent=True, nodes=nodes)


async def members_and_daemons(
    store: Store,
) -> tuple[dict[tuple[str, str], pb.Member], dict[tuple[str, str], pb.DaemonStatus]]:
    """Every member and daemon record by (domain uid, node), from one store revision."""
    snapshot = await StoreSnapshot.take(store)
    members, _ = await snapshot.list(store.keys.all_members(), pb.Member)
    daemons, _ = await snapshot.list(store.keys.all_daemons(), pb.DaemonStatus)
    return (
        {(m.value.domain_uid, m.value.node_name): m.value for m in members},
        {(d.value.domain_uid, d.value.node_name): d.value for d in daemons},
    )


def _daemon_domain(argv: tuple[str, ...], imex_dir: Path) -> str | None:
    """The domain uid of a simulated IMEX daemon: its config lies in <imex dir>/<uid>/."""
    prefix = str(imex_dir).rstrip("/") + "/"
    for arg in argv:
        if arg.startswith(prefix):
            return Path(arg).relative_to(imex_dir).parts[0]
    return None


async def stray_daemons(store: Store, layout: StateLayout, nodes: Iterable[str]) -> list[str]:
    """IMEX daemons that serve a domain their node is not a member of (a leftover that holds the
    node's IMEX port, so the node's next domain cannot form). A LOST member keeps its daemon."""
    snapshot = await StoreSnapshot.take(store)
    members, _ = await snapshot.list(store.keys.all_members(), pb.Member)
    kept = (pb.MemberState.ACTIVE, pb.MemberState.LOST)
    active = {(m.value.domain_uid, m.value.node_name) for m in members if m.value.state in kept}
    found = []
    running = [p for p in proc_scan.list_processes() if proc_scan.IMEX_DAEMON_MARKER in p.command]
    for node in nodes:
        imex_dir = layout.node(node).imex_dir
        for process in running:
            uid = _daemon_domain(process.argv, imex_dir)
            if uid is not None and (uid, node) not in active:
                found.append(
                    f"inv5: IMEX daemon pid {process.pid} on {node} serves domain {uid}, "
                    f"of which {node} is not a member"
                )
    return found


@dataclass(frozen=True)
class ProcessCount:
    restarts: int
    last_exit: str
    running: bool
    healthy: bool


def process_counts(state: Mapping[str, Any]) -> dict[str, ProcessCount]:
    """Per process, from the supervisor's status answer."""
    out = {}
    for name, info in (state.get("processes") or {}).items():
        out[name] = ProcessCount(
            int(info.get("restarts") or 0),
            str(info.get("last_exit") or ""),
            bool(info.get("running")),
            bool(info.get("healthy")),
        )
    return out


def unexplained_restarts(
    baseline: Mapping[str, ProcessCount],
    now: Mapping[str, ProcessCount],
    caused: Mapping[str, int],
) -> list[str]:
    """Processes restarted more often than the soak killed (or restarted) them: they crashed."""
    found = []
    for name, current in sorted(now.items()):
        before = baseline.get(name, ProcessCount(0, "", True, True)).restarts
        extra = current.restarts - before - caused.get(name, 0)
        if extra > 0:
            found.append(
                f"crash: {name} restarted {extra} time(s) more than the soak killed it "
                f"(last exit: {current.last_exit or 'unknown'})"
            )
    return found


def not_running(now: Mapping[str, ProcessCount]) -> list[str]:
    return sorted(name for name, p in now.items() if not (p.running and p.healthy))


def _event_of(line: str) -> tuple[str, str] | None:
    """(level, event) of a JSON log line at error level or worse; None otherwise."""
    if '"level"' not in line:
        return None
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    level = str(doc.get("level", "")).lower()
    if level not in _ERROR_LEVELS:
        return None
    # structlog names the message "event"; etcd (zap) names it "msg".
    return level, str(doc.get("event") or doc.get("msg") or "")[:120]


def _kind_of(log_name: str) -> str:
    """agent-rack0-tray3 -> agent (the kubelet plugin); imex-rack0-tray3 -> imex-agent;
    controller-1 -> controller."""
    if log_name.startswith("imex-"):
        return "imex-agent"
    for kind in ("agent", "controller", "advisor"):
        if log_name.startswith(kind):
            return kind
    return log_name


def error_log_lines(layout: StateLayout) -> Counter[str]:
    """`<service kind>: <level> <event>` -> count, over every service log, plus Python tracebacks."""
    counts: Counter[str] = Counter()
    for path in sorted(layout.logs_dir.glob("*.log")):
        kind = _kind_of(path.stem)
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("Traceback"):
                counts[f"{kind}: uncaught traceback"] += 1
                continue
            found = _event_of(line)
            if found is not None:
                counts[f"{kind}: {found[0]} {found[1]}"] += 1
    return counts


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
