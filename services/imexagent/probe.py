"""Readiness and connection probes of one IMEX daemon.

* Simulated daemon: one in-process ``STATUS`` exchange with its command service
  (``libs.imex.simulator.client.query_status``): state, node ID, instance and the connection
  status of every slot.
* nvidia-imex: its command protocol is not public, so ``nvidia-imex-ctl -q -c <config>`` gives
  the state (local only: READY once the daemon is up), and once READY ``nvidia-imex-ctl -N -j -c
  <config>`` gives this daemon's connection to every node of its map. The parsers take what they
  can from the text and never raise: a probe that cannot tell says UNAVAILABLE or reports no
  connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from libs.imex.simulator import client as simclient
from libs.imex.simulator import protocol as simproto

STATE_READY = simproto.STATE_READY
STATE_UNAVAILABLE = simproto.STATE_UNAVAILABLE
CONNECTED = simproto.CONN_CONNECTED

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
    # Why the daemon's last TLS credential reload failed (simulator's STATUS; "" otherwise).
    credentials_error: str = ""

    @property
    def answered(self) -> bool:
        return self.state != STATE_UNAVAILABLE

    @property
    def ready(self) -> bool:
        return self.state == STATE_READY


class ReadinessProbe(Protocol):
    async def probe(
        self, config_path: Path, cmd_host: str, cmd_port: int, timeout_s: float
    ) -> ProbeResult: ...


class SimulatorProbe:
    """In-process query of the simulated daemon's command service (one short TCP exchange)."""

    def __init__(self, placeholder: str = "") -> None:
        # Empty slots resolve here; never connecting to them is no news worth a status line.
        self.placeholder = placeholder

    async def probe(self, config_path: Path, cmd_host: str, cmd_port: int, timeout_s: float) -> ProbeResult:
        try:
            status = await simclient.query_status(cmd_host, cmd_port, timeout_s)
        except simclient.DaemonUnavailable as exc:
            return ProbeResult(STATE_UNAVAILABLE, str(exc))
        reasons = status.reasons
        detail = "; ".join(
            f"node {i} ({status.addresses.get(i, '?')}): {conn}{': ' + reasons[i] if reasons.get(i) else ''}"
            for i, conn in sorted(status.connections.items())
            if conn != CONNECTED and i != status.node_id and status.addresses.get(i) != self.placeholder
        )
        return ProbeResult(
            state=status.state,
            detail=detail if status.ready else f"daemon {status.state}" + (f"; {detail}" if detail else ""),
            node_id=status.node_id,
            instance=status.instance,
            connections=dict(status.connections),
            addresses=dict(status.addresses),
            credentials_error=status.credentials_error,
        )


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


def parse_ctl_nodes_json(text: str, node_id: int) -> tuple[dict[int, str], dict[int, str]]:
    """From ``nvidia-imex-ctl -N -j``: (connections, addresses) of node `node_id` to every node."""
    try:
        doc = json.loads(text)
        nodes = doc["nodes"]
        mine = nodes[str(node_id)]
        raw = mine.get("connections", {})
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}, {}
    connections: dict[int, str] = {}
    addresses: dict[int, str] = {}
    if not isinstance(raw, dict):
        return {}, {}
    for key, entry in raw.items():
        try:
            index = int(key)
        except ValueError:
            continue
        if isinstance(entry, dict):
            connections[index] = _status_name(entry.get("status", ""))
            if entry.get("host"):
                addresses[index] = str(entry["host"])
        else:
            connections[index] = _status_name(entry)
    return connections, addresses


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


class NvidiaCtlProbe:
    """``nvidia-imex-ctl -q`` for the state, ``-N -j`` for the connections of a READY daemon."""

    def __init__(self, ctl_binary: str, node_id: int = -1) -> None:
        self.ctl_binary = ctl_binary
        # The real daemon's node ID is its slot: the only line resolving to its own address.
        self.node_id = node_id

    async def _run(self, args: list[str], timeout_s: float) -> tuple[str, str] | str:
        """(stdout, stderr), or the text of why the tool gave nothing."""
        try:
            proc = await asyncio.create_subprocess_exec(
                self.ctl_binary, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
        except OSError as exc:
            return f"cannot run {self.ctl_binary}: {exc.strerror or exc}"
        try:
            async with asyncio.timeout(timeout_s):
                out, err = await proc.communicate()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return f"{self.ctl_binary} {' '.join(args[:2])} gave no answer within {timeout_s:g} s"
        return out.decode(errors="replace"), err.decode(errors="replace")

    async def probe(self, config_path: Path, cmd_host: str, cmd_port: int, timeout_s: float) -> ProbeResult:
        got = await self._run(["-q", "-c", str(config_path)], timeout_s)
        if isinstance(got, str):
            return ProbeResult(STATE_UNAVAILABLE, got)
        state = parse_ctl_query(got[0])
        if state != STATE_READY:
            return ProbeResult(state, (got[1].strip() or got[0].strip())[-300:])
        nodes = await self._run(["-N", "-j", "-c", str(config_path)], timeout_s)
        connections: dict[int, str] = {}
        addresses: dict[int, str] = {}
        if not isinstance(nodes, str):
            connections, addresses = parse_ctl_nodes_json(nodes[0], self.node_id)
            if not connections:
                connections = parse_ctl_nodes_table(nodes[0], self.node_id)
        return ProbeResult(state, node_id=self.node_id, connections=connections, addresses=addresses)
