"""What `cdctl get KIND` shows: table rows and JSON documents from a snapshot (pure)."""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import betterproto

from libs.gen.computedomain.state import v1 as pb
from tools.cdctl.snapshot import Snapshot

KINDS = ("domains", "members", "nodes", "cliques", "reservations", "daemons")
ALIASES = {
    "domain": "domains",
    "cd": "domains",
    "cds": "domains",
    "computedomains": "domains",
    "member": "members",
    "node": "nodes",
    "clique": "cliques",
    "reservation": "reservations",
    "daemon": "daemons",
}


@dataclass(frozen=True)
class View:
    headers: list[str]
    rows: list[list[str]]
    documents: list[dict[str, Any]]


def _field_value(value: Any, enum_cls: type[enum.Enum] | None) -> Any:
    if isinstance(value, betterproto.Message):
        return document(value)
    if isinstance(value, list):
        return [_field_value(v, enum_cls) for v in value]
    if enum_cls is not None:
        try:
            return enum_cls(value).name
        except ValueError:
            return int(value)
    if isinstance(value, bytes):
        return value.hex()
    return value


def document(message: betterproto.Message) -> dict[str, Any]:
    """A message as a JSON-ready dict: snake_case field names, enums by name, integers as numbers."""
    meta: Any = getattr(message, "_betterproto")  # noqa: B009 - untyped generated metadata
    out: dict[str, Any] = {}
    for name, field_meta in meta.meta_by_field_name.items():
        enum_cls = meta.cls_by_field.get(name) if field_meta.proto_type == "enum" else None
        out[name] = _field_value(getattr(message, name), enum_cls)
    return out


def age(since_ms: int, now_ms: int) -> str:
    if since_ms <= 0:
        return "-"
    seconds = max(0, (now_ms - since_ms) // 1000)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


def short_clique(clique: str) -> str:
    """`<cluster uuid>.<clique id>` shortened to `<first 8 of uuid>….<clique id>` for tables."""
    if not clique:
        return "-"
    cluster, _, clique_id = clique.rpartition(".")
    return f"{cluster[:8]}….{clique_id}" if cluster else clique


def enum_name(value: enum.Enum | int) -> str:
    if isinstance(value, enum.Enum):
        return value.name or str(value.value)
    return str(value)


def ready_condition(domain: pb.ComputeDomain) -> pb.Condition | None:
    return next((c for c in domain.status.conditions if c.type == "Ready"), None)


def readiness(value: pb.Readiness) -> str:
    return "Ready" if value == pb.Readiness.READY else "NotReady"


def domains_view(snap: Snapshot, now_ms: int, namespace: str | None) -> View:
    members_of: dict[str, list[pb.Member]] = defaultdict(list)
    for m in snap.members:
        members_of[m.domain_uid].append(m)
    chosen = sorted(
        (d for d in snap.domains if namespace is None or d.namespace == namespace),
        key=lambda d: (d.namespace, d.name),
    )
    rows = []
    for d in chosen:
        condition = ready_condition(d)
        ready = sum(1 for n in d.status.nodes if n.status == pb.Readiness.READY)
        status = readiness(d.status.status) + (" (deleting)" if d.deleting else "")
        rows.append(
            [
                d.namespace,
                d.name,
                status,
                f"{ready}/{len(members_of[d.uid])}",
                str(d.spec.num_nodes),
                condition.reason if condition else "-",
                age(d.created_unix_ms, now_ms),
                d.uid,
            ]
        )
    headers = ["NAMESPACE", "NAME", "STATUS", "READY", "NUMNODES", "REASON", "AGE", "UID"]
    return View(headers, rows, [document(d) for d in chosen])


def members_view(snap: Snapshot, now_ms: int, namespace: str | None) -> View:
    chosen = sorted(
        (m for m in snap.members if namespace is None or m.namespace == namespace),
        key=lambda m: (snap.domain_label(m.domain_uid), m.clique_id, m.index, m.node_name),
    )
    rows = [
        [
            snap.domain_label(m.domain_uid),
            m.node_name,
            short_clique(m.clique_id),
            str(m.index),
            enum_name(m.state),
            m.ip_address,
            age(m.joined_unix_ms, now_ms),
        ]
        for m in chosen
    ]
    return View(
        ["DOMAIN", "NODE", "CLIQUE", "INDEX", "STATE", "ADDRESS", "AGE"], rows, [document(m) for m in chosen]
    )


def nodes_view(snap: Snapshot, now_ms: int, namespace: str | None) -> View:
    del namespace  # nodes are cluster-scoped
    chosen = sorted(snap.nodes, key=lambda n: n.name)
    rows = []
    for n in chosen:
        bound = snap.bindings.get(n.name, "")
        rows.append(
            [
                n.name,
                n.ip_address,
                short_clique(n.clique_id),
                enum_name(n.health),
                str(len(n.gpus)),
                snap.domain_label(bound) if bound else "-",
                n.agent_version or "-",
                age(n.registered_unix_ms, now_ms),
            ]
        )
    docs = [{**document(n), "domain_uid": snap.bindings.get(n.name, "")} for n in chosen]
    return View(["NAME", "ADDRESS", "CLIQUE", "HEALTH", "GPUS", "DOMAIN", "AGENT", "AGE"], rows, docs)


def cliques_view(snap: Snapshot, now_ms: int, namespace: str | None) -> View:
    del now_ms, namespace
    reserved = {name for r in snap.reservations for name in r.node_names}
    groups: dict[str, list[pb.Node]] = defaultdict(list)
    for n in snap.nodes:
        groups[n.clique_id].append(n)
    rows = []
    docs = []
    for clique, nodes in sorted(groups.items()):
        healthy = [n for n in nodes if n.health == pb.Health.HEALTHY]
        bound = [n for n in nodes if n.name in snap.bindings]
        held = [n for n in nodes if n.name in reserved and n.name not in snap.bindings]
        free = [n for n in healthy if n.name not in snap.bindings and n.name not in reserved]
        domains = sorted({snap.domain_label(snap.bindings[n.name]) for n in bound})
        rows.append(
            [
                clique or "(non-fabric)",
                str(len(nodes)),
                str(len(healthy)),
                str(len(bound)),
                str(len(held)),
                str(len(free)),
                ",".join(domains) or "-",
            ]
        )
        docs.append(
            {
                "clique_id": clique,
                "nodes": len(nodes),
                "healthy": len(healthy),
                "bound": len(bound),
                "reserved": len(held),
                "free": len(free),
                "domains": domains,
            }
        )
    return View(["CLIQUE", "NODES", "HEALTHY", "BOUND", "RESERVED", "FREE", "DOMAINS"], rows, docs)


def reservations_view(snap: Snapshot, now_ms: int, namespace: str | None) -> View:
    del namespace
    chosen = sorted(snap.reservations, key=lambda r: r.created_unix_ms)
    rows = [
        [
            r.id,
            str(len(r.node_names)),
            ",".join(short_clique(c) for c in r.clique_ids) or "-",
            snap.domain_label(r.domain_uid) if r.domain_uid else "-",
            r.holder or "-",
            f"{r.ttl_seconds}s",
            age(r.created_unix_ms, now_ms),
        ]
        for r in chosen
    ]
    return View(
        ["ID", "NODES", "CLIQUES", "DOMAIN", "HOLDER", "TTL", "AGE"], rows, [document(r) for r in chosen]
    )


def daemons_view(snap: Snapshot, now_ms: int, namespace: str | None) -> View:
    namespaces = {d.uid: d.namespace for d in snap.domains}
    chosen = sorted(
        (d for d in snap.daemons if namespace is None or namespaces.get(d.domain_uid) == namespace),
        key=lambda d: (snap.domain_label(d.domain_uid), d.node_name),
    )
    rows = [
        [
            snap.domain_label(d.domain_uid),
            d.node_name,
            enum_name(d.state),
            str(d.pid or "-"),
            str(d.restarts),
            str(len(d.peers)),
            (d.last_error[:60] or "-"),
            age(d.updated_unix_ms, now_ms),
        ]
        for d in chosen
    ]
    headers = ["DOMAIN", "NODE", "STATE", "PID", "RESTARTS", "PEERS", "LAST ERROR", "UPDATED"]
    return View(headers, rows, [document(d) for d in chosen])


BUILDERS: dict[str, Callable[[Snapshot, int, str | None], View]] = {
    "domains": domains_view,
    "members": members_view,
    "nodes": nodes_view,
    "cliques": cliques_view,
    "reservations": reservations_view,
    "daemons": daemons_view,
}


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = ["   ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["   ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines)
