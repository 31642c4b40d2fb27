"""`cdsim fault ...`: break things for real (SIGKILL, etcd restart, a node cut off etcd) and say
what will happen."""

from __future__ import annotations

import asyncio
import signal
from typing import Any, TextIO

from libs.hardware.errors import UnknownNodeError
from services.imexagent.settings import DEFAULT_DISCONNECTED_GRACE_S
from tools.cdsim import control, linkcut, procscan
from tools.cdsim.layout import StateLayout
from tools.cdsim.lifecycle import CommandError
from tools.cdsim.runstate import RunState
from tools.cdsim.services import IMEX_AGENT_LEASE_TTL_S, agent_name, controller_name, imex_agent_name
from tools.sim.hardware.cluster import ClusterDescription


def _check_node(layout: StateLayout, node: str) -> None:
    try:
        ClusterDescription.load(layout.cluster_file).parse_node_name(node)
    except (UnknownNodeError, FileNotFoundError) as exc:
        raise CommandError(str(exc)) from None


def _kill(layout: StateLayout, process: str, down_for_s: float | None) -> dict[str, object]:
    fields: dict[str, Any] = {"process": process}
    if down_for_s is not None:
        fields["restart_in_s"] = down_for_s
    try:
        return control.request(layout, "kill", **fields)
    except control.ControlError as exc:
        raise CommandError(str(exc)) from None


def kill_agent(layout: StateLayout, node: str, out: TextIO, down_for_s: float | None = None) -> None:
    _check_node(layout, node)
    answer = _kill(layout, agent_name(node), down_for_s)
    out.write(
        f"SIGKILLed the kubelet plugin of {node} (pid {answer['pid']}). Running jobs do not notice: the "
        f"IMEX agent, its daemons and the node's record are untouched; only new prepares on {node} wait. "
        f"The supervisor starts it again in {answer['restart_in_s']}s, as a DaemonSet would.\n"
    )


def kill_imex_agent(layout: StateLayout, node: str, out: TextIO, down_for_s: float | None = None) -> None:
    _check_node(layout, node)
    answer = _kill(layout, imex_agent_name(node), down_for_s)
    out.write(
        f"SIGKILLed the IMEX agent of {node} (pid {answer['pid']}); its IMEX daemons keep running and "
        f"are adopted when it is back in {answer['restart_in_s']}s. Its node record expires with its "
        f"lease ({IMEX_AGENT_LEASE_TTL_S}s), but the node is not lost while its peers report it connected.\n"
    )


def kill_node(layout: StateLayout, node: str, out: TextIO, down_for_s: float | None = None) -> None:
    _check_node(layout, node)
    fields: dict[str, Any] = {"node": node}
    if down_for_s is not None:
        fields["restart_in_s"] = down_for_s
    try:
        answer = control.request(layout, "kill-node", **fields)
    except control.ControlError as exc:
        raise CommandError(str(exc)) from None
    killed = answer.get("killed", {})
    out.write(
        f"Killed node {node}: {', '.join(f'{name} (pid {pid})' for name, pid in killed.items()) or 'nothing was running'}. "
        f"Its address no longer answers. Its domain reports NodeLost once its lease "
        f"({IMEX_AGENT_LEASE_TTL_S}s) expires and its peers lose it; nothing else changes. "
        f"The node comes back in {answer['restart_in_s']}s and takes its old index again.\n"
    )


def kill_controller(layout: StateLayout, replica: int, out: TextIO, down_for_s: float | None = None) -> None:
    state = RunState.load(layout)
    count = sum(1 for p in (state.processes.values() if state else []) if p.kind == "controller")
    if not 0 <= replica < max(count, 1):
        raise CommandError(f"no controller replica {replica} (replicas are 0..{count - 1})")
    answer = _kill(layout, controller_name(replica), down_for_s)
    out.write(
        f"SIGKILLed controller replica {replica} (pid {answer['pid']}); if it led, the standby takes over "
        f"when the leader lease expires. It is started again in {answer['restart_in_s']}s.\n"
    )


def kill_imex(layout: StateLayout, node: str, out: TextIO) -> None:
    _check_node(layout, node)
    daemons = procscan.imex_daemons_under(layout.node(node).imex_dir)
    if not daemons:
        raise CommandError(f"no IMEX daemon runs on {node} (is the node in a domain?)")
    killed = procscan.kill_all(daemons, signal.SIGKILL)
    out.write(
        f"SIGKILLed the IMEX daemon of {node} (pid {', '.join(map(str, killed))}); its IMEX agent "
        f"restarts it and reports the domain NotReady meanwhile. The new daemon is a new instance: "
        f"peers drop the memory it exported, so a running job's imports from {node} are gone.\n"
    )


def restart_etcd(layout: StateLayout, out: TextIO) -> None:
    try:
        answer = control.request(layout, "restart-etcd", timeout_s=60.0)
    except control.ControlError as exc:
        raise CommandError(str(exc)) from None
    out.write(f"etcd stopped and started again on the same data directory ({answer['down_ms']} ms down).\n")


def partition_etcd(layout: StateLayout, node: str, seconds: float, out: TextIO) -> None:
    """Cut one node's programs off etcd for `seconds` (its etcd gate in the supervisor)."""
    _check_node(layout, node)
    if not 0 < seconds <= 3600:
        raise CommandError(f"--down-for must be in (0, 3600] seconds, got {seconds}")
    try:
        answer = control.request(layout, "partition-etcd", node=node, seconds=seconds)
    except control.ControlError as exc:
        raise CommandError(str(exc)) from None
    out.write(
        f"Cut {node} off etcd for {answer['seconds']:g}s ({answer['connections_cut']} connections of its "
        f"kubelet plugin and IMEX agent reset; new ones are dropped until then). Its IMEX daemons and "
        f"their peer links are untouched. Its node record expires with its lease "
        f"({IMEX_AGENT_LEASE_TTL_S}s), but the node is not lost while its peers report it connected: "
        f"running jobs stay Ready. Afterwards both programs reconnect by themselves and the node "
        f"record comes back.\n"
    )


def cut_links(layout: StateLayout, node: str, seconds: float, out: TextIO) -> None:
    """Partition the node's IMEX links for `seconds` while every process lives (tools/cdsim/linkcut.py)."""
    _check_node(layout, node)
    try:
        cut = asyncio.run(linkcut.cut_links(layout.node(node).imex_dir, seconds))
    except ValueError as exc:
        raise CommandError(f"--for: {exc}") from None
    except linkcut.NoDaemon as exc:
        raise CommandError(
            f"no IMEX daemon of {node} took the cut (is the node in a domain?): {exc}"
        ) from None
    daemons = ", ".join(f"pid {pid} ({domain})" for pid, domain in sorted(cut.items()))
    out.write(
        f"Cut the IMEX links of {node} for {seconds:g}s, both ways: {daemons}. Every process lives and "
        f"its node record stays, so its domain reports it PeerUnreachable (not NodeLost) once its "
        f"peers lose it. A running job's imports survive a cut shorter than the daemons' "
        f"IMEX_NODE_DISCONNECTED_GRACE_TIME ({DEFAULT_DISCONNECTED_GRACE_S}s unless the IMEX agent was "
        f"told otherwise); after a longer one, imports across the cut are cleaned up.\n"
    )
