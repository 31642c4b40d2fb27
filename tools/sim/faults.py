"""The faults of the soak, done for real to a running cdsim cluster.

Each returns a short description of what it did (for the event log), or raises `NotApplicable`
when there is nothing to hit (no daemon on that node, the process is already down). Blocking
calls to the cdsim supervisor run in a thread, so the soak's checker keeps its pace.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from libs.gen.computedomain.state import v1 as pb
from libs.hardware.cluster import ClusterDescription
from libs.imex.simulator import client as simclient
from libs.state.store import TRANSIENT_ERRORS, Store
from tools.cdsim import control, linkcut, procscan
from tools.cdsim.layout import StateLayout
from tools.cdsim.services import agent_name, imex_agent_name

CONTROLLER_ELECTION = "cd-controller"
CONTROL_TIMEOUT_S = 60.0
# How long the agent of a corrupted checkpoint stays down (the file is written meanwhile).
CHECKPOINT_AGENT_DOWN_S = 2.0
EXIT_WAIT_S = 5.0


class NotApplicable(RuntimeError):
    """The fault has no target right now (the message says why); nothing was done."""


@dataclass(frozen=True)
class ClusterHandle:
    layout: StateLayout
    cluster: ClusterDescription
    store: Store

    def node_address(self, node: str) -> str:
        return self.cluster.node(node).address


async def _control(handle: ClusterHandle, op: str, **fields: object) -> dict[str, object]:
    try:
        return await asyncio.to_thread(control.request, handle.layout, op, CONTROL_TIMEOUT_S, **fields)
    except control.ControlError as exc:
        raise NotApplicable(str(exc)) from None


async def process_pid(handle: ClusterHandle, process: str) -> int:
    """The live pid of a supervised process (asked of the supervisor, not the debounced run.json)."""
    answer = await _control(handle, "status")
    state = answer.get("state")
    info = state.get("processes", {}).get(process, {}) if isinstance(state, dict) else {}
    pid = int(info.get("pid") or 0)
    if not info.get("running") or pid <= 0:
        raise NotApplicable(f"{process} is not running")
    return pid


async def kill_process(handle: ClusterHandle, process: str, restart_in_s: float | None = None) -> int:
    """SIGKILL a supervised process; the supervisor starts it again (after `restart_in_s`)."""
    fields: dict[str, object] = {"process": process}
    if restart_in_s is not None:
        fields["restart_in_s"] = round(restart_in_s, 2)
    answer = await _control(handle, "kill", **fields)
    return int(str(answer["pid"]))


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    # A zombie waits for its parent (the fork server) to reap it: dead for our purposes.
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


async def wait_gone(pid: int, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if _gone(pid):
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


# ---- node programs --------------------------------------------------------------------------


async def kill_agent(handle: ClusterHandle, node: str) -> str:
    """SIGKILL the kubelet plugin alone: running jobs must not notice."""
    pid = await kill_process(handle, agent_name(node))
    return f"{node}: kubelet plugin pid {pid} SIGKILLed"


async def kill_imex_agent(handle: ClusterHandle, node: str, restart_in_s: float) -> str:
    """SIGKILL the IMEX agent; its daemons keep running and are adopted when it is back."""
    pid = await kill_process(handle, imex_agent_name(node), restart_in_s=restart_in_s)
    return f"{node}: IMEX agent pid {pid} SIGKILLed, back in {restart_in_s:.1f}s"


async def freeze_imex_agent(handle: ClusterHandle, node: str, outage_s: float, pid: int) -> str:
    """SIGSTOP the IMEX agent (`pid`) for `outage_s`, then SIGCONT: it wakes up without its lease."""
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(outage_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    return f"{node}: IMEX agent pid {pid} stopped for {outage_s:.1f}s, then continued"


async def kill_node(handle: ClusterHandle, node: str, restart_in_s: float) -> tuple[str, dict[str, int]]:
    """The whole node dies (IMEX agent, daemons, kubelet plugin) and boots again after
    `restart_in_s`; returns what was killed (supervised process or `imex-daemon-<pid>` -> pid)."""
    answer = await _control(handle, "kill-node", node=node, restart_in_s=round(restart_in_s, 2))
    raw = answer.get("killed")
    killed = {str(k): int(str(v)) for k, v in raw.items()} if isinstance(raw, dict) else {}
    names = ", ".join(f"{name} {pid}" for name, pid in sorted(killed.items())) or "nothing ran"
    return f"{node}: killed ({names}), back in {restart_in_s:.1f}s", killed


async def partition_etcd(handle: ClusterHandle, node: str, seconds: float) -> str:
    """Cut the node's kubelet plugin and IMEX agent off etcd for `seconds` (its IMEX daemons and
    their peer links are untouched); the cut ends by itself."""
    answer = await _control(handle, "partition-etcd", node=node, seconds=round(seconds, 2))
    return f"{node}: cut off etcd for {seconds:.1f}s ({answer.get('connections_cut')} connections reset)"


async def cut_links(handle: ClusterHandle, node: str, seconds: float) -> str:
    """Cut the IMEX links of every daemon on the node for `seconds`, both ways (every process
    lives); the daemons end the cut by themselves."""
    try:
        cut = await linkcut.cut_links(handle.layout.node(node).imex_dir, round(seconds, 2))
    except linkcut.NoDaemon as exc:
        raise NotApplicable(f"no IMEX daemon on {node} took the cut: {exc}") from None
    pids = ", ".join(str(pid) for pid in sorted(cut))
    return f"{node}: IMEX links of daemon pid {pids} cut for {seconds:.1f}s"


async def corrupt_checkpoint(handle: ClusterHandle, node: str, garbage: bytes) -> str:
    """Kill the kubelet plugin, write garbage over its checkpoint (torn, in place), let it start again."""
    pid = await kill_process(handle, agent_name(node), restart_in_s=CHECKPOINT_AGENT_DOWN_S)
    if not await wait_gone(pid, EXIT_WAIT_S):
        raise RuntimeError(f"agent pid {pid} of {node} did not die within {EXIT_WAIT_S}s of SIGKILL")
    existed = _write_in_place(handle.layout.node(node).checkpoint_file, garbage)
    what = "over its checkpoint" if existed else "as its checkpoint (there was none)"
    return f"{node}: kubelet plugin pid {pid} SIGKILLed, {len(garbage)} garbage bytes written {what}"


# ---- IMEX daemons ---------------------------------------------------------------------------


def nodes_with_daemons(handle: ClusterHandle) -> dict[str, list[procscan.ProcessEntry]]:
    """Simulated IMEX daemons running now, by node (one /proc scan)."""
    running = [p for p in procscan.list_processes() if procscan.IMEX_DAEMON_MARKER in p.command]
    out: dict[str, list[procscan.ProcessEntry]] = {}
    for node in handle.cluster.node_names():
        prefix = str(handle.layout.node(node).imex_dir).rstrip("/") + "/"
        mine = [p for p in running if any(a.startswith(prefix) for a in p.argv)]
        if mine:
            out[node] = mine
    return out


def _config_of(entry: procscan.ProcessEntry) -> str:
    argv = list(entry.argv)
    if "-c" in argv and argv.index("-c") + 1 < len(argv):
        return argv[argv.index("-c") + 1]
    raise NotApplicable(f"daemon pid {entry.pid} has no -c <config> on its command line")


async def imex_fault(handle: ClusterHandle, node: str, fault: str) -> tuple[str, int]:
    """Tell the node's simulated daemon to crash or hang (through its command service)."""
    daemons = nodes_with_daemons(handle).get(node)
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
    domain = Path(_config_of(entry)).parent.name
    return f"{node}: daemon pid {entry.pid} of domain {domain} told to {fault}", entry.pid


def imex_kill(handle: ClusterHandle, node: str) -> str:
    daemons = nodes_with_daemons(handle).get(node)
    if not daemons:
        raise NotApplicable(f"no IMEX daemon runs on {node}")
    killed = procscan.kill_all(daemons, signal.SIGKILL)
    return f"{node}: daemon pid {', '.join(map(str, killed))} SIGKILLed"


# ---- control plane --------------------------------------------------------------------------


async def leader(handle: ClusterHandle) -> pb.LeaderRecord | None:
    found = await handle.store.get(handle.store.keys.election(CONTROLLER_ELECTION), pb.LeaderRecord)
    return found.value if found is not None else None


async def controller_failover(handle: ClusterHandle) -> tuple[str, pb.LeaderRecord]:
    """SIGKILL the replica that leads; returns its name and the record it held."""
    record = await leader(handle)
    if record is None or not record.holder:
        raise NotApplicable("no controller leads right now")
    pid = await kill_process(handle, record.holder)
    return f"leader {record.holder} (pid {pid}) SIGKILLed", record


async def wait_new_leader(handle: ClusterHandle, old: pb.LeaderRecord, timeout_s: float) -> float | None:
    """Seconds until a leader other than `old` holds the election key; None after `timeout_s`."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        try:
            record = await leader(handle)
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


async def restart_etcd(handle: ClusterHandle) -> str:
    answer = await _control(handle, "restart-etcd")
    return f"etcd down {answer.get('down_ms')} ms"


async def plant_undecodable(handle: ClusterHandle, key: str, garbage: bytes) -> str:
    await handle.store.put_raw(key, garbage)
    return f"{len(garbage)} garbage bytes at {key}"
