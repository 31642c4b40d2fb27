"""The faults done for real to a running cdsim cluster: one API for `cdsim fault ...` and the chaos soak.

Each fault asks the cdsim supervisor (tools/cdsim/control.py), signals a process or writes a file,
and returns what it hit; it raises `NotApplicable` when there is nothing to hit (no daemon on that
node, the process is already down, no supervisor answers). Callers say what happened in their own
words: the CLI explains the consequences, the soak logs one line. Blocking calls to the supervisor
run in a thread, so a caller's event loop keeps its pace.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from libs.gen.computedomain.state import v1 as pb
from libs.hardware.errors import UnknownNodeError
from libs.state.store import TRANSIENT_ERRORS, Store
from tools.cdsim import control, link_cut, proc_scan
from tools.cdsim.layout import StateLayout
from tools.cdsim.run_state import RunState
from tools.cdsim.services import agent_name, controller_name, imex_agent_name
from tools.launch import pid_alive
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.imex import client as simclient

CONTROLLER_ELECTION = "cd-controller"
CONTROL_TIMEOUT_S = 60.0
# How long the agent of a corrupted checkpoint stays down (the file is written meanwhile).
CHECKPOINT_AGENT_DOWN_S = 2.0
EXIT_WAIT_S = 5.0


class NotApplicable(RuntimeError):
    """The fault has no target right now (the message says why); nothing was done."""


@dataclass(frozen=True)
class Killed:
    """A supervised process SIGKILLed; the supervisor starts it again in `restart_in_s`."""

    pid: int
    restart_in_s: float


@dataclass(frozen=True)
class NodeKilled:
    """What died with the node (supervised process or `imex-daemon-<pid>` -> pid)."""

    killed: dict[str, int]
    restart_in_s: float


@dataclass(frozen=True)
class EtcdCut:
    connections_cut: int
    seconds: float


@dataclass(frozen=True)
class CheckpointCorrupted:
    pid: int  # the kubelet plugin that was killed first
    existed: bool  # whether the garbage went over a checkpoint (or became the first one)


async def supervisor_request(layout: StateLayout, op: str, **fields: object) -> dict[str, object]:
    try:
        return await asyncio.to_thread(control.request, layout, op, CONTROL_TIMEOUT_S, **fields)
    except control.ControlError as exc:
        raise NotApplicable(str(exc)) from None


def check_node(layout: StateLayout, node: str) -> None:
    """NotApplicable unless `node` is a node of the cluster (or there is no cluster file)."""
    try:
        ClusterDescription.load(layout.cluster_file).parse_node_name(node)
    except (UnknownNodeError, FileNotFoundError) as exc:
        raise NotApplicable(str(exc)) from None


async def process_pid(layout: StateLayout, process: str) -> int:
    """The live pid of a supervised process (asked of the supervisor, not the debounced run.json)."""
    answer = await supervisor_request(layout, "status")
    state = answer.get("state")
    info = state.get("processes", {}).get(process, {}) if isinstance(state, dict) else {}
    pid = int(info.get("pid") or 0)
    if not info.get("running") or pid <= 0:
        raise NotApplicable(f"{process} is not running")
    return pid


async def kill_process(layout: StateLayout, process: str, restart_in_s: float | None = None) -> Killed:
    """SIGKILL a supervised process; the supervisor starts it again (after `restart_in_s`, or its
    usual delay)."""
    fields: dict[str, object] = {"process": process}
    if restart_in_s is not None:
        fields["restart_in_s"] = restart_in_s
    answer = await supervisor_request(layout, "kill", **fields)
    return Killed(int(str(answer["pid"])), float(str(answer["restart_in_s"])))


async def kill_agent(layout: StateLayout, node: str, restart_in_s: float | None = None) -> Killed:
    """SIGKILL the kubelet plugin alone: running jobs must not notice."""
    return await kill_process(layout, agent_name(node), restart_in_s)


async def kill_imex_agent(layout: StateLayout, node: str, restart_in_s: float | None = None) -> Killed:
    """SIGKILL the IMEX agent; its daemons keep running and are adopted when it is back."""
    return await kill_process(layout, imex_agent_name(node), restart_in_s)


async def kill_controller(layout: StateLayout, replica: int, restart_in_s: float | None = None) -> Killed:
    """SIGKILL controller replica `replica`; if it led, a standby takes over."""
    state = RunState.load(layout)
    count = sum(1 for p in (state.processes.values() if state else []) if p.kind == "controller")
    if not 0 <= replica < max(count, 1):
        raise NotApplicable(f"no controller replica {replica} (replicas are 0..{count - 1})")
    return await kill_process(layout, controller_name(replica), restart_in_s)


async def kill_node(layout: StateLayout, node: str, restart_in_s: float | None = None) -> NodeKilled:
    """The whole node dies (IMEX agent, daemons, kubelet plugin) and boots again after
    `restart_in_s` (or the usual restart delay)."""
    fields: dict[str, object] = {"node": node}
    if restart_in_s is not None:
        fields["restart_in_s"] = restart_in_s
    answer = await supervisor_request(layout, "kill-node", **fields)
    raw = answer.get("killed")
    killed = {str(k): int(str(v)) for k, v in raw.items()} if isinstance(raw, dict) else {}
    return NodeKilled(killed, float(str(answer["restart_in_s"])))


async def freeze_process(pid: int, outage_s: float) -> None:
    """SIGSTOP `pid` for `outage_s`, then SIGCONT (even when cancelled): it wakes up late."""
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(outage_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def partition_etcd(layout: StateLayout, node: str, seconds: float) -> EtcdCut:
    """Cut the node's kubelet plugin and IMEX agent off etcd for `seconds` (its IMEX daemons and
    their peer links are untouched); the cut ends by itself."""
    answer = await supervisor_request(layout, "partition-etcd", node=node, seconds=seconds)
    return EtcdCut(int(str(answer["connections_cut"])), float(str(answer["seconds"])))


async def restart_etcd(layout: StateLayout) -> int:
    """Stop etcd and start it again on the same data directory; the milliseconds it was down."""
    answer = await supervisor_request(layout, "restart-etcd")
    return int(str(answer["down_ms"]))


async def cut_links(layout: StateLayout, node: str, seconds: float) -> dict[int, str]:
    """Cut the IMEX links of every daemon on the node for `seconds`, both ways (every process
    lives); the daemons end the cut by themselves. Returns daemon pid -> domain. A `seconds` out
    of range is a ValueError."""
    try:
        return await link_cut.cut_links(layout.node(node).imex_dir, seconds)
    except link_cut.NoDaemon as exc:
        raise NotApplicable(f"no IMEX daemon of {node} took the cut: {exc}") from None


async def corrupt_checkpoint(layout: StateLayout, node: str, garbage: bytes) -> CheckpointCorrupted:
    """Kill the kubelet plugin, write garbage over its checkpoint (torn, in place), let it start again."""
    killed = await kill_process(layout, agent_name(node), restart_in_s=CHECKPOINT_AGENT_DOWN_S)
    if not await wait_gone(killed.pid, EXIT_WAIT_S):
        raise RuntimeError(f"agent pid {killed.pid} of {node} did not die within {EXIT_WAIT_S}s of SIGKILL")
    return CheckpointCorrupted(killed.pid, _write_in_place(layout.node(node).checkpoint_file, garbage))


async def wait_gone(pid: int, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not pid_alive(pid):  # a zombie waiting for the fork server to reap it is gone
            return True
        await asyncio.sleep(0.02)
    return False


def _write_in_place(path: Path, data: bytes) -> bool:
    """Overwrite `path` in place (deliberately not atomic: a torn write is the point); did it exist?"""
    path.parent.mkdir(parents=True, exist_ok=True)
    existed = path.exists()
    with open(path, "wb") as f:
        f.write(data)
    return existed


def nodes_with_daemons(layout: StateLayout, nodes: Iterable[str]) -> dict[str, list[proc_scan.ProcessEntry]]:
    """Simulated IMEX daemons running now, by node (one /proc scan)."""
    running = [p for p in proc_scan.list_processes() if proc_scan.mentions(p, proc_scan.IMEX_DAEMON_MARKER)]
    out: dict[str, list[proc_scan.ProcessEntry]] = {}
    for node in nodes:
        prefix = str(layout.node(node).imex_dir).rstrip("/") + "/"
        mine = [p for p in running if any(a.startswith(prefix) for a in p.argv)]
        if mine:
            out[node] = mine
    return out


def kill_imex(layout: StateLayout, node: str) -> list[int]:
    """SIGKILL the node's IMEX daemons; the pids killed."""
    daemons = proc_scan.imex_daemons_under(layout.node(node).imex_dir)
    if not daemons:
        raise NotApplicable(f"no IMEX daemon runs on {node}")
    return proc_scan.kill_all(daemons, signal.SIGKILL)


def _config_of(entry: proc_scan.ProcessEntry) -> str:
    argv = list(entry.argv)
    if "-c" in argv and argv.index("-c") + 1 < len(argv):
        return argv[argv.index("-c") + 1]
    raise NotApplicable(f"daemon pid {entry.pid} has no -c <config> on its command line")


async def imex_fault(layout: StateLayout, node: str, fault: str) -> tuple[int, str]:
    """Tell the node's simulated daemon to crash or hang (through its command service); returns
    its pid and its domain."""
    daemons = proc_scan.imex_daemons_under(layout.node(node).imex_dir)
    if not daemons:
        raise NotApplicable(f"no IMEX daemon runs on {node}")
    entry = daemons[0]
    try:
        config = simclient.read_config(_config_of(entry))
        host, port = simclient.command_endpoint(config)
        await simclient.inject_fault(host, port, fault, timeout=2.0)
    except (OSError, simclient.CommandEndpointError) as exc:
        raise NotApplicable(f"daemon pid {entry.pid} on {node} gone or unreadable: {exc}") from None
    except (simclient.DaemonUnavailable, simclient.CommandRejected) as exc:
        raise NotApplicable(f"daemon pid {entry.pid} on {node} did not take the fault: {exc}") from None
    return entry.pid, Path(_config_of(entry)).parent.name


async def leader(store: Store) -> pb.LeaderRecord | None:
    found = await store.get(store.keys.election(CONTROLLER_ELECTION), pb.LeaderRecord)
    return found.value if found is not None else None


async def controller_failover(layout: StateLayout, store: Store) -> tuple[Killed, pb.LeaderRecord]:
    """SIGKILL the replica that leads; returns what was killed and the record it held."""
    record = await leader(store)
    if record is None or not record.holder:
        raise NotApplicable("no controller leads right now")
    return await kill_process(layout, record.holder), record


async def wait_new_leader(store: Store, old: pb.LeaderRecord, timeout_s: float) -> float | None:
    """Seconds until a leader other than `old` holds the election key; None after `timeout_s`."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        try:
            record = await leader(store)
        except TRANSIENT_ERRORS:
            record = None
        if (
            record is not None
            and record.holder
            and (record.holder != old.holder or record.acquired_unix_ms != old.acquired_unix_ms)
        ):
            return time.monotonic() - began
        await asyncio.sleep(0.05)
    return None


async def plant_undecodable(store: Store, key: str, garbage: bytes) -> None:
    """Put bytes that decode as no record at `key` (readers must skip them, not crash)."""
    await store.put_raw(key, garbage)
