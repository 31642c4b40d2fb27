"""Parsing of what nvidia-imex-ctl prints (-q, -N, -N -j), and the ctl probe against a stand-in
run where the daemon lives: in its mount namespace, with the domain's hosts file over /etc/hosts."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.imex.hosts_ns import private_hosts_argv
from libs.imex.nvidia_imex import ExecCtl
from services.imexagent.probe import (
    CtlProbe,
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


SLOT_NAME = "s0.tag.cd-probe.imex.invalid"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[int]:
    """A stand-in daemon process in a mount namespace of its own, where SLOT_NAME resolves."""
    hosts = tmp_path / "hosts"
    hosts.write_text(f"10.0.0.1 {SLOT_NAME}\n")
    process = subprocess.Popen(private_hosts_argv(["sleep", "60"], str(hosts)))
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait(10)


def stand_in_ctl(tmp_path: Path) -> Path:
    """A stand-in nvidia-imex-ctl that, like the real one, resolves the node names itself: -q
    prints READY; -N -j prints the JSON above only where the slot name resolves."""
    doc = tmp_path / "n.json"
    doc.write_text(json.dumps(CTL_N_JSON))
    ctl = tmp_path / "nvidia-imex-ctl"
    ctl.write_text(
        f'#!/bin/sh\nif [ "$1" = "-q" ]; then echo READY; exit 0; fi\n'
        f"getent hosts {SLOT_NAME} >/dev/null && cat {doc} || echo '{{\"nodes\": {{}}}}'\n"
    )
    ctl.chmod(ctl.stat().st_mode | stat.S_IEXEC)
    return ctl


async def test_ctl_probe_reads_state_then_connections_in_the_daemons_namespace(
    tmp_path: Path, daemon: int
) -> None:
    probe = CtlProbe(ExecCtl([str(stand_in_ctl(tmp_path))]), node_id=0, placeholder="127.255.255.254")
    result = await probe.probe(tmp_path / "config.cfg", daemon, 5.0)
    assert result.ready and result.node_id == 0
    assert result.connections[0] == "CONNECTED" and result.connections[1] == "DISCONNECTED"
    assert result.detail == "node 1 (10.0.0.2): DISCONNECTED"  # the empty slot 2 is no news


async def test_the_same_ctl_run_in_the_agents_namespace_sees_no_connection(tmp_path: Path) -> None:
    """What probing from the agent's own namespace would see: the names do not resolve."""
    probe = CtlProbe(ExecCtl([str(stand_in_ctl(tmp_path))]), node_id=0)
    result = await probe.probe(tmp_path / "config.cfg", os.getpid(), 5.0)
    assert result.ready and result.connections == {}


async def test_ctl_probe_without_the_tool_or_the_daemon_says_unavailable(tmp_path: Path, daemon: int) -> None:
    result = await CtlProbe(ExecCtl([str(tmp_path / "missing")])).probe(tmp_path / "c", daemon, 1.0)
    assert not result.answered and "missing" in result.detail
    gone = await asyncio.create_subprocess_exec("true")
    await gone.wait()
    result = await CtlProbe(ExecCtl([str(stand_in_ctl(tmp_path))])).probe(tmp_path / "c", gone.pid, 1.0)
    assert not result.answered and f"/proc/{gone.pid}/ns/mnt" in result.detail


async def test_a_daemon_found_ready_is_asked_for_its_links_alone(tmp_path: Path, daemon: int) -> None:
    """Once READY, one ctl call per probe: -N -j, whose row of this node carries its state."""
    calls = tmp_path / "calls"
    ctl = stand_in_ctl(tmp_path)
    logged = tmp_path / "logged-ctl"
    logged.write_text(f'#!/bin/sh\necho "$1" >> {calls}\nexec {ctl} "$@"\n')
    logged.chmod(logged.stat().st_mode | stat.S_IEXEC)
    probe = CtlProbe(ExecCtl([str(logged)]), node_id=0)
    first = await probe.probe(tmp_path / "config.cfg", daemon, 5.0)
    second = await probe.probe(tmp_path / "config.cfg", daemon, 5.0)
    assert first.ready and second.ready and second.connections == first.connections
    assert calls.read_text().split() == ["-q", "-N", "-N"]
    # Another process (a restart): -q first again.
    await probe.probe(tmp_path / "config.cfg", os.getpid(), 5.0)
    assert calls.read_text().split()[3] == "-q"
