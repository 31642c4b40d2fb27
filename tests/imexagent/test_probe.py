"""Parsing of what nvidia-imex-ctl prints (-q, -N, -N -j), and the ctl probe against a stand-in."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from services.imexagent.probe import (
    NvidiaCtlProbe,
    parse_ctl_nodes_json,
    parse_ctl_nodes_table,
    parse_ctl_query,
)

# nvidia-imex-ctl -N as NVIDIA's IMEX guide shows it (two nodes, one unreachable third).
CTL_N_TEXT = """\
Connectivity Table Legend:
I - Invalid - Node wasn't reachable, no connection status available
N - Never Connected
R - Recovering - Connection was lost, but clean up has not yet been triggered.
D - Disconnected - Connection was lost, and clean up has been triggreed.
A - Authenticating - If GSSAPI enabled, client has initiated mutual authentication.
!V! - Version mismatch, communication disabled.
!M! - Node map mismatch, communication disabled.
C - Connected - Ready for operation

5/2/2024 05:32:00.780
Nodes:
Node #0   - 10.115.131.10   - READY                - Version: 565.20
Node #1   - 10.115.131.12   - READY                - Version: 565.20
Node #2   - 10.115.131.14   - UNAVAILABLE          - Version:

 Nodes From\\To     0      1      2
       0           C      C      N
       1           C      C     !M!
       2           I      I      I
Domain State: DEGRADED
"""

CTL_N_JSON = {
    "nodes": {
        "0": {
            "status": "READY",
            "host": "10.0.0.1",
            "connections": {
                "0": {"host": "10.0.0.1", "status": "CONNECTED", "changed": True},
                "1": {"host": "10.0.0.2", "status": "DISCONNECTED", "changed": True},
                "2": {"host": "127.255.255.254", "status": "N", "changed": True},
            },
        },
        "1": {"status": "UNAVAILABLE", "connections": {"0": {"status": "INVALID"}}},
    },
    "timestamp": "9/4/2026 00:37:39.905",
    "status": "DEGRADED",
}


def test_query_word() -> None:
    assert parse_ctl_query("READY\n") == "READY"
    assert parse_ctl_query("\n  WAITING_FOR_PEERS \n") == "WAITING_FOR_PEERS"
    assert parse_ctl_query("") == "UNAVAILABLE"
    assert parse_ctl_query("Error: connection refused\n") == "UNAVAILABLE"


def test_nodes_table_row_of_this_node() -> None:
    assert parse_ctl_nodes_table(CTL_N_TEXT, 0) == {0: "CONNECTED", 1: "CONNECTED", 2: "NEVER_CONNECTED"}
    assert parse_ctl_nodes_table(CTL_N_TEXT, 1)[2] == "NODE_MAP_MISMATCH"
    assert parse_ctl_nodes_table(CTL_N_TEXT, 7) == {}
    assert parse_ctl_nodes_table("garbage\n", 0) == {}


def test_nodes_json_of_this_node() -> None:
    connections, addresses = parse_ctl_nodes_json(json.dumps(CTL_N_JSON), 0)
    assert connections == {0: "CONNECTED", 1: "DISCONNECTED", 2: "NEVER_CONNECTED"}
    assert addresses[1] == "10.0.0.2"
    assert parse_ctl_nodes_json("not json", 0) == ({}, {})
    assert parse_ctl_nodes_json(json.dumps({"nodes": []}), 0) == ({}, {})


async def test_ctl_probe_reads_state_then_connections(tmp_path: Path) -> None:
    """A stand-in nvidia-imex-ctl: -q prints READY, -N -j prints the JSON above."""
    doc = tmp_path / "n.json"
    doc.write_text(json.dumps(CTL_N_JSON))
    ctl = tmp_path / "nvidia-imex-ctl"
    ctl.write_text(f'#!/bin/sh\nif [ "$1" = "-q" ]; then echo READY; else cat {doc}; fi\n')
    ctl.chmod(ctl.stat().st_mode | stat.S_IEXEC)
    probe = NvidiaCtlProbe(str(ctl), node_id=0)
    result = await probe.probe(tmp_path / "config.cfg", "127.0.0.1", 50005, 5.0)
    assert result.ready and result.node_id == 0
    assert result.connections[0] == "CONNECTED" and result.connections[1] == "DISCONNECTED"


async def test_ctl_probe_without_the_tool_says_unavailable(tmp_path: Path) -> None:
    result = await NvidiaCtlProbe(str(tmp_path / "missing")).probe(tmp_path / "c", "127.0.0.1", 1, 1.0)
    assert not result.answered and "cannot run" in result.detail
