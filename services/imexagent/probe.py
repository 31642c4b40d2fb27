"""Readiness and connection probes of one IMEX daemon, through its ctl, in its mount namespace.

nvidia-imex's command protocol is not public, so the probe is what an operator would type:
``nvidia-imex-ctl -q -c <config>`` for the state (local only: READY once the daemon is up), and
once READY ``nvidia-imex-ctl -N -j -c <config>`` for this daemon's connection to every node of
its map. ``-N`` resolves the node names itself, and they resolve only in the daemon's mount
namespace (libs/imex/hosts_ns.py), so every call runs there. The ctl is the IMEX daemon port's
`CtlRunner` (libs/imex/daemon_port.py): nvidia-imex-ctl started with ``nsenter``
(``--imex-backend=nvidia``), or the simulator's ctl called in-process.

Both print the same text, which the same parsers read. The parsers take what they can and never
raise: a probe that cannot tell says UNAVAILABLE or reports no connections.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from libs.imex.daemon_port import CtlOutput, CtlRunner
from libs.imex.daemon_state import CONN_CONNECTED as CONNECTED
from libs.imex.daemon_state import STATE_READY, STATE_UNAVAILABLE, STATE_WAITING_FOR_RECOVERY

# The letters of nvidia-imex-ctl -N's connectivity table, by their names.
CTL_LEGEND = {
    "C": "CONNECTED",
    "N": "NEVER_CONNECTED",
    "D": "DISCONNECTED",
    "R": "RECOVERING",
    "I": "INVALID",
    "A": "AUTHENTICATING",
    "!M!": "NODE_MAP_MISMATCH",
    "!V!": "VERSION_MISMATCH",
}
_STATE_WORD = re.compile(r"^[A-Z][A-Z_]+$")


@dataclass(frozen=True)
class ProbeResult:
    state: str  # READY, ... or UNAVAILABLE when the daemon did not answer
    detail: str = ""
    node_id: int = -1  # the node ID the daemon identified itself as; -1 unknown
    instance: str = ""  # the daemon instance ("" unknown)
    connections: Mapping[int, str] = field(default_factory=dict)  # node ID -> connection status
    addresses: Mapping[int, str] = field(default_factory=dict)  # node ID -> address it resolves to
    # Why the daemon's last TLS credential reload failed ("" none, or not told: nvidia-imex's
    # -N -j has no such field; the simulator's adds ``credentialsError``).
    credentials_error: str = ""

    @property
    def answered(self) -> bool:
        return self.state != STATE_UNAVAILABLE

    @property
    def ready(self) -> bool:
        return self.state == STATE_READY


class ReadinessProbe(Protocol):
    async def probe(self, config_path: Path, pid: int, timeout_s: float) -> ProbeResult: ...


def parse_ctl_query(text: str) -> str:
    """The state word ``nvidia-imex-ctl -q`` printed (UNAVAILABLE if none)."""
    for line in text.splitlines():
        word = line.strip()
        if word:
            return word if _STATE_WORD.fullmatch(word) else STATE_UNAVAILABLE
    return STATE_UNAVAILABLE


def _status_name(raw: object) -> str:
    text = str(raw).strip()
    return CTL_LEGEND.get(text, text.upper())


@dataclass(frozen=True)
class NodesView:
    """What ``-N -j`` says about one node's links."""

    connections: dict[int, str] = field(default_factory=dict)  # node ID -> connection status
    addresses: dict[int, str] = field(default_factory=dict)  # node ID -> address shown
    reasons: dict[int, str] = field(default_factory=dict)  # node ID -> why not connected
    node_id: int = -1  # the node ID the document says is the daemon's (-1: it does not say)
    instance: str = ""  # the daemon's instance, if the document shows it
    state: str = ""  # the state the node's row shows ("" none)
    credentials_error: str = ""  # the simulator's ``credentialsError`` ("" none)


def parse_ctl_nodes_view(text: str, node_id: int) -> NodesView:
    """From ``nvidia-imex-ctl -N -j``: node `node_id`'s links (-1: the node the document names)."""
    try:
        doc = json.loads(text)
        named = doc.get("nodeId", -1)
        own = node_id if node_id >= 0 else named if isinstance(named, int) else -1
        row = doc["nodes"][str(own)]
        raw = row.get("connections", {})
        state = str(row.get("status", "") or "")
    except (ValueError, KeyError, TypeError, AttributeError):
        return NodesView()
    if not isinstance(raw, dict):
        return NodesView()
    view = NodesView(
        node_id=own,
        instance=str(doc.get("instance", "") or ""),
        state=state if _STATE_WORD.fullmatch(state) else "",
        credentials_error=str(doc.get("credentialsError", "") or ""),
    )
    for key, entry in raw.items():
        try:
            index = int(key)
        except ValueError:
            continue
        if isinstance(entry, dict):
            view.connections[index] = _status_name(entry.get("status", ""))
            if entry.get("host"):
                view.addresses[index] = str(entry["host"])
            if entry.get("reason"):
                view.reasons[index] = str(entry["reason"])
        else:
            view.connections[index] = _status_name(entry)
    return view


def parse_ctl_nodes_json(text: str, node_id: int) -> tuple[dict[int, str], dict[int, str]]:
    """From ``nvidia-imex-ctl -N -j``: (connections, addresses) of node `node_id` to every node."""
    view = parse_ctl_nodes_view(text, node_id)
    return view.connections, view.addresses


def parse_ctl_nodes_table(text: str, node_id: int) -> dict[int, str]:
    """From the text of ``nvidia-imex-ctl -N``: node `node_id`'s row of the connectivity table."""
    lines = text.splitlines()
    for at, line in enumerate(lines):
        if "From" in line and "To" in line:
            header = line.split("\\To", 1)[-1] if "\\To" in line else line.split("To", 1)[-1]
            try:
                columns = [int(token) for token in header.split()]
            except ValueError:
                return {}
            for row in lines[at + 1 :]:
                tokens = row.split()
                if not tokens:
                    continue
                if not tokens[0].isdigit():
                    break
                if int(tokens[0]) != node_id:
                    continue
                return {
                    column: CTL_LEGEND.get(cell, cell)
                    for column, cell in zip(columns, tokens[1:], strict=False)
                }
            return {}
    return {}


class CtlProbe:
    """The state and connections of a daemon through its ctl, run by `run` in the daemon's mount
    namespace: ``-q`` (local, cheap), then ``-N -j`` once READY. A daemon that was READY at the
    last probe is asked ``-N -j`` alone, whose row of this node shows its state too; ``-q`` again
    only when that row cannot be read. (One ctl call per probe of a settled daemon instead of
    two: on a node each call is a process.)"""

    def __init__(self, run: CtlRunner, node_id: int = -1, placeholder: str = "") -> None:
        self.run = run
        # The daemon's node ID is its slot: the only line resolving to its own address.
        self.node_id = node_id
        # Empty slots resolve here; never connecting to them is no news worth a status line.
        self.placeholder = placeholder
        self._ready_pid = 0  # the daemon process the last probe found READY (0: none)

    async def probe(self, config_path: Path, pid: int, timeout_s: float) -> ProbeResult:
        nodes_args = ["-N", "-j", "-c", str(config_path)]
        if pid == self._ready_pid:
            nodes = await self.run(nodes_args, pid, timeout_s)
            view = self._view(nodes)
            if view.state:
                return self._result(view.state, view, nodes, pid)
        got = await self.run(["-q", "-c", str(config_path)], pid, timeout_s)
        if isinstance(got, str):
            self._ready_pid = 0
            return ProbeResult(STATE_UNAVAILABLE, got)
        state = parse_ctl_query(got[0])
        if state == STATE_WAITING_FOR_RECOVERY:
            # Its links say which importers it still waits for.
            nodes = await self.run(nodes_args, pid, timeout_s)
            return self._result(state, self._view(nodes), nodes, pid)
        if state != STATE_READY:
            self._ready_pid = 0
            return ProbeResult(state, got[1].strip()[-300:] or f"daemon {state}")
        nodes = await self.run(nodes_args, pid, timeout_s)
        return self._result(state, self._view(nodes), nodes, pid)

    def _view(self, nodes: CtlOutput) -> NodesView:
        if isinstance(nodes, str):
            return NodesView()
        view = parse_ctl_nodes_view(nodes[0], self.node_id)
        if not view.connections:
            view = NodesView(
                connections=parse_ctl_nodes_table(nodes[0], self.node_id),
                state=view.state,
                credentials_error=view.credentials_error,
            )
        return view

    def _result(self, state: str, view: NodesView, nodes: CtlOutput, pid: int) -> ProbeResult:
        self._ready_pid = pid if state == STATE_READY else 0
        node_id = self.node_id if self.node_id >= 0 else view.node_id
        return ProbeResult(
            state,
            detail=self._detail(view, node_id) or (nodes if isinstance(nodes, str) else ""),
            node_id=node_id,
            instance=view.instance,
            connections=view.connections,
            addresses=view.addresses,
            credentials_error=view.credentials_error,
        )

    def _detail(self, view: NodesView, node_id: int) -> str:
        """The links that are not up, but those to empty slots."""
        return "; ".join(
            f"node {i} ({view.addresses.get(i, '?')}): {conn}"
            + (f": {view.reasons[i]}" if view.reasons.get(i) else "")
            for i, conn in sorted(view.connections.items())
            if conn != CONNECTED and i != node_id and view.addresses.get(i) != self.placeholder
        )
