"""One daemon's view of its IMEX domain, as ``nvidia-imex-ctl -N`` shows it (pure).

``DaemonStatus`` is the parsed reply to the STATUS command: the daemon's state, its node ID and
instance, its node map (the names of the nodes config) and, per node ID, the address the name
resolved to, the connection status, why it is not up and the peer's instance.

JSON shape of ``-N -j``, nvidia-imex-ctl's shape with this daemon's row filled in::

    {"nodes": {"0": {"status": "READY", "host": "10.0.0.1", "hostName": "s0.<..>.invalid",  # -H
                     "connections": {"0": {"host": "10.0.0.1", "status": "CONNECTED",
                                           "changed": true}, ...},
                     "changed": true, "version": "..."},
               "1": {"status": "READY", "host": "10.0.0.2", "connections": {}, ...}, ...},
     "nodeId": 0, "instance": "...", "timestamp": "9/4/2026 00:37:39.905", "status": "UP"}

The simulator's ``-N`` is local only: the other nodes' rows carry no connections, and their
``status`` is READY while this daemon is connected to them, else UNAVAILABLE. A connection that
is not up carries ``reason``; a known peer instance ``instance`` (additive fields). Domain
status: ``UP`` when this daemon is READY and connected to every node whose name resolves to a
real address (not the placeholder of an empty slot), ``DOWN`` when it is not READY, else
``DEGRADED``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from libs.imex.slots import PLACEHOLDER_ADDRESS
from tools.sim.imex import protocol as proto

DOMAIN_UP = "UP"
DOMAIN_DEGRADED = "DEGRADED"
DOMAIN_DOWN = "DOWN"


@dataclass(frozen=True)
class DaemonStatus:
    """What one daemon reports about itself (reply to the STATUS command)."""

    state: str
    pid: int
    instance: str
    node_id: int
    nodes: list[str]  # the nodes config, in node ID order
    addresses: dict[int, str] = field(default_factory=dict)  # node ID -> resolved address
    connections: dict[int, str] = field(default_factory=dict)  # node ID -> CONN_* status
    reasons: dict[int, str] = field(default_factory=dict)  # node ID -> why it is not up
    peer_instances: dict[int, str] = field(default_factory=dict)  # node ID -> instance seen last
    address: str = ""  # BIND_INTERFACE_IP
    domain_id: str = ""
    version: str = ""
    hostname: str = ""
    map_digest: str = ""
    dropped: tuple[int, ...] = ()
    # Why the last TLS credential reload failed ("" when it worked or none was tried).
    credentials_error: str = ""

    @property
    def ready(self) -> bool:
        return self.state == proto.STATE_READY

    @classmethod
    def from_fields(cls, fields: Mapping[str, str]) -> DaemonStatus:
        """Build from the fields of a STATUS reply. Raises ValueError if one is malformed."""
        pid = _int(fields, "pid", "0")
        node_id = _int(fields, "node_id", "-1")
        per_node = _per_node(fields)
        return cls(
            state=fields.get("state", proto.STATE_UNAVAILABLE),
            pid=pid,
            instance=fields.get("instance", ""),
            node_id=node_id,
            nodes=_split(fields.get("nodes", "")),
            addresses=per_node["addr"],
            connections=per_node["conn"],
            reasons={i: why for i, why in per_node["why"].items() if why},
            peer_instances={i: inst for i, inst in per_node["inst"].items() if inst},
            address=fields.get("addr", ""),
            domain_id=fields.get("domain", ""),
            version=fields.get("version", ""),
            hostname=fields.get("host", ""),
            map_digest=fields.get("map", ""),
            dropped=tuple(int(i) for i in _split(fields.get("dropped", "")) if i.isdigit()),
            credentials_error=fields.get("cred_error", ""),
        )


@dataclass(frozen=True)
class Import:
    """One memory import of a local job from node ``node_id``'s daemon ``instance``."""

    job: str
    node_id: int
    instance: str
    valid: bool
    reason: str = ""  # why it is no longer valid

    @classmethod
    def list_from_fields(cls, fields: Mapping[str, str]) -> list[Import]:
        """Parse an IMPORTS reply. Raises ValueError if it is malformed."""
        count = _int(fields, "n", "0")
        return [
            cls(
                job=fields.get(f"job.{k}", ""),
                node_id=_int(fields, f"node.{k}", "-1"),
                instance=fields.get(f"inst.{k}", ""),
                valid=fields.get(f"valid.{k}", "0") == "1",
                reason=fields.get(f"why.{k}", ""),
            )
            for k in range(count)
        ]


def build_nodes_report(
    status: DaemonStatus | None,
    *,
    now: float | None = None,
    with_hostnames: bool = False,
    seen: Mapping[int, str] | None = None,
) -> dict[str, Any]:
    """The ``-N -j`` document from one daemon's own status (None: the daemon was unreachable).

    ``seen``: the address each node's name resolves to where the ctl runs (None: the daemon's
    own resolution). A node whose name does not resolve there cannot be reached: it shows no
    address and UNAVAILABLE. Unless the daemon's own name resolves there to the daemon's
    address, the ctl cannot tell which row is the daemon's: no row carries connections, and no
    node ID or instance is shown."""
    if status is None:
        return {"nodes": {}, "timestamp": format_timestamp(now), "status": DOMAIN_DOWN}
    hosts = dict(status.addresses) if seen is None else {i: a for i, a in seen.items() if a}
    if seen is not None and (not status.address or hosts.get(status.node_id) != status.address):
        return _with_credentials_error(_unplaced_report(status, hosts, now, with_hostnames), status)
    nodes: dict[str, Any] = {}
    connections: dict[str, Any] = {}
    for i, name in enumerate(status.nodes):
        entry: dict[str, Any] = {
            "host": hosts.get(i, ""),
            "status": status.connections.get(i, proto.CONN_INVALID),
            "changed": True,
        }
        if with_hostnames:
            entry["hostName"] = name
        if entry["status"] != proto.CONN_CONNECTED and status.reasons.get(i):
            entry["reason"] = status.reasons[i]
        if status.peer_instances.get(i):
            entry["instance"] = status.peer_instances[i]
        connections[str(i)] = entry
    for i, name in enumerate(status.nodes):
        mine = i == status.node_id
        node: dict[str, Any] = {
            "status": status.state
            if mine
            else (
                proto.STATE_READY
                if status.connections.get(i) == proto.CONN_CONNECTED and hosts.get(i)
                else proto.STATE_UNAVAILABLE
            ),
            "host": hosts.get(i, ""),
        }
        if with_hostnames:
            node["hostName"] = name
        node["connections"] = connections if mine else {}
        node["changed"] = True
        node["version"] = status.version if mine else ""
        nodes[str(i)] = node
    state = domain_state(status)
    unreached = any(
        i not in hosts for i in range(len(status.nodes)) if status.addresses.get(i) != PLACEHOLDER_ADDRESS
    )
    report = {
        "nodes": nodes,
        "nodeId": status.node_id,
        "instance": status.instance,
        "timestamp": format_timestamp(now),
        "status": DOMAIN_DEGRADED if state == DOMAIN_UP and unreached else state,
    }
    return _with_credentials_error(report, status)


def _with_credentials_error(report: dict[str, Any], status: DaemonStatus) -> dict[str, Any]:
    """The simulator's own field, about the local daemon wherever the ctl runs: nvidia-imex
    reports a failed credential reload only in its log."""
    if status.credentials_error:
        report["credentialsError"] = status.credentials_error
    return report


def _unplaced_report(
    status: DaemonStatus, hosts: Mapping[int, str], now: float | None, with_hostnames: bool
) -> dict[str, Any]:
    """The document of a ctl that reached a daemon but cannot place it in the node map."""
    nodes: dict[str, Any] = {}
    for i, name in enumerate(status.nodes):
        node: dict[str, Any] = {"status": proto.STATE_UNAVAILABLE, "host": hosts.get(i, "")}
        if with_hostnames:
            node["hostName"] = name
        node.update(connections={}, changed=True, version="")
        nodes[str(i)] = node
    state = DOMAIN_DEGRADED if status.ready else DOMAIN_DOWN
    return {"nodes": nodes, "timestamp": format_timestamp(now), "status": state}


def domain_state(status: DaemonStatus) -> str:
    """UP / DEGRADED / DOWN as this daemon sees its domain (empty slots do not count)."""
    if not status.ready:
        return DOMAIN_DOWN
    for i in range(len(status.nodes)):
        if status.addresses.get(i, "") == PLACEHOLDER_ADDRESS:
            continue
        if status.connections.get(i) != proto.CONN_CONNECTED:
            return DOMAIN_DEGRADED
    return DOMAIN_UP


def format_timestamp(now: float | None = None) -> str:
    """nvidia-imex-ctl's timestamp style: ``M/D/YYYY HH:MM:SS.mmm`` (local time)."""
    moment = time.time() if now is None else now
    local = time.localtime(moment)
    millis = int(moment * 1000) % 1000
    return f"{local.tm_mon}/{local.tm_mday}/{local.tm_year} {time.strftime('%H:%M:%S', local)}.{millis:03d}"


def format_nodes_table(report: Mapping[str, Any]) -> str:
    """Human-readable ``-N`` output (legend, this daemon's links, domain state)."""
    nodes: Mapping[str, Any] = report["nodes"]
    own = str(report.get("nodeId", ""))
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
    connections: Mapping[str, Any] = nodes[own]["connections"] if own in nodes else {}
    for key in sorted(nodes, key=int):
        node = nodes[key]
        host = node["host"] or "-"
        if node.get("hostName"):
            host += f" ({node['hostName']})"
        conn = connections.get(key, {})
        mark = "*" if key == own else "-"
        line = f"Node #{key:<3} {mark} {host:<15} - {node['status']:<12} - {conn.get('status', 'INVALID')}"
        if conn.get("reason"):
            line += f" ({conn['reason']})"
        lines.append(line)
    lines.append("")
    order = sorted(nodes, key=int)
    lines.append(" Nodes From\\To  " + "".join(f"{key:<4}" for key in order))
    if own in nodes:
        cells = "".join(
            f"{proto.CONN_LEGEND.get(connections.get(col, {}).get('status', ''), 'I'):<4}" for col in order
        )
        lines.append(f"{own:>8}        {cells}")
    lines.append("")
    lines.append(f"Domain State: {report['status']}")
    return "\n".join(line.rstrip() for line in lines) + "\n"


def format_imports_table(imports: list[Import]) -> str:
    """Human-readable ``--imports`` output."""
    lines = [f"{'JOB':<24} {'NODE':>4}  {'VALID':<5}  INSTANCE / REASON"]
    for entry in imports:
        detail = entry.instance + (f"  ({entry.reason})" if entry.reason else "")
        lines.append(f"{entry.job:<24} {entry.node_id:>4}  {'yes' if entry.valid else 'NO':<5}  {detail}")
    return "\n".join(lines) + "\n"


def _int(fields: Mapping[str, str], key: str, default: str) -> int:
    raw = fields.get(key, default)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"bad {key} {raw!r} in reply") from None


_PER_NODE_PREFIXES = ("addr", "conn", "why", "inst")


def _per_node(fields: Mapping[str, str]) -> dict[str, dict[int, str]]:
    """``<prefix>.<node ID>`` fields by prefix, then node ID (one pass: a probe's hot path)."""
    out: dict[str, dict[int, str]] = {prefix: {} for prefix in _PER_NODE_PREFIXES}
    for key, value in fields.items():
        prefix, dot, index = key.partition(".")
        if dot and index.isdigit() and prefix in out:
            out[prefix][int(index)] = value
    return out


def _split(value: str) -> list[str]:
    return [item for item in value.split(",") if item]
