"""Domain status as ``nvidia-imex-ctl -N`` reports it, built from each daemon's own status (pure).

JSON shape (``-N -j``), mimicking nvidia-imex-ctl::

    {"nodes": {"0": {"status": "READY", "host": "10.0.0.1", "hostName": "node-a",   # -H only
                     "connections": {"0": {"host": "10.0.0.1", "status": "CONNECTED",
                                           "changed": true}, ...},
                     "changed": true, "version": "..."}, ...},
     "timestamp": "9/4/2026 00:37:39.905", "status": "UP"}

Nodes are keyed by their index (line number in the nodes config). A node whose daemon cannot be
queried is ``UNAVAILABLE`` with every connection ``INVALID``. Domain status: ``UP`` when every
node is READY and fully connected, ``DOWN`` when no node is READY, else ``DEGRADED``. The
simulator adds ``reason`` to a connection that is not up (an additive field). ``changed`` is
always true: a single ``-N`` query has no previous report to compare with.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from libs.imex.simulator import protocol as proto

DOMAIN_UP = "UP"
DOMAIN_DEGRADED = "DEGRADED"
DOMAIN_DOWN = "DOWN"


@dataclass(frozen=True)
class DaemonStatus:
    """What one daemon reports about itself (reply to the STATUS command)."""

    state: str
    pid: int
    address: str
    domain_id: str
    version: str
    hostname: str
    nodes: tuple[str, ...]
    connections: Mapping[str, str] = field(default_factory=dict)  # peer address -> CONN_* status
    reasons: Mapping[str, str] = field(default_factory=dict)  # peer address -> why it is not up
    dropped: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        return self.state == proto.STATE_READY

    @classmethod
    def from_fields(cls, fields: Mapping[str, str]) -> DaemonStatus:
        """Build from the fields of a STATUS reply. Raises ValueError if one is malformed."""
        try:
            pid = int(fields.get("pid", "0"))
        except ValueError:
            raise ValueError(f"bad pid {fields.get('pid')!r} in STATUS reply") from None
        return cls(
            state=fields.get("state", proto.STATE_UNAVAILABLE),
            pid=pid,
            address=fields.get("addr", ""),
            domain_id=fields.get("domain", ""),
            version=fields.get("version", ""),
            hostname=fields.get("host", ""),
            nodes=_split(fields.get("nodes", "")),
            connections={k[5:]: v for k, v in fields.items() if k.startswith("conn.")},
            reasons={k[4:]: v for k, v in fields.items() if k.startswith("why.")},
            dropped=_split(fields.get("dropped", "")),
        )


def build_nodes_report(
    addresses: Sequence[str],
    statuses: Sequence[DaemonStatus | None],
    *,
    now: float | None = None,
    with_hostnames: bool = False,
) -> dict[str, Any]:
    """Return the ``-N -j`` document for the nodes at ``addresses`` (index order).

    ``statuses[i]`` is node i's own report, or None when its daemon could not be queried.
    """
    if len(addresses) != len(statuses):
        raise ValueError("one status (or None) per address is required")
    nodes: dict[str, Any] = {}
    for index, (address, status) in enumerate(zip(addresses, statuses, strict=True)):
        connections: dict[str, Any] = {}
        for peer_index, peer in enumerate(addresses):
            conn_status = proto.CONN_INVALID
            if status is not None:
                conn_status = (
                    proto.CONN_CONNECTED if peer == address else status.connections.get(peer, conn_status)
                )
            entry: dict[str, Any] = {"host": peer, "status": conn_status, "changed": True}
            if status is not None and conn_status != proto.CONN_CONNECTED and status.reasons.get(peer):
                entry["reason"] = status.reasons[peer]
            connections[str(peer_index)] = entry
        node: dict[str, Any] = {
            "status": status.state if status is not None else proto.STATE_UNAVAILABLE,
            "host": address,
        }
        if with_hostnames:
            node["hostName"] = (status.hostname if status is not None else "") or address
        node["connections"] = connections
        node["changed"] = True
        node["version"] = status.version if status is not None else ""
        nodes[str(index)] = node
    return {"nodes": nodes, "timestamp": format_timestamp(now), "status": domain_state(nodes)}


def domain_state(nodes: Mapping[str, Any]) -> str:
    """UP / DEGRADED / DOWN for the ``nodes`` part of a report."""
    entries = list(nodes.values())
    ready = [node for node in entries if node["status"] == proto.STATE_READY]
    if not ready:
        return DOMAIN_DOWN
    fully_connected = all(
        conn["status"] == proto.CONN_CONNECTED for node in entries for conn in node["connections"].values()
    )
    if len(ready) == len(entries) and fully_connected:
        return DOMAIN_UP
    return DOMAIN_DEGRADED


def format_timestamp(now: float | None = None) -> str:
    """nvidia-imex-ctl's timestamp style: ``M/D/YYYY HH:MM:SS.mmm`` (local time)."""
    moment = time.time() if now is None else now
    local = time.localtime(moment)
    millis = int(moment * 1000) % 1000
    return f"{local.tm_mon}/{local.tm_mday}/{local.tm_year} {time.strftime('%H:%M:%S', local)}.{millis:03d}"


def format_nodes_table(report: Mapping[str, Any]) -> str:
    """Human-readable ``-N`` output (legend, node list, connectivity matrix, domain state)."""
    nodes: Mapping[str, Any] = report["nodes"]
    order = sorted(nodes, key=int)
    lines = [
        "Connectivity Table Legend:",
        "I - Invalid - Node wasn't reachable, no connection status available",
        "N - Never Connected",
        "D - Disconnected - Connection was lost",
        "!M! - Node map mismatch (peer of another domain), communication disabled.",
        "C - Connected - Ready for operation",
        "",
        str(report["timestamp"]),
        "Nodes:",
    ]
    for key in order:
        node = nodes[key]
        host = node["host"] + (f" ({node['hostName']})" if node.get("hostName") else "")
        lines.append(f"Node #{key:<3} - {host:<15} - {node['status']:<20} - Version: {node['version']}")
    lines.append("")
    lines.append(" Nodes From\\To  " + "".join(f"{key:<4}" for key in order))
    for key in order:
        row = nodes[key]["connections"]
        cells = "".join(f"{proto.CONN_LEGEND.get(row[col]['status'], '?'):<4}" for col in order)
        lines.append(f"{key:>8}        {cells}")
    lines.append("")
    lines.append(f"Domain State: {report['status']}")
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _split(value: str) -> tuple[str, ...]:
    return tuple(item for item in value.split(",") if item)
