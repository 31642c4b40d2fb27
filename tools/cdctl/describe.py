"""`cdctl describe domain`: a domain's spec, status and, when it is not Ready, why (pure)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from libs.gen.computedomain.state import v1 as pb
from tools.cdctl.snapshot import Snapshot
from tools.cdctl.views import age, enum_name, format_table, readiness, ready_condition

LOG_LINES_SHOWN = 5


def _when(ms: int) -> str:
    if ms <= 0:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def claims_of(snap: Snapshot, domain_uid: str) -> list[pb.Claim]:
    """Claim records whose opaque config names this domain."""
    out = []
    for claim in snap.claims:
        for config in claim.config:
            try:
                params = json.loads(config.parameters_json)
            except ValueError:
                continue
            if isinstance(params, dict) and params.get("domainID") == domain_uid:
                out.append(claim)
                break
    return out


def reasons_not_ready(snap: Snapshot, domain: pb.ComputeDomain) -> list[str]:
    """Each thing that keeps the domain from being Ready, most basic first, with what to check."""
    reasons: list[str] = []
    members = [m for m in snap.members if m.domain_uid == domain.uid]
    active = [m for m in members if m.state == pb.MemberState.ACTIVE]
    daemons = {d.node_name: d for d in snap.daemons if d.domain_uid == domain.uid}
    prepared = {
        p.claim_uid
        for p in snap.preparations
        if p.domain_uid == domain.uid and p.state == pb.PreparedState.PREPARE_COMPLETED
    }
    if domain.deleting:
        holders = sorted({p.node_name for p in snap.preparations if p.domain_uid == domain.uid})
        reasons.append(
            f"being deleted: {len(members)} member(s) still in it"
            + (
                f", claims still prepared on {', '.join(holders)} (workloads must release them)"
                if holders
                else ""
            )
        )
    for m in sorted(members, key=lambda m: m.node_name):
        node = snap.node(m.node_name)
        if m.state == pb.MemberState.LOST:
            reasons.append(
                f"{m.node_name}: node lost - its IMEX agent's lease expired and no peer reports it connected "
                f"(node down, or cut off from etcd and its peers); it keeps index {m.index} for its return. "
                f"Check the node and cd-imex-agent on {m.node_name}."
            )
            continue
        if node is None:
            reasons.append(
                f"{m.node_name}: node record lapsed (cd-imex-agent down or cut off from etcd); not lost while "
                f"its peers report it connected"
            )
            continue
        if node.health not in (pb.Health.HEALTHY, pb.Health.UNKNOWN):
            reasons.append(
                f"{m.node_name}: GPU health {enum_name(node.health)} ({node.fabric_message or 'no detail'})"
            )
        if not m.clique_id:
            continue  # non-fabric node: no IMEX daemon
        daemon = daemons.get(m.node_name)
        if daemon is None:
            reasons.append(f"{m.node_name}: no IMEX daemon status yet (its IMEX agent has not started it)")
        elif daemon.state != pb.DaemonState.READY:
            text = f"{m.node_name}: IMEX daemon {enum_name(daemon.state)}"
            if daemon.reason:
                text += f" ({daemon.reason})"
            if daemon.restarts:
                text += f" after {daemon.restarts} restart(s)"
            if daemon.last_error:
                text += f": {daemon.last_error}"
            lines = list(daemon.last_log_lines)[-LOG_LINES_SHOWN:]
            if lines:
                text += "\n      last log lines:\n" + "\n".join(f"        {line}" for line in lines)
            reasons.append(text)
    if domain.spec.num_nodes > len(active):
        pending = [c for c in claims_of(snap, domain.uid) if c.uid not in prepared]
        text = f"waiting for nodes: {len(active)} of numNodes={domain.spec.num_nodes} active"
        if pending:
            names = ", ".join(sorted(c.node_name for c in pending)[:8])
            text += (
                f"; claims not prepared yet on {names} (kubelet has not prepared them or they keep failing)"
            )
        reasons.append(text)
    elif not active and not domain.deleting:
        reasons.append("no node has joined yet: no channel claim of this domain has been prepared")
    return reasons


def describe_domain(snap: Snapshot, domain: pb.ComputeDomain, now_ms: int) -> str:
    mode = "All" if domain.spec.channel.allocation_mode == pb.AllocationMode.ALL else "Single"
    lines = [
        f"Name:          {domain.name}",
        f"Namespace:     {domain.namespace}",
        f"UID:           {domain.uid}",
        f"Source:        {domain.source or '-'}",
        f"Created:       {_when(domain.created_unix_ms)} ({age(domain.created_unix_ms, now_ms)} ago)",
        f"Spec:          numNodes={domain.spec.num_nodes}, channel template "
        f"{domain.spec.channel.resource_claim_template_name or '-'}, allocationMode={mode}",
        f"Status:        {readiness(domain.status.status)}"
        + ("  (deletion requested)" if domain.deleting else ""),
        "Conditions:",
    ]
    if not domain.status.conditions:
        lines.append("  (none yet: the controller has not computed a status)")
    for c in domain.status.conditions:
        lines.append(
            f"  {c.type}={c.status}  {c.reason}: {c.message}  (since {age(c.last_transition_unix_ms, now_ms)})"
        )
    members = sorted(
        (m for m in snap.members if m.domain_uid == domain.uid),
        key=lambda m: (m.clique_id, m.index, m.node_name),
    )
    daemons = {d.node_name: d for d in snap.daemons if d.domain_uid == domain.uid}
    shown = {n.name: n for n in domain.status.nodes}
    lines.append(f"Nodes ({len(members)}):")
    if members:
        rows = []
        for m in members:
            d = daemons.get(m.node_name)
            rows.append(
                [
                    m.node_name,
                    str(m.index),
                    m.ip_address,
                    enum_name(m.state),
                    readiness(shown[m.node_name].status) if m.node_name in shown else "-",
                    enum_name(d.state) if d else "-",
                    str(d.restarts) if d else "-",
                    (d.last_error[:50] if d and d.last_error else "-"),
                ]
            )
        table = format_table(
            ["NODE", "INDEX", "ADDRESS", "MEMBER", "STATUS", "IMEX", "RESTARTS", "LAST ERROR"], rows
        )
        lines += [f"  {line}" for line in table.splitlines()]
    claims = claims_of(snap, domain.uid)
    prepared = sum(
        1
        for p in snap.preparations
        if p.domain_uid == domain.uid and p.state == pb.PreparedState.PREPARE_COMPLETED
    )
    lines.append(f"Claims:        {len(claims)} allocated, {prepared} prepared")
    if domain.status.status == pb.Readiness.READY and not domain.deleting:
        lines.append("Ready: every member's IMEX daemon is READY.")
        return "\n".join(lines)
    reasons = reasons_not_ready(snap, domain)
    lines.append("Why not Ready:")
    if not reasons:
        condition = ready_condition(domain)
        reasons = [
            f"{condition.reason}: {condition.message}" if condition else "the controller has not reported yet"
        ]
    lines += [f"  - {r}" for r in reasons]
    return "\n".join(lines)
