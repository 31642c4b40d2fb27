"""IMEX daemon supervision on one node (SPEC §5, "IMEX supervision").

Level-triggered: the store says which domain this node is bound to (``nodebindings/<node>``) and
who the members are (``members/<uid>/``). Two watches keep an in-memory view of exactly that
(each starts with a full listing, and a re-listing replaces the view), and the reconciler makes
the local daemons match the view, whatever sequence of events led to it:

* this node an ACTIVE, fabric-attached member of D -> D's ``config.cfg`` and nodes config in
  ``<work dir>/<uid>/``, one daemon running on them, readiness polled through the IMEX command
  service, a ``DaemonStatus`` at ``daemons/<uid>/<node>`` (written only when it changes, and only
  while the member record it belongs to is unchanged, so a status never outlives its member);
* the nodes config lists the ACTIVE members of this node's clique in D ordered by index (SPEC §4
  invariant 4); a change rewrites it atomically and sends SIGUSR1 (same process, jobs go on);
* daemon exit -> restart with capped exponential backoff; while it is down the status is
  NOT_READY (FAILED after repeated failed starts) with the exit reason and the log tail (#289);
* not a member any more (left, or LOST after this node's lease expired), or non-fabric -> no
  daemon: SIGTERM, SIGKILL after a grace period, directory and status removed.

At start the supervisor adopts a daemon left running by the previous agent incarnation when it
still serves the right domain with the same configuration (an agent restart does not disturb
running jobs), and otherwise kills it and removes directories of domains this node has left.
Daemons run in their own session, so by default they outlive the agent; `stop_daemons_on_exit`
stops them when the supervisor ends.

Processes are watched through pidfds (Linux >= 5.3) on the event loop: no thread per child.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.hardware import ImexBackendName, NodeHardware
from libs.imex import config as imexcfg
from libs.imex.simulator import client as simclient
from libs.imex.simulator import protocol as simproto
from libs.imex.simulator.launch import simulator_daemon_argv
from libs.runtime.backoff import Backoff
from libs.state.keys import Keys
from libs.state.store import TRANSIENT_ERRORS, Put, Store, StoreUnavailable, Unchanged, with_retries
from libs.state.watch import M, Resync, WatchEvent, watch_prefix

log = structlog.get_logger(__name__)

CONFIG_FILE = "config.cfg"
NODES_CONFIG_FILE = "nodes_config.cfg"
LOG_FILE = "nvidia-imex.log"
PID_FILE = "daemon.pid"

STATE_READY = simproto.STATE_READY
STATE_UNAVAILABLE = simproto.STATE_UNAVAILABLE

_DOMAIN_DIR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_TAIL_BYTES = 16 * 1024
_FRESH_S = 2.0  # readiness is polled at the fast interval this long after a change


# ============================================================================ settings


@dataclass(frozen=True)
class ImexSettings:
    """How daemons are started, polled, reloaded and stopped."""

    # "nvidia" (nvidia-imex) or "simulated"; None = what the node's hardware backend says.
    backend: ImexBackendName | None = None
    nvidia_imex_binary: str = "nvidia-imex"
    nvidia_imex_ctl_binary: str = "nvidia-imex-ctl"
    # Replaces the backend's daemon command (argv before "-c <config>"); tests use it.
    daemon_command: tuple[str, ...] = ()
    server_port: int = imexcfg.DEFAULT_SERVER_PORT
    cmd_port: int = imexcfg.DEFAULT_CMD_PORT
    # Where the command service listens; "" = this node's address.
    cmd_bind_ip: str = ""
    wait_for_quorum: str = imexcfg.QUORUM_RECOVERY
    log_file_max_size_mb: int = 64
    # Readiness polling: fast while starting or reloading, slow once READY.
    poll_interval_starting_s: float = 0.025
    poll_interval_ready_s: float = 1.0
    query_timeout_s: float = 1.0
    # A READY daemon must be not ready this long before the status says so (a reload to add a
    # peer makes every member wait for it for a moment; that is not worth two store writes).
    not_ready_debounce_s: float = 0.5
    # After this long STARTING, the status names the peers the daemon still waits for.
    waiting_detail_after_s: float = 5.0
    # A daemon whose command service does not answer this long is killed (and restarted).
    unresponsive_kill_s: float = 20.0
    # SIGTERM -> SIGKILL grace period when stopping a daemon.
    stop_grace_s: float = 5.0
    restart_backoff_initial_s: float = 0.2
    restart_backoff_cap_s: float = 10.0
    # A daemon READY at least this long before it exits restarts with the initial delay again.
    stable_after_s: float = 10.0
    # A status change that only concerns peers / config generation (a membership burst) is
    # written at most this often; state changes are written at once.
    status_coalesce_s: float = 0.2
    # Consecutive starts that never reached READY before the status says FAILED.
    failed_after: int = 3
    log_tail_lines: int = 10
    # Minimum spacing of nodes-config reloads (rewrite + SIGUSR1); changes in between are
    # coalesced. nvidia-imex ignores a SIGUSR1 within 5 s of the previous one, so its default
    # is a little more; the simulator reloads at once, so a short spacing only bounds bursts.
    # None = per backend.
    reload_min_interval_s: float | None = None
    # The simulator's own SIGUSR1 rate limit (to mimic nvidia-imex in tests); None = none.
    sim_sigusr1_min_interval_s: float | None = None
    # Simulator tuning (rendered as simulator-only comment directives).
    sim_heartbeat_interval_s: float | None = None
    sim_reconnect_max_s: float | None = None
    # Stop the daemons when the supervisor ends (default: leave them for the next incarnation).
    stop_daemons_on_exit: bool = False

    def __post_init__(self) -> None:
        problems = []
        for name in (
            "poll_interval_starting_s",
            "poll_interval_ready_s",
            "query_timeout_s",
            "restart_backoff_initial_s",
            "restart_backoff_cap_s",
        ):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0")
        for name in ("not_ready_debounce_s", "stop_grace_s", "waiting_detail_after_s", "unresponsive_kill_s"):
            if not getattr(self, name) >= 0:
                problems.append(f"{name} must be >= 0")
        if self.failed_after < 1:
            problems.append("failed_after must be >= 1")
        if self.wait_for_quorum not in imexcfg.WAIT_FOR_QUORUM_VALUES:
            problems.append(f"wait_for_quorum must be one of {imexcfg.WAIT_FOR_QUORUM_VALUES}")
        if problems:
            raise ValueError("invalid IMEX settings: " + "; ".join(problems))

    def reload_interval(self, backend: ImexBackendName) -> float:
        if self.reload_min_interval_s is not None:
            return self.reload_min_interval_s
        return 5.2 if backend == "nvidia" else 0.05


# ============================================================================ pure core


@dataclass(frozen=True)
class DesiredDaemon:
    """What should run for one domain on this node."""

    domain_uid: str
    node_name: str
    address: str
    clique_id: str
    # Addresses of the ACTIVE members of this node's clique in the domain, by index.
    peers: tuple[str, ...]
    # Mod revision of this node's member record: status writes are fenced on it.
    member_revision: int


@dataclass(frozen=True)
class Membership:
    """This node's standing in the domain it is bound to, as read from the store."""

    domain_uid: str | None
    # ACTIVE member of domain_uid with no daemon to run (non-fabric node).
    non_fabric: bool = False
    desired: DesiredDaemon | None = None


def nodes_config_peers(members: Sequence[pb.Member], clique_id: str) -> tuple[str, ...]:
    """Addresses of the clique's ACTIVE members ordered by index (LOST members left out)."""
    active = [
        m for m in members if m.state == pb.MemberState.ACTIVE and m.clique_id == clique_id and m.index >= 0
    ]
    active.sort(key=lambda m: (m.index, m.node_name))
    return tuple(dict.fromkeys(m.ip_address for m in active if m.ip_address))


def membership_of(
    node_name: str, binding: pb.NodeBinding | None, members: Sequence[tuple[pb.Member, int]]
) -> Membership:
    """Decide what this node runs, from its binding and the domain's members (with revisions)."""
    if binding is None or not binding.domain_uid:
        return Membership(None)
    uid = binding.domain_uid
    mine = next(((m, rev) for m, rev in members if m.node_name == node_name), None)
    if mine is None or mine[0].state != pb.MemberState.ACTIVE:
        return Membership(uid)
    member, revision = mine
    if not member.clique_id or member.index < 0:
        return Membership(uid, non_fabric=True)
    peers = nodes_config_peers([m for m, _ in members], member.clique_id)
    return Membership(
        uid,
        desired=DesiredDaemon(uid, node_name, member.ip_address, member.clique_id, peers, revision),
    )


def render_domain_config(desired: DesiredDaemon, domain_dir: Path, settings: ImexSettings) -> str:
    return imexcfg.render_imex_config(
        bind_interface_ip=desired.address,
        nodes_config_file=str(domain_dir / NODES_CONFIG_FILE),
        cmd_bind_interface_ip=settings.cmd_bind_ip or desired.address,
        log_file_name=str(domain_dir / LOG_FILE),
        domain_id=desired.domain_uid,
        node_name=desired.node_name,
        server_port=settings.server_port,
        cmd_port=settings.cmd_port,
        wait_for_quorum=settings.wait_for_quorum,
        log_file_max_size_mb=settings.log_file_max_size_mb,
        heartbeat_interval_s=settings.sim_heartbeat_interval_s,
        reconnect_max_s=settings.sim_reconnect_max_s,
        sigusr1_min_interval_s=settings.sim_sigusr1_min_interval_s,
    )


def exit_reason(returncode: int | None) -> str:
    if returncode is None:
        return "daemon exited (status unknown: started by a previous agent)"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"daemon killed by {name}"
    return f"daemon exited with status {returncode}"


def waiting_detail(status: simclient.DaemonStatus) -> str:
    """Which listed peers a not-ready daemon still lacks, and why (for last_error)."""
    missing = [
        f"{addr} ({conn}{': ' + status.reasons[addr] if status.reasons.get(addr) else ''})"
        for addr, conn in status.connections.items()
        if conn != simproto.CONN_CONNECTED
    ]
    if not missing:
        return f"daemon state {status.state}"
    return f"daemon {status.state}: not connected to {len(missing)} peer(s): " + ", ".join(missing)


def replace_file(path: Path, text: str) -> None:
    """Replace a file atomically (temp file + rename) so a daemon never reads half of it.

    No fsync: these files are derived from the store and rewritten by the next agent after a
    crash or reboot; durability would only cost time on the join path.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def tail_lines(path: Path, count: int) -> list[str]:
    """The last `count` non-empty lines of a file ([] if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _TAIL_BYTES))
            data = f.read()
    except OSError:
        return []
    lines = [line for line in data.decode(errors="replace").splitlines() if line.strip()]
    if size > _TAIL_BYTES and lines:
        lines = lines[1:]  # the first line is probably cut
    return lines[-count:] if count > 0 else []


# ============================================================================ processes


async def _wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for `event` up to `timeout_s`; False on timeout.

    asyncio.timeout rather than wait_for: on Python 3.11 wait_for can swallow a cancellation
    that arrives as the event fires, which would leave a task running that was told to stop.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


def _proc_start_ticks(pid: int) -> int | None:
    """Start time of a process (clock ticks since boot), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    try:
        return int(fields[19])  # field 22 of proc(5); fields[0] is field 3
    except (IndexError, ValueError):
        return None


def _proc_cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
    except OSError:
        return []


class DaemonProcess:
    """A daemon process watched through a pidfd: our child, or one adopted from a previous agent."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None, on_exit: Callable[[], None]) -> None:
        self.pid = pid
        self.popen = popen
        self.started = asyncio.get_running_loop().time()
        self.returncode: int | None = None
        self.exited = asyncio.Event()
        self._on_exit = on_exit
        self._loop = asyncio.get_running_loop()
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._mark_exited()
            return
        self._loop.add_reader(self._pidfd, self._mark_exited)

    @property
    def adopted(self) -> bool:
        return self.popen is None

    @property
    def alive(self) -> bool:
        return not self.exited.is_set()

    def _mark_exited(self) -> None:
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self.popen is not None:
            self.popen.wait()  # the pidfd says it exited: reaping does not block
            self.returncode = self.popen.returncode
        if not self.exited.is_set():
            self.exited.set()
            self._on_exit()

    def send(self, sig: signal.Signals) -> bool:
        """Signal the process unless it has exited (a pidfd cannot hit a recycled pid)."""
        if self._pidfd is None:
            return False
        try:
            signal.pidfd_send_signal(self._pidfd, sig)
        except ProcessLookupError:
            return False
        return True

    async def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; returns once the process is gone."""
        if not self.alive:
            return
        self.send(signal.SIGTERM)
        if await _wait_event(self.exited, grace_s):
            return
        log.warning("daemon ignored SIGTERM; killing it", pid=self.pid, grace_s=grace_s)
        self.send(signal.SIGKILL)
        if not await _wait_event(self.exited, 10.0):
            log.error("daemon did not die after SIGKILL", pid=self.pid)

    def close(self) -> None:
        """Stop watching (the process keeps running)."""
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None


def write_pidfile(domain_dir: Path, pid: int) -> None:
    """Record the daemon for the next agent incarnation (pid + start time: pids get reused).

    Atomic but not fsynced: it only has to survive the agent, not the machine; after a reboot
    there is no daemon to find.
    """
    record = {"pid": pid, "start_ticks": _proc_start_ticks(pid)}
    replace_file(domain_dir / PID_FILE, json.dumps(record))


def leftover_pids(domain_dir: Path) -> list[int]:
    """Live daemons of a domain directory: the pidfile's (if still the same process), and any
    process whose command line names this directory's config (a crash can beat the pidfile)."""
    pids: list[int] = []
    try:
        record = json.loads((domain_dir / PID_FILE).read_text())
        pid, ticks = int(record["pid"]), record.get("start_ticks")
        if ticks is not None and _proc_start_ticks(pid) == ticks:
            pids.append(pid)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    config = str(domain_dir / CONFIG_FILE)
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if (
                entry.name.isdigit()
                and int(entry.name) not in pids
                and config in _proc_cmdline(int(entry.name))
            ):
                pids.append(int(entry.name))
    return [pid for pid in pids if pid != os.getpid()]


# ============================================================================ readiness probes


@dataclass(frozen=True)
class ProbeResult:
    state: str  # READY, WAITING_FOR_PEERS, ..., or UNAVAILABLE when the daemon did not answer
    detail: str = ""

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

    async def probe(self, config_path: Path, cmd_host: str, cmd_port: int, timeout_s: float) -> ProbeResult:
        try:
            status = await simclient.query_status(cmd_host, cmd_port, timeout_s)
        except simclient.DaemonUnavailable as exc:
            return ProbeResult(STATE_UNAVAILABLE, str(exc))
        return ProbeResult(status.state, "" if status.ready else waiting_detail(status))


class NvidiaCtlProbe:
    """``nvidia-imex-ctl -q -c <config>`` (the real daemon's command protocol is not public)."""

    def __init__(self, ctl_binary: str) -> None:
        self.ctl_binary = ctl_binary

    async def probe(self, config_path: Path, cmd_host: str, cmd_port: int, timeout_s: float) -> ProbeResult:
        try:
            proc = await asyncio.create_subprocess_exec(
                self.ctl_binary,
                "-q",
                "-c",
                str(config_path),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            return ProbeResult(STATE_UNAVAILABLE, f"cannot run {self.ctl_binary}: {exc.strerror or exc}")
        try:
            async with asyncio.timeout(timeout_s):
                out, err = await proc.communicate()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return ProbeResult(
                STATE_UNAVAILABLE, f"{self.ctl_binary} -q gave no answer within {timeout_s:g} s"
            )
        state = out.decode(errors="replace").strip() or STATE_UNAVAILABLE
        return ProbeResult(state, err.decode(errors="replace").strip()[-300:])


# ============================================================================ one domain's daemon


class _StatusFields(NamedTuple):
    """What a DaemonStatus says, minus its timestamp (compared to skip unchanged writes)."""

    state: pb.DaemonState
    pid: int
    restarts: int
    last_error: str
    log_lines: tuple[str, ...]
    peers: tuple[str, ...]
    generation: int


@dataclass
class _Reported:
    content: _StatusFields | None = None
    at: float = -1e9  # loop time of the write
    fence_failed_at: int = -1  # member revision a fenced write failed at (no retry until it changes)


@dataclass
class DaemonRuntime:
    """Mutable state of one domain's daemon, as the runner sees it."""

    state: pb.DaemonState = pb.DaemonState.STARTING
    last_error: str = ""
    log_lines: list[str] = field(default_factory=list)
    restarts: int = 0
    generation: int = 0
    consecutive_failures: int = 0


class DomainDaemon:
    """Runs, reloads, restarts and finally stops the daemon of one domain on this node."""

    def __init__(
        self,
        store: Store,
        settings: ImexSettings,
        backend: ImexBackendName,
        probe: ReadinessProbe,
        domain_dir: Path,
        desired: DesiredDaemon,
        on_ready_changed: Callable[[], None],
        on_fence_lost: Callable[[], None],
    ) -> None:
        self.store = store
        self.keys: Keys = store.keys
        self.settings = settings
        self.backend = backend
        self.probe = probe
        self.dir = domain_dir
        self.desired = desired
        self.uid = desired.domain_uid
        self.node = desired.node_name
        self._on_ready_changed = on_ready_changed
        self._on_fence_lost = on_fence_lost
        self.rt = DaemonRuntime()
        self._previous_loaded = False
        self.process: DaemonProcess | None = None
        self.written_peers: tuple[str, ...] | None = None
        self._written_config: str | None = None
        self._files_for: DesiredDaemon | None = None
        self._attempted = False  # a daemon was started (or adopted) before: the next is a restart
        self.ready = asyncio.Event()
        self._wake = asyncio.Event()
        self._reported = _Reported()
        self._backoff = Backoff(
            initial=settings.restart_backoff_initial_s, cap=settings.restart_backoff_cap_s, jitter=0.1
        )
        self._next_start = 0.0
        self._next_probe = 0.0
        self._responsive = False  # answered a probe since spawn (its signal handlers are in place)
        self._ever_ready = False  # reached READY since spawn
        self._ready_at: float | None = None
        self._not_ready_since: float | None = None
        self._unanswered_since: float | None = None
        self._reload_pending = False
        self._last_sigusr1 = -1e9
        self._reload_interval = settings.reload_interval(backend)
        self._task: asyncio.Task[None] | None = None

    # ---- control -----------------------------------------------------------------

    def start(self, adopted_pid: int | None = None) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if adopted_pid is not None:
            self.process = DaemonProcess(adopted_pid, None, self.wake)
            self._attempted = True
            self._unanswered_since = asyncio.get_running_loop().time()
            self._next_probe = 0.0
            # The file on disk is what the adopted daemon read; compare against it.
            with contextlib.suppress(OSError):
                self.written_peers = tuple(
                    imexcfg.parse_nodes_config((self.dir / NODES_CONFIG_FILE).read_text())
                )
            self._reload_pending = True  # it may have missed a change while nobody watched
            log.info(
                "adopted IMEX daemon of a previous agent", cd_uid=self.uid, node=self.node, pid=adopted_pid
            )
        self._task = asyncio.create_task(self._run(), name=f"imex-daemon-{self.uid}")

    def update(self, desired: DesiredDaemon) -> None:
        if desired != self.desired:
            self.desired = desired
            self.wake()

    def wake(self) -> None:
        self._wake.set()

    async def _end_task(self) -> None:
        if self._task is not None:
            self._task.cancel()
            # asyncio.wait, not `await task`: a cancellation of *our* caller must still propagate.
            await asyncio.wait([self._task])
            self._task = None

    async def stop(self) -> None:
        """Stop the daemon, remove the directory and the status record."""
        await self._end_task()
        if self.process is not None:
            await self.process.stop(self.settings.stop_grace_s)
            self.process.close()
            self.process = None
        self.ready.clear()
        shutil.rmtree(self.dir, ignore_errors=True)  # a handful of small files
        key = self.keys.daemon(self.uid, self.node)
        try:
            await with_retries(lambda: self.store.delete(key), what=f"delete {key}", deadline_s=10.0)
        except StoreUnavailable as exc:
            log.warning("could not delete daemon status", cd_uid=self.uid, node=self.node, error=str(exc))
        log.info("IMEX daemon stopped and domain directory removed", cd_uid=self.uid, node=self.node)

    async def detach(self) -> None:
        """Stop supervising but leave the daemon running (agent shutdown, adopted next time)."""
        await self._end_task()
        if self.process is not None:
            self.process.close()

    # ---- loop ----------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        failures = Backoff(initial=0.1, cap=5.0)
        while True:
            now = loop.time()
            try:
                await self._step(now)
                failures.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # disk full, directory removed under us, ...: retry, never die
                delay = failures.next_delay()
                log.exception(
                    "IMEX supervision step failed",
                    cd_uid=self.uid,
                    node=self.node,
                    error=str(exc),
                    retry_in_s=round(delay, 3),
                )
                await asyncio.sleep(delay)
            delay = self._next_deadline(loop.time()) - loop.time()
            if delay > 0 and not self._wake.is_set():
                await _wait_event(self._wake, delay)
            self._wake.clear()

    def _next_deadline(self, now: float) -> float:
        if self.process is None:
            deadline = self._next_start
        else:
            deadline = self._next_probe
            if self._responsive and (self._reload_pending or self.desired.peers != self.written_peers):
                deadline = min(deadline, self._last_sigusr1 + self._reload_interval)
        report = self._report_due(self._status_fields(), now)
        if report is not None:
            deadline = min(deadline, report)
        # Never spin: a deadline in the past waits a millisecond.
        return max(deadline, now + 0.001)

    async def _step(self, now: float) -> None:
        self._sync_files(now)
        if self.process is not None and not self.process.alive:
            self._handle_exit(now)
        if self.process is None and now >= self._next_start:
            self._spawn(now)
        if self.process is not None and self.process.alive:
            self._maybe_reload(now)
            if now >= self._next_probe:
                await self._poll(now)
        await self._report(asyncio.get_running_loop().time())

    # ---- files -----------------------------------------------------------------------

    def _sync_files(self, now: float) -> None:
        d = self.desired
        if d is not self._files_for:
            self._sync_config(d)
            self._files_for = d
        if d.peers == self.written_peers:
            return
        running = self.process is not None and self.process.alive
        if running and self._responsive and now - self._last_sigusr1 < self._reload_interval:
            return  # a burst of joins: coalesce into one rewrite + SIGUSR1 when the interval is up
        replace_file(self.dir / NODES_CONFIG_FILE, imexcfg.render_nodes_config(d.peers))
        if self.written_peers is not None:
            self.rt.generation += 1
            if running:
                self._reload_pending = True
        log.info(
            "IMEX nodes config written",
            cd_uid=self.uid,
            node=self.node,
            clique=d.clique_id,
            peers=len(d.peers),
            generation=self.rt.generation,
        )
        self.written_peers = d.peers

    def _sync_config(self, d: DesiredDaemon) -> None:
        config = render_domain_config(d, self.dir, self.settings)
        if config == self._written_config:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / CONFIG_FILE
        try:
            current = path.read_text()
        except OSError:
            current = None
        if current != config:
            if self.process is not None and self.process.alive:
                # Only the nodes config is re-read on SIGUSR1; the rest applies at the next start.
                log.warning("IMEX config changed under a running daemon", cd_uid=self.uid, node=self.node)
            replace_file(path, config)
        self._written_config = config

    # ---- process lifecycle ----------------------------------------------------------------

    def _argv(self) -> list[str]:
        config = str(self.dir / CONFIG_FILE)
        if self.settings.daemon_command:
            return [*self.settings.daemon_command, "-c", config]
        if self.backend == "simulated":
            return simulator_daemon_argv(config)
        return [self.settings.nvidia_imex_binary, "-c", config]

    def _spawn(self, now: float) -> None:
        argv = self._argv()
        try:
            log_fd = os.open(self.dir / LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            self._failed_start(now, f"cannot open the daemon log {self.dir / LOG_FILE}: {exc.strerror}")
            return
        try:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
                cwd=self.dir,
                start_new_session=True,  # outlives an agent restart; adopted by the next one
                close_fds=True,
            )
        except OSError as exc:
            os.close(log_fd)
            self._failed_start(now, f"cannot start {argv[0]}: {exc.strerror or exc}")
            return
        os.close(log_fd)
        self.process = DaemonProcess(popen.pid, popen, self.wake)
        try:
            write_pidfile(self.dir, popen.pid)
        except OSError as exc:  # the next agent still finds it by its command line
            log.warning("could not write the daemon pidfile", cd_uid=self.uid, node=self.node, error=str(exc))
        if self._attempted:
            self.rt.restarts += 1
        self._attempted = True
        if self.rt.state != pb.DaemonState.FAILED:
            # FAILED stays visible until a start finally succeeds; the previous error stays too.
            self.rt.state = pb.DaemonState.STARTING
        self._responsive = False
        self._ever_ready = False
        self._ready_at = None
        self._not_ready_since = None
        self._unanswered_since = now
        self._reload_pending = False  # it reads the current nodes config at start
        self._next_probe = now  # poll right away: READY may come within a few ms
        log.info(
            "IMEX daemon started",
            cd_uid=self.uid,
            node=self.node,
            pid=popen.pid,
            restarts=self.rt.restarts,
            peers=len(self.desired.peers),
        )

    def _failed_start(self, now: float, reason: str) -> None:
        self._attempted = True
        self.rt.consecutive_failures += 1
        self.rt.state = (
            pb.DaemonState.FAILED
            if self.rt.consecutive_failures >= self.settings.failed_after
            else pb.DaemonState.NOT_READY
        )
        self.rt.last_error = reason
        self.rt.log_lines = tail_lines(self.dir / LOG_FILE, self.settings.log_tail_lines)
        delay = self._backoff.next_delay()
        self._next_start = now + delay
        self.ready.clear()
        self._on_ready_changed()
        log.warning(
            "IMEX daemon down; restarting after backoff",
            cd_uid=self.uid,
            node=self.node,
            reason=reason,
            state=self.rt.state.name,
            retry_in_s=round(delay, 3),
            failures=self.rt.consecutive_failures,
        )

    def _handle_exit(self, now: float) -> None:
        assert self.process is not None
        process, self.process = self.process, None
        process.close()
        with contextlib.suppress(OSError):
            (self.dir / PID_FILE).unlink()
        if self._ready_at is not None and now - self._ready_at >= self.settings.stable_after_s:
            self._backoff.reset()
        if self._ever_ready:
            self.rt.consecutive_failures = 0
        self._failed_start(now, exit_reason(process.returncode))

    def _maybe_reload(self, now: float) -> None:
        if not self._reload_pending or not self._responsive:
            return
        if now - self._last_sigusr1 < self._reload_interval:
            return
        assert self.process is not None
        if self.process.send(signal.SIGUSR1):
            self._last_sigusr1 = now
            self._reload_pending = False
            log.info(
                "IMEX daemon reloaded (SIGUSR1)",
                cd_uid=self.uid,
                node=self.node,
                pid=self.process.pid,
                generation=self.rt.generation,
            )

    async def _poll(self, now: float) -> None:
        assert self.process is not None
        host = self.settings.cmd_bind_ip or self.desired.address
        result = await self.probe.probe(
            self.dir / CONFIG_FILE, host, self.settings.cmd_port, self.settings.query_timeout_s
        )
        now = asyncio.get_running_loop().time()
        if not self.process.alive:
            return  # the exit is handled on the next step
        s = self.settings
        fast, slow = s.poll_interval_starting_s, s.poll_interval_ready_s
        if result.answered:
            self._responsive = True
            self._unanswered_since = None
        elif self._unanswered_since is None:
            self._unanswered_since = now
        if result.ready:
            if self.rt.state != pb.DaemonState.READY:
                log.info("IMEX daemon ready", cd_uid=self.uid, node=self.node, pid=self.process.pid)
            self.rt.state = pb.DaemonState.READY
            self.rt.last_error = ""
            self.rt.log_lines = []
            self.rt.consecutive_failures = 0
            self._ever_ready = True
            self._ready_at = self._ready_at or now
            self._not_ready_since = None
            self._next_probe = now + (fast if self._reload_pending else slow)
            if not self.ready.is_set():
                self.ready.set()
                self._on_ready_changed()
            return
        # Fast while a change is fresh (a start, a lost peer); then at a calmer pace, since a
        # daemon that waits for a peer that is not there may wait long.
        since = self._not_ready_since if self._ever_ready else self.process.started
        fresh = since is None or now - since < _FRESH_S
        self._next_probe = now + (fast if fresh else min(slow, fast * 10))
        if (
            self._unanswered_since is not None
            and s.unresponsive_kill_s > 0
            and now - self._unanswered_since >= s.unresponsive_kill_s
        ):
            log.error(
                "IMEX daemon unresponsive; killing it",
                cd_uid=self.uid,
                node=self.node,
                pid=self.process.pid,
                silent_s=round(now - self._unanswered_since, 1),
            )
            self.process.send(signal.SIGKILL)
            return
        if not self._ever_ready:
            # Still coming up: STARTING, with the peers it waits for once that takes long.
            if self.rt.state != pb.DaemonState.FAILED:
                self.rt.state = pb.DaemonState.STARTING
            if now - self.process.started >= s.waiting_detail_after_s:
                self.rt.last_error = result.detail
            return
        if self._not_ready_since is None:
            self._not_ready_since = now
        if now - self._not_ready_since >= s.not_ready_debounce_s and self.rt.state == pb.DaemonState.READY:
            self.rt.state = pb.DaemonState.NOT_READY
            self.rt.last_error = result.detail or f"daemon state {result.state}"
            self.rt.log_lines = tail_lines(self.dir / LOG_FILE, s.log_tail_lines)
            self.ready.clear()
            self._on_ready_changed()
            log.warning("IMEX daemon not ready", cd_uid=self.uid, node=self.node, reason=self.rt.last_error)

    # ---- status -----------------------------------------------------------------------------

    def _status_fields(self) -> _StatusFields:
        rt = self.rt
        failing = rt.state in (pb.DaemonState.NOT_READY, pb.DaemonState.FAILED)
        return _StatusFields(
            rt.state,
            self.process.pid if self.process is not None and self.process.alive else 0,
            rt.restarts,
            rt.last_error,
            tuple(rt.log_lines) if failing else (),
            tuple(self.written_peers or ()),
            rt.generation,
        )

    def status_record(self) -> pb.DaemonStatus:
        f = self._status_fields()
        return pb.DaemonStatus(
            domain_uid=self.uid,
            node_name=self.node,
            state=f.state,
            pid=f.pid,
            restarts=f.restarts,
            last_error=f.last_error,
            last_log_lines=list(f.log_lines),
            peers=list(f.peers),
            config_generation=f.generation,
            updated_unix_ms=int(time.time() * 1000),
        )

    async def _load_previous(self) -> None:
        """Continue the counters of a previous agent incarnation, so the status stays monotonic."""
        previous = await self.store.get(self.keys.daemon(self.uid, self.node), pb.DaemonStatus)
        if previous is not None:
            self.rt.restarts += previous.value.restarts
            self.rt.generation += previous.value.config_generation
        self._previous_loaded = True

    def _report_due(self, fields: _StatusFields, now: float) -> float | None:
        """When the status should be written next (None: it says what it should)."""
        last = self._reported
        if fields == last.content or last.fence_failed_at == self.desired.member_revision:
            return None
        if last.content is not None and fields[:4] == last.content[:4]:
            return last.at + self.settings.status_coalesce_s  # only peers / generation moved
        return now

    async def _report(self, now: float) -> None:
        fields = self._status_fields()
        due = self._report_due(fields, now)
        if due is None or due > now:
            return
        fence = self.desired.member_revision
        try:
            if not self._previous_loaded:
                await self._load_previous()
                fields = self._status_fields()
        except TRANSIENT_ERRORS as exc:
            log.warning("daemon status read failed", cd_uid=self.uid, node=self.node, error=str(exc))
            return
        record = self.status_record()
        try:
            result = await self.store.txn(
                [Unchanged(self.keys.member(self.uid, self.node), fence)],
                [Put(self.keys.daemon(self.uid, self.node), record)],
            )
        except TRANSIENT_ERRORS as exc:
            log.warning("daemon status write failed", cd_uid=self.uid, node=self.node, error=str(exc))
            return
        if result.succeeded:
            self._reported = _Reported(fields, now)
        else:
            # Our member record changed (left, lost): the supervisor re-reads and decides.
            self._reported.fence_failed_at = fence
            self._on_fence_lost()


# ============================================================================ the supervisor


async def _resilient(
    open_watch: Callable[[], AsyncIterable[WatchEvent[M] | Resync[M]]], what: str
) -> AsyncIterator[WatchEvent[M] | Resync[M]]:
    """A watch that is reopened (starting with a fresh Resync) if its consumer code or the
    watch itself fails unexpectedly; the watch already survives etcd restarts on its own."""
    backoff = Backoff(initial=0.1, cap=5.0)
    while True:
        try:
            async for event in open_watch():
                yield event
                backoff.reset()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            delay = backoff.next_delay()
            log.error(
                "store watch failed; reopening", prefix=what, error=str(exc), retry_in_s=round(delay, 3)
            )
            await asyncio.sleep(delay)


class PrefixWatcher(Protocol):
    """``libs.state.watch.watch_prefix`` or a stand-in with the same stream semantics."""

    def __call__(self, store: Store, prefix: str, cls: type[M]) -> AsyncIterable[WatchEvent[M] | Resync[M]]: ...


class ImexSupervisor:
    """Keeps this node's IMEX daemons in line with its domain membership in the store."""

    def __init__(
        self,
        store: Store,
        node_name: str,
        hardware: NodeHardware,
        work_dir: Path,
        settings: ImexSettings,
        watch: PrefixWatcher = watch_prefix,
    ) -> None:
        self.store = store
        # How the store is watched; a host of many simulated agents shares one watch per prefix.
        self._watch = watch
        self.keys = store.keys
        self.node_name = node_name
        self.work_dir = work_dir
        self.settings = settings
        self.backend: ImexBackendName = settings.backend or hardware.imex_backend
        self.probe: ReadinessProbe = (
            SimulatorProbe()
            if self.backend == "simulated"
            else NvidiaCtlProbe(settings.nvidia_imex_ctl_binary)
        )
        self._runners: dict[str, DomainDaemon] = {}
        self._membership = Membership(None)
        self._wake = asyncio.Event()
        # The view of the store the reconciler works from, kept by two watches.
        self._binding: pb.NodeBinding | None = None
        self._binding_synced = False
        self._members_uid: str | None = None
        self._members: dict[str, tuple[pb.Member, int]] = {}
        # The same members by clique: a reconcile reads only its own clique's (<= 18), not the
        # whole domain's (a 256-node job spans 15 cliques).
        self._cliques: dict[str, dict[str, tuple[pb.Member, int]]] = {}
        self._members_synced = False
        self._members_task: asyncio.Task[None] | None = None
        # Replaced on every readiness change; waiters hold the old one (set = look again).
        self._state_changed = asyncio.Event()
        self._recovered = False

    # ---- public ---------------------------------------------------------------------

    def nudge(self, domain_uid: str) -> None:
        """Act now (e.g. right after this node joined or left `domain_uid`)."""
        log.debug("IMEX supervisor nudged", cd_uid=domain_uid, node=self.node_name)
        self._wake.set()

    async def wait_ready(self, domain_uid: str, timeout_s: float) -> bool:
        """True once this node's daemon for the domain is READY (at once for a non-fabric member);
        False if that does not happen within `timeout_s`."""

        def ready() -> bool:
            if self._membership.domain_uid == domain_uid and self._membership.non_fabric:
                return True
            runner = self._runners.get(domain_uid)
            return runner is not None and runner.ready.is_set()

        if ready():
            return True  # the common case on a prepare fast path: no reconcile needed
        self.nudge(domain_uid)
        try:
            async with asyncio.timeout(timeout_s):
                while not ready():
                    await self._state_changed.wait()
        except TimeoutError:
            return False
        return True

    def domain_dirs(self) -> list[Path]:
        """Per-domain directories that exist under the work directory."""
        try:
            return sorted(
                p for p in self.work_dir.iterdir() if p.is_dir() and _DOMAIN_DIR_NAME.fullmatch(p.name)
            )
        except FileNotFoundError:
            return []

    def daemon_pid(self, domain_uid: str) -> int | None:
        runner = self._runners.get(domain_uid)
        if runner is None or runner.process is None or not runner.process.alive:
            return None
        return runner.process.pid

    async def run(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        binding_watch = asyncio.create_task(self._watch_binding(), name=f"imex-binding-{self.node_name}")
        try:
            await self._reconcile_loop()
        finally:
            binding_watch.cancel()
            if self._members_task is not None:
                self._members_task.cancel()
            await asyncio.shield(self._shutdown())

    # ---- watches: they keep the in-memory view the reconciler works from ----------------------

    async def _watch_binding(self) -> None:
        key = self.keys.node_binding(self.node_name)
        async for event in _resilient(lambda: self._watch(self.store, key, pb.NodeBinding), key):
            if isinstance(event, Resync):
                mine = next((item for item in event.items if item.key == key), None)
                self._binding = mine.value if mine is not None else None
                self._binding_synced = True
            elif event.key == key:  # the prefix also matches longer names (node1 / node10)
                self._binding = event.value
            else:
                continue
            log.debug(
                "binding view updated",
                node=self.node_name,
                cd_uid=self._binding.domain_uid if self._binding else None,
                resync=isinstance(event, Resync),
            )
            self._wake.set()

    async def _watch_members(self, domain_uid: str) -> None:
        prefix = self.keys.members(domain_uid)
        async for event in _resilient(lambda: self._watch(self.store, prefix, pb.Member), prefix):
            if self._members_uid != domain_uid:
                return
            if isinstance(event, Resync):
                self._members, self._cliques = {}, {}
                for item in event.items:
                    self._set_member(Keys.last_segment(item.key), (item.value, item.mod_revision))
                self._members_synced = True
                self._wake.set()
                continue
            name = Keys.last_segment(event.key)
            before = self._set_member(name, None if event.value is None else (event.value, event.revision))
            if self._member_event_concerns_me(name, before[0] if before else None, event.value):
                self._wake.set()

    def _set_member(self, name: str, entry: tuple[pb.Member, int] | None) -> tuple[pb.Member, int] | None:
        """Put (or with None remove) a member in both views; returns the entry it replaced."""
        before = self._members.pop(name, None)
        if before is not None:
            bucket = self._cliques.get(before[0].clique_id)
            if bucket is not None:
                bucket.pop(name, None)
                if not bucket:
                    del self._cliques[before[0].clique_id]
        if entry is not None:
            self._members[name] = entry
            self._cliques.setdefault(entry[0].clique_id, {})[name] = entry
        return before

    def _member_event_concerns_me(self, name: str, before: pb.Member | None, after: pb.Member | None) -> bool:
        """Whether a member change can alter this node's daemon: its own record, or a peer entering,
        changing in or leaving this node's clique. Other cliques never reach its nodes config, and
        waking every member's reconciler on every join of a large domain costs O(N^2) per node."""
        if name == self.node_name:
            return True
        mine = self._members.get(self.node_name)
        if mine is None:
            return False  # nothing to configure until this node's own record arrives (that wakes it)
        clique = mine[0].clique_id
        return any(m is not None and m.clique_id == clique for m in (before, after))

    def _follow_members_of(self, domain_uid: str | None) -> None:
        if self._members_uid == domain_uid:
            return
        if self._members_task is not None:
            self._members_task.cancel()
            self._members_task = None
        self._members_uid = domain_uid
        self._members, self._cliques = {}, {}
        self._members_synced = False
        if domain_uid is not None:
            self._members_task = asyncio.create_task(
                self._watch_members(domain_uid), name=f"imex-members-{domain_uid}"
            )

    # ---- reconcile --------------------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        backoff = Backoff(initial=0.05, cap=2.0)
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._reconcile()
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # store down, disk full, ...: never crash, retry
                delay = backoff.next_delay()
                log.warning(
                    "IMEX reconcile failed; retrying",
                    node=self.node_name,
                    error=str(exc) or type(exc).__name__,
                    retry_in_s=round(delay, 3),
                )
                await asyncio.sleep(delay)
                self._wake.set()

    async def _reconcile(self) -> None:
        if not self._binding_synced:
            return
        binding = self._binding
        self._follow_members_of(binding.domain_uid if binding is not None else None)
        if binding is not None and not self._members_synced:
            return  # the members watch has not listed yet: decide nothing on half a view
        mine = self._members.get(self.node_name)
        relevant = (
            list(self._cliques.get(mine[0].clique_id, {}).values())
            if mine is not None and mine[0].clique_id
            else [mine] if mine is not None else []
        )
        membership = membership_of(self.node_name, binding, relevant)
        desired = membership.desired
        if not self._recovered:
            await self._recover(desired)
            self._recovered = True
        for uid in [u for u in self._runners if desired is None or u != desired.domain_uid]:
            # Stop before starting another: the next daemon binds the same address and ports.
            await self._runners.pop(uid).stop()
        await self._remove_stale_dirs(desired.domain_uid if desired else None)
        if desired is not None:
            runner = self._runners.get(desired.domain_uid)
            if runner is None:
                self._start_runner(desired, adopted_pid=None)
            else:
                runner.update(desired)
        self._membership = membership
        self._signal_change()

    def _start_runner(self, desired: DesiredDaemon, adopted_pid: int | None) -> DomainDaemon:
        runner = DomainDaemon(
            self.store,
            self.settings,
            self.backend,
            self.probe,
            self.work_dir / desired.domain_uid,
            desired,
            self._signal_change,
            self._wake.set,
        )
        self._runners[desired.domain_uid] = runner
        runner.start(adopted_pid)
        return runner

    def _signal_change(self) -> None:
        event, self._state_changed = self._state_changed, asyncio.Event()
        event.set()

    async def _recover(self, desired: DesiredDaemon | None) -> None:
        """Adopt the previous incarnation's daemon for the current domain if it is still right;
        kill every other leftover daemon."""
        for domain_dir in self.domain_dirs():
            pids = leftover_pids(domain_dir)
            if not pids:
                continue
            uid = domain_dir.name
            adoptable = False
            if desired is not None and uid == desired.domain_uid and len(pids) == 1:
                expected = render_domain_config(desired, domain_dir, self.settings)
                with contextlib.suppress(OSError):
                    adoptable = (domain_dir / CONFIG_FILE).read_text() == expected
            if adoptable:
                assert desired is not None
                self._start_runner(desired, adopted_pid=pids[0])
                continue
            for pid in pids:
                log.warning("stopping leftover IMEX daemon", cd_uid=uid, node=self.node_name, pid=pid)
                process = DaemonProcess(pid, None, lambda: None)
                await process.stop(self.settings.stop_grace_s)
                process.close()

    async def _remove_stale_dirs(self, keep: str | None) -> None:
        for domain_dir in self.domain_dirs():
            if domain_dir.name == keep or domain_dir.name in self._runners:
                continue
            for pid in leftover_pids(domain_dir):
                process = DaemonProcess(pid, None, lambda: None)
                await process.stop(self.settings.stop_grace_s)
                process.close()
            log.info("removing stale IMEX domain directory", cd_uid=domain_dir.name, node=self.node_name)
            shutil.rmtree(domain_dir, ignore_errors=True)
            with contextlib.suppress(*TRANSIENT_ERRORS):
                await self.store.delete(self.keys.daemon(domain_dir.name, self.node_name))

    async def _shutdown(self) -> None:
        runners, self._runners = list(self._runners.values()), {}
        for runner in runners:
            if self.settings.stop_daemons_on_exit:
                await runner.stop()
            else:
                await runner.detach()
