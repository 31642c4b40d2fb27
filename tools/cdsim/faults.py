"""`cdsim fault ...`: break things for real (SIGKILL, etcd restart, a node cut off etcd) through
tools/sim/faults.py, and say what will happen."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TextIO, TypeVar

from services.imexagent.settings import DEFAULT_DISCONNECTED_GRACE_S
from tools.cdsim.layout import StateLayout
from tools.cdsim.lifecycle import CommandError
from tools.cdsim.services import IMEX_AGENT_LEASE_TTL_S
from tools.sim import faults

T = TypeVar("T")


def _check(layout: StateLayout, node: str) -> None:
    try:
        faults.check_node(layout, node)
    except faults.NotApplicable as exc:
        raise CommandError(str(exc)) from None


def _do(fault: Coroutine[Any, Any, T], hint: str = "") -> T:
    """Run `fault`; one that could not be done is a CommandError (its message, then `hint`)."""
    try:
        return asyncio.run(fault)
    except faults.NotApplicable as exc:
        raise CommandError(f"{exc}{hint}") from None


def kill_agent(layout: StateLayout, node: str, out: TextIO, down_for_s: float | None = None) -> None:
    _check(layout, node)
    killed = _do(faults.kill_agent(layout, node, down_for_s))
    out.write(
        f"SIGKILLed the kubelet plugin of {node} (pid {killed.pid}). Running jobs do not notice: the "
        f"IMEX agent, its daemons and the node's record are untouched; only new prepares on {node} wait. "
        f"The supervisor starts it again in {killed.restart_in_s}s, as a DaemonSet would.\n"
    )


def kill_imex_agent(layout: StateLayout, node: str, out: TextIO, down_for_s: float | None = None) -> None:
    _check(layout, node)
    killed = _do(faults.kill_imex_agent(layout, node, down_for_s))
    out.write(
        f"SIGKILLed the IMEX agent of {node} (pid {killed.pid}); its IMEX daemons keep running and "
        f"are adopted when it is back in {killed.restart_in_s}s. Its node record expires with its "
        f"lease ({IMEX_AGENT_LEASE_TTL_S}s), but the node is not lost while its peers report it connected.\n"
    )


def kill_node(layout: StateLayout, node: str, out: TextIO, down_for_s: float | None = None) -> None:
    _check(layout, node)
    done = _do(faults.kill_node(layout, node, down_for_s))
    killed = ", ".join(f"{name} (pid {pid})" for name, pid in done.killed.items()) or "nothing was running"
    out.write(
        f"Killed node {node}: {killed}. "
        f"Its address no longer answers. Its domain reports NodeLost once its lease "
        f"({IMEX_AGENT_LEASE_TTL_S}s) expires and its peers lose it; nothing else changes. "
        f"The node comes back in {done.restart_in_s}s and takes its old index again.\n"
    )


def kill_controller(layout: StateLayout, replica: int, out: TextIO, down_for_s: float | None = None) -> None:
    killed = _do(faults.kill_controller(layout, replica, down_for_s))
    out.write(
        f"SIGKILLed controller replica {replica} (pid {killed.pid}); if it led, the standby takes over "
        f"when the leader lease expires. It is started again in {killed.restart_in_s}s.\n"
    )


def kill_imex(layout: StateLayout, node: str, out: TextIO) -> None:
    _check(layout, node)
    try:
        killed = faults.kill_imex(layout, node)
    except faults.NotApplicable as exc:
        raise CommandError(f"{exc} (is the node in a domain?)") from None
    out.write(
        f"SIGKILLed the IMEX daemon of {node} (pid {', '.join(map(str, killed))}); its IMEX agent "
        f"restarts it and reports the domain NotReady meanwhile. The new daemon is a new instance: "
        f"peers drop the memory it exported, so a running job's imports from {node} are gone.\n"
    )


def restart_etcd(layout: StateLayout, out: TextIO) -> None:
    down_ms = _do(faults.restart_etcd(layout))
    out.write(f"etcd stopped and started again on the same data directory ({down_ms} ms down).\n")


def partition_etcd(layout: StateLayout, node: str, seconds: float, out: TextIO) -> None:
    """Cut one node's programs off etcd for `seconds` (its etcd gate in the supervisor)."""
    _check(layout, node)
    if not 0 < seconds <= 3600:
        raise CommandError(f"--down-for must be in (0, 3600] seconds, got {seconds}")
    cut = _do(faults.partition_etcd(layout, node, seconds))
    out.write(
        f"Cut {node} off etcd for {cut.seconds:g}s ({cut.connections_cut} connections of its "
        f"kubelet plugin and IMEX agent reset; new ones are dropped until then). Its IMEX daemons and "
        f"their peer links are untouched. Its node record expires with its lease "
        f"({IMEX_AGENT_LEASE_TTL_S}s), but the node is not lost while its peers report it connected: "
        f"running jobs stay Ready. Afterwards both programs reconnect by themselves and the node "
        f"record comes back.\n"
    )


def cut_links(layout: StateLayout, node: str, seconds: float, out: TextIO) -> None:
    """Partition the node's IMEX links for `seconds` while every process lives (tools/cdsim/link_cut.py)."""
    _check(layout, node)
    try:
        cut = _do(faults.cut_links(layout, node, seconds), " (is the node in a domain?)")
    except ValueError as exc:
        raise CommandError(f"--for: {exc}") from None
    daemons = ", ".join(f"pid {pid} ({domain})" for pid, domain in sorted(cut.items()))
    out.write(
        f"Cut the IMEX links of {node} for {seconds:g}s, both ways: {daemons}. Every process lives and "
        f"its node record stays, so its domain reports it PeerUnreachable (not NodeLost) once its "
        f"peers lose it. A running job's imports survive a cut shorter than the daemons' "
        f"IMEX_NODE_DISCONNECTED_GRACE_TIME ({DEFAULT_DISCONNECTED_GRACE_S}s unless the IMEX agent was "
        f"told otherwise); after a longer one, imports across the cut are cleaned up.\n"
    )
