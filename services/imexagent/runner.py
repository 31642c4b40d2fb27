"""The async shell around one domain's daemon on this node.

It owns the domain directory's files, the process, and the ``daemons/<uid>/<node>`` status. The
decisions are the pure machines' (`DaemonLifecycle`, `ReloadPolicy`); this module feeds them
what happened and does what they say:

* start: config, nodes config (18 slot names) and hosts written, then the daemon spawned;
* a slot's address changed: the hosts file is replaced at once (the daemon's reconnect loop
  resolves every dial afresh), then SIGUSR1 per the policy (at most one per 5.2 s);
* its own identity changed (clique, index or address: what fixes its node ID and bind address):
  SIGTERM, then a new daemon on rewritten files. Nothing else restarts a running daemon;
* it died: restarted after the lifecycle's backoff, with the exit reason and log tail reported;
* it cannot run here (the node's driver is older than host names in the nodes config need):
  never started, FAILED with reason ImexDriverTooOld naming the version needed;
* silent for ``unresponsive_kill_s``: stopped (SIGTERM, SIGKILL after the grace), then restarted;
* a new instance waiting for the nodes that imported its memory before an unclean stop
  (WAITING_FOR_RECOVERY): reason ImexDaemonWaitingForRecovery, naming the members not connected;
* status: READY/STARTING/NOT_READY/FAILED, node ID, instance, the member nodes whose slot it
  reports CONNECTED and those it lost (DISCONNECTED), the slot addresses and the count of hosts
  rewrites; a failed mesh credential reload as the last error of a daemon that stays READY.
  Written when it changes, fenced on the member record's revision so a status never outlives
  its member.

Blocking work (fork/exec, fsynced writes, rmtree) runs in worker threads with a deadline.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import structlog

from libs.contract.names import REASON_DRIVER_TOO_OLD, REASON_WAITING_FOR_RECOVERY
from libs.gen.computedomain.state import v1 as pb
from libs.imex.config import MeshTlsFiles
from libs.imex.daemon_port import DaemonLauncher, StartedProcess
from libs.imex.daemon_state import STATE_WAITING_FOR_RECOVERY
from libs.imex.driver import host_names_refusal
from libs.runtime.backoff import Backoff
from libs.state.store import TRANSIENT_ERRORS, Put, Store, StoreUnavailable, Unchanged, with_retries
from libs.state.watch import PrefixWatcher, watch_prefix
from services.imexagent import process as proc
from services.imexagent.daemon_lifecycle import (
    FAILED,
    NOT_READY,
    READY,
    DaemonLifecycle,
    ProbeAction,
    ReloadPolicy,
)
from services.imexagent.domain_dir import DomainDir
from services.imexagent.mesh_creds import MeshCredentials
from services.imexagent.probe import CONNECTED, CtlProbe, ProbeResult, ReadinessProbe
from services.imexagent.probe_pace import ProbePace
from services.imexagent.settings import ImexSettings
from services.imexagent.slot_map import (
    DesiredDaemon,
    Identity,
    connected_nodes,
    disconnected_nodes,
    recently_connected,
)

log = structlog.get_logger(__name__)

T = TypeVar("T")
_STATUS_RETRY_S = 1.0  # a status write that failed (store unreachable) is tried again after this


Launcher = Callable[[list[str], Path, Path], StartedProcess]


def _start_in_dir(
    directory: DomainDir,
    desired: DesiredDaemon,
    settings: ImexSettings,
    mesh: MeshTlsFiles | None,
    argv: list[str],
    launch: Launcher,
) -> tuple[str, StartedProcess, OSError | None]:
    """Write the config and hosts files, start the daemon, record its pidfile (blocking; one
    trip to a worker thread for all three: under load each trip waits for the GIL).

    Returns the hosts text written, the process, and the pidfile's error if only that failed."""
    hosts = directory.prepare_start(desired, settings, mesh)
    popen = launch(argv, directory.path, directory.log)
    try:
        proc.write_pidfile(directory.path, popen.pid)
    except OSError as exc:
        return hosts, popen, exc
    return hosts, popen, None


def _instance_of(pid: int) -> str:
    return f"pid-{pid}-{proc.proc_start_ticks(pid) or 0}"


class StatusFields(NamedTuple):
    """What a DaemonStatus says, minus its timestamp (compared to skip unchanged writes)."""

    state: pb.DaemonState
    pid: int
    restarts: int
    last_error: str
    node_id: int
    instance: str
    log_lines: tuple[str, ...]
    reason: str
    # Below: coalesced (a burst of joins or connection changes is written once).
    peers: tuple[str, ...]
    generation: int
    connected: tuple[str, ...]
    disconnected: tuple[str, ...]


_IMMEDIATE = 8  # fields before this index are written at once when they change


@dataclass
class _Reported:
    content: StatusFields | None = None
    at: float = -1e9  # loop time of the write
    fence_failed_at: int = -1  # member revision a fenced write failed at (no retry until it changes)
    retry_at: float = -1e9  # after a failed write (store unreachable), not before this


class DomainDaemon:
    """Runs, tells to re-resolve, restarts and finally stops the daemon of one domain here."""

    def __init__(
        self,
        store: Store,
        settings: ImexSettings,
        launcher: DaemonLauncher,
        probe: ReadinessProbe,
        domain_dir: DomainDir,
        desired: DesiredDaemon,
        on_ready_changed: Callable[[], None],
        on_fence_lost: Callable[[], None],
        watch: PrefixWatcher = watch_prefix,
    ) -> None:
        self.store = store
        self.keys = store.keys
        self.settings = settings
        self.launcher = launcher
        self.probe = probe
        self.dir = domain_dir
        self.desired = desired
        self.uid = desired.domain_uid
        self.node = desired.node_name
        self._on_ready_changed = on_ready_changed
        self._on_fence_lost = on_fence_lost
        self.lifecycle = DaemonLifecycle(settings.lifecycle_policy())
        self.reload = ReloadPolicy(
            settings.reload_min_interval_s, settings.reload_settle_s, settings.reload_settle_max_s
        )
        self.process: proc.DaemonProcess | None = None
        self.identity: Identity | None = None  # of the files on disk / the running daemon
        self.written_hosts: str | None = None
        self.generation = 0
        self.sigusr1_sent = 0
        self.log_lines: list[str] = []
        self.last_probe: ProbeResult | None = None
        # member node -> when the daemon last reported its link CONNECTED (loop time)
        self._seen_connected: dict[str, float] = {}
        # The slot addresses `written_hosts` was rendered from (None: not known yet).
        self._hosts_for: tuple[str, ...] | None = None
        self.ready = asyncio.Event()
        self._wake = asyncio.Event()
        self._reported = _Reported()
        self._previous_loaded = False
        self._next_probe = 0.0
        self.pace = ProbePace(
            settings.poll_interval_starting_s,
            settings.poll_interval_ready_s,
            settings.poll_interval_waiting_s,
        )
        self._task: asyncio.Task[None] | None = None
        # Why no daemon can run on this node for this domain ("" = it can).
        self.refusal = (
            host_names_refusal(settings.node_driver_version) if settings.node_driver_version else ""
        )
        # nvidia-imex shows no instance: a process (pid and start time) is one instance.
        self._process_instance = ""
        self.mesh = MeshCredentials(
            store,
            domain_dir.path,
            self.uid,
            self.node,
            desired.identity,
            self._mesh_changed,
            io_timeout_s=settings.io_timeout_s,
            watch=watch,
            mode=desired.mesh_mode,
        )

    # ---- control ------------------------------------------------------------------------

    def start(self, adopted_pid: int | None = None) -> None:
        if adopted_pid is not None:
            now = asyncio.get_running_loop().time()
            self.process = proc.DaemonProcess(adopted_pid, None, self.wake)
            self._process_instance = _instance_of(adopted_pid)
            self.identity = self.desired.identity
            self.lifecycle.adopted(now)
            self._next_probe = now
            self.pace.fresh(now)
            self.written_hosts = self.dir.read(self.dir.hosts)  # what the adopted daemon resolves with
            log.info(
                "adopted IMEX daemon of a previous agent", cd_uid=self.uid, node=self.node, pid=adopted_pid
            )
        self._task = asyncio.create_task(self._run(), name=f"imex-daemon-{self.uid}")
        self.mesh.start()

    def update(self, desired: DesiredDaemon) -> None:
        if desired != self.desired:
            self.desired = desired
            self.mesh.want(desired.identity)
            self.wake()

    def _mesh_changed(self, rotated: bool) -> None:
        """New mesh credentials on disk: a daemon waiting for them may start; a running one reloads."""
        if rotated and self.process is not None:
            self.reload.changed(self._now())
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.alive else None

    async def stop(self) -> None:
        """Stop the daemon (SIGTERM, SIGKILL after the grace), remove the directory and status."""
        await self._end_task()
        await self.mesh.stop()
        if self.process is not None:
            await self.process.stop(self.settings.stop_grace_s)
            self.process.close()
            self.process = None
        self._set_ready(False)
        try:
            await self._blocking(self.dir.remove)
        except (OSError, TimeoutError) as exc:
            log.warning("could not remove the domain directory", cd_uid=self.uid, error=str(exc))
        key = self.keys.daemon(self.uid, self.node)
        try:
            await with_retries(lambda: self.store.delete(key), what=f"delete {key}", deadline_s=10.0)
        except StoreUnavailable as exc:
            log.warning("could not delete daemon status", cd_uid=self.uid, node=self.node, error=str(exc))
        log.info("IMEX daemon stopped and domain directory removed", cd_uid=self.uid, node=self.node)

    async def detach(self) -> None:
        """Stop supervising but leave the daemon running (agent shutdown; adopted next time)."""
        await self._end_task()
        await self.mesh.stop()
        if self.process is not None:
            self.process.close()

    async def _end_task(self) -> None:
        if self._task is not None:
            self._task.cancel()
            # asyncio.wait, not `await task`: a cancellation of *our* caller must still propagate.
            await asyncio.wait([self._task])
            self._task = None

    # ---- loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        failures = Backoff(initial=0.1, cap=5.0)
        while True:
            self._wake.clear()
            try:
                await self._step()
                failures.reset()
            except asyncio.CancelledError:
                raise
            except Exception:  # disk full, directory removed under us, ...: retry, never die
                delay = failures.next_delay()
                log.exception(
                    "IMEX supervision step failed",
                    cd_uid=self.uid,
                    node=self.node,
                    retry_in_s=round(delay, 3),
                )
                await asyncio.sleep(delay)
                continue
            now = loop.time()
            delay = self._next_deadline(now) - now
            if delay > 0 and not self._wake.is_set():
                await proc.wait_event(self._wake, delay)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _next_deadline(self, now: float) -> float:
        lc = self.lifecycle
        if self.process is None:
            # Waiting for mesh credentials: their arrival wakes the loop (refused: nothing to do).
            deadline = lc.next_start_at if self.mesh.ready_for(self.desired.identity) else now + 60.0
            deadline = min(deadline, now + 60.0)
        else:
            deadline = self._next_probe
            due = self.reload.due_at()
            if due is not None and lc.answered:
                deadline = min(deadline, due)
        report = self._report_due(self._status_fields(), now)
        if report is not None:
            deadline = min(deadline, report)
        return max(deadline, now + 0.001)  # never spin

    async def _step(self) -> None:
        d = self.desired
        if self.process is not None and self.process.alive and d.identity != self.identity:
            await self._replace()
        if self.process is not None and not self.process.alive:
            self._handle_exit()
        if self.refusal and self.process is None:
            if self.lifecycle.state != FAILED or self.lifecycle.last_error != self.refusal:
                self.lifecycle.refused(self.refusal)
                log.error("IMEX daemon not started", cd_uid=self.uid, node=self.node, reason=self.refusal)
        elif (
            self.process is None and self.lifecycle.start_due(self._now()) and self.mesh.ready_for(d.identity)
        ):
            await self._spawn()
        if self.process is not None and self.process.alive:
            await self._sync_hosts()
            if self.reload.should_send(self._now(), self.lifecycle.answered):
                self._send_sigusr1()
            if self._now() >= self._next_probe:
                await self._poll()
        await self._report()

    # ---- process ------------------------------------------------------------------------

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        async with asyncio.timeout(self.settings.io_timeout_s):
            return await asyncio.to_thread(fn, *args)

    def _launch(self, argv: list[str], cwd: Path, log_path: Path) -> StartedProcess:
        """Start the daemon through the IMEX daemon port, in a mount namespace of its own with
        the domain's hosts file over /etc/hosts."""
        return self.launcher.spawn(argv, cwd, log_path, self.dir.hosts)

    def _argv(self) -> list[str]:
        return self.launcher.argv(self.dir.config, self.dir.hosts)

    async def _replace(self) -> None:
        assert self.process is not None and self.identity is not None
        log.warning(
            "IMEX daemon identity changed; restarting it",
            cd_uid=self.uid,
            node=self.node,
            old=(self.identity.index, self.identity.address),
            new=(self.desired.index, self.desired.address),
        )
        await self.process.stop(self.settings.stop_grace_s)
        self.process.close()
        self.process = None
        await self._blocking(proc.remove_pidfile, self.dir.path)
        self.lifecycle.replaced(self._now())
        self._set_ready(False)

    def _handle_exit(self) -> None:
        assert self.process is not None
        process, self.process = self.process, None
        process.close()
        reason = proc.exit_reason(process.returncode)
        now = self._now()
        delay = self.lifecycle.exited(now, reason)
        proc.remove_pidfile(self.dir.path)  # a small unlink: no thread needed
        self.log_lines = proc.tail_lines(self.dir.log, self.settings.log_tail_lines)
        self._set_ready(False)
        log.warning(
            "IMEX daemon exited; restarting after backoff",
            cd_uid=self.uid,
            node=self.node,
            pid=process.pid,
            reason=reason,
            state=self.lifecycle.state.name,
            retry_in_s=round(delay, 3),
        )

    async def _spawn(self) -> None:
        d = self.desired
        try:
            hosts, popen, pidfile_error = await self._blocking(
                _start_in_dir, self.dir, d, self.settings, self.mesh.files(), self._argv(), self._launch
            )
        except (OSError, TimeoutError, ValueError) as exc:
            reason = (
                f"cannot start the IMEX daemon: {getattr(exc, 'strerror', None) or exc or type(exc).__name__}"
            )
            delay = self.lifecycle.start_failed(self._now(), reason)
            self.log_lines = proc.tail_lines(self.dir.log, self.settings.log_tail_lines)
            log.warning(
                "IMEX daemon start failed", cd_uid=self.uid, node=self.node, reason=reason, retry_in_s=delay
            )
            return
        now = self._now()
        self.process = proc.DaemonProcess(popen.pid, popen, self.wake)
        self._process_instance = _instance_of(popen.pid)
        if self.written_hosts is not None and hosts != self.written_hosts:
            self.generation += 1
        self.identity, self.written_hosts = d.identity, hosts
        self.lifecycle.started(now)
        self.reload.daemon_started()
        self.last_probe = None
        self._seen_connected.clear()  # a new instance: its links are new
        self._next_probe = now  # READY may come within a few ms
        self.pace.fresh(now)
        if isinstance(self.probe, CtlProbe):
            self.probe.node_id = d.index
        if pidfile_error is not None:  # the next agent still finds it by its command line
            log.warning(
                "could not write the daemon pidfile",
                cd_uid=self.uid,
                node=self.node,
                error=str(pidfile_error),
            )
        log.info(
            "IMEX daemon started",
            cd_uid=self.uid,
            node=self.node,
            pid=popen.pid,
            index=d.index,
            restarts=self.lifecycle.restarts,
        )

    async def _sync_hosts(self) -> None:
        # Taken before the write's await: a membership change during it must not be taken as written.
        addresses = self.desired.slot_addresses
        if addresses == self._hosts_for:
            return  # the common case on every step: nothing moved
        text = self.dir.render_hosts(self.desired)
        if text == self.written_hosts:
            self._hosts_for = addresses
            return
        # On the loop: a small write without fsync (domain_dir.py); through the shared thread pool
        # it queued behind every other blocking call of the process. In place: every daemon
        # sees the file through a bind mount over its /etc/hosts.
        self.dir.write_hosts(text, in_place=True)
        self.written_hosts = text
        self._hosts_for = addresses
        self.generation += 1
        self.reload.changed(self._now())
        self.pace.fresh(self._now())
        log.info("IMEX slot addresses rewritten", cd_uid=self.uid, node=self.node, generation=self.generation)

    def _send_sigusr1(self) -> None:
        assert self.process is not None
        if self.process.send(signal.SIGUSR1):
            self.sigusr1_sent += 1
            now = self._now()
            self.pace.fresh(now)
            self._next_probe = min(self._next_probe, now + self.settings.poll_interval_starting_s)
            log.info(
                "IMEX daemon told to re-resolve (SIGUSR1)",
                cd_uid=self.uid,
                node=self.node,
                pid=self.process.pid,
            )

    async def _poll(self) -> None:
        assert self.process is not None
        s = self.settings
        result = await self.probe.probe(self.dir.config, self.process.pid, s.query_timeout_s)
        now = self._now()
        if self.process is None or not self.process.alive:
            return  # the exit is handled on the next step
        if result.answered:
            previous = self.last_probe
            if result.credentials_error and (
                previous is None or previous.credentials_error != result.credentials_error
            ):
                log.error(
                    "IMEX daemon could not reload its mesh credentials; it keeps the previous ones",
                    cd_uid=self.uid,
                    node=self.node,
                    error=result.credentials_error,
                )
            self.last_probe = result
            for name in connected_nodes(self.desired, dict(result.connections)):
                self._seen_connected[name] = now
        was = self.lifecycle.state
        action = self.lifecycle.probed(
            now, result.answered, result.ready, result.detail or f"daemon {result.state}"
        )
        if action is ProbeAction.STOP:
            log.error(
                "IMEX daemon unresponsive; stopping it (SIGTERM, then SIGKILL after the grace)",
                cd_uid=self.uid,
                node=self.node,
                pid=self.process.pid,
                grace_s=s.stop_grace_s,
            )
            # Bounded: a hung daemon that ignores SIGTERM is killed after the grace; its exit is
            # then handled (and it restarted) like any other.
            await self.process.stop(s.stop_grace_s)
            return
        state = self.lifecycle.state
        if state != was and state in (NOT_READY, FAILED):
            self.log_lines = proc.tail_lines(self.dir.log, s.log_tail_lines)
        if state != was:
            log.info(
                "IMEX daemon state", cd_uid=self.uid, node=self.node, state=state.name, detail=result.detail
            )
        self._set_ready(self.lifecycle.ready)
        settled = (
            state == READY
            and self.lifecycle.not_ready_since is None
            and self._connected_to_all(dict(result.connections))
        )
        self._next_probe = now + self.pace.interval(now, settled)
        due = self.lifecycle.not_ready_due_at()
        if due is not None:
            self._next_probe = min(self._next_probe, max(due, now + s.poll_interval_starting_s))

    def _connected_to_all(self, connections: dict[int, str]) -> bool:
        d = self.desired
        members = sum(1 for i, name in enumerate(d.slot_nodes) if name and i != d.index)
        return len(connected_nodes(d, connections)) == members

    def _set_ready(self, ready: bool) -> None:
        if ready != self.ready.is_set():
            if ready:
                self.ready.set()
            else:
                self.ready.clear()
            self._on_ready_changed()

    # ---- status -------------------------------------------------------------------------

    def _status_fields(self) -> StatusFields:
        lc = self.lifecycle
        running = self.process is not None and self.process.alive
        probe = self.last_probe if running else None
        d = self.desired
        node_id = probe.node_id if probe is not None and probe.node_id >= 0 else -1
        if node_id < 0 and running and lc.ready:
            node_id = d.index  # READY means it identified itself, and its slot is the only match
        instance = probe.instance if probe is not None else ""
        if not instance and running:
            instance = self._process_instance
        connected = (
            tuple(
                recently_connected(d, self._seen_connected, self._now(), self.settings.disconnect_debounce_s)
            )
            if probe is not None
            else ()
        )
        disconnected = (
            tuple(n for n in disconnected_nodes(d, dict(probe.connections)) if n not in connected)
            if probe is not None
            else ()
        )
        failing = lc.state in (NOT_READY, FAILED)
        # A failed credential reload leaves the daemon READY with its mesh: shown, not failing.
        reason, last_error = "", lc.last_error or (probe.credentials_error if probe is not None else "")
        if self.refusal and not running:
            reason = REASON_DRIVER_TOO_OLD
        elif probe is not None and probe.state == STATE_WAITING_FOR_RECOVERY:
            reason, last_error = REASON_WAITING_FOR_RECOVERY, self._recovery_wait(probe)
        return StatusFields(
            lc.state,
            self.pid or 0,
            lc.restarts,
            last_error,
            node_id,
            instance,
            tuple(self.log_lines) if failing else (),
            reason,
            tuple(d.slot_addresses) if self.written_hosts is not None else (),
            self.generation,
            connected,
            disconnected,
        )

    def _recovery_wait(self, probe: ProbeResult) -> str:
        """What a daemon waiting for recovery waits for, in the members' names where it can."""
        d = self.desired
        base = (
            "IMEX daemon WAITING_FOR_RECOVERY: it was not stopped cleanly, and waits (with no time "
            "limit) until every node that had imported its memory reconnects"
        )
        if not probe.connections:
            return base
        missing = [
            f"{name} (slot {i})"
            for i, name in enumerate(d.slot_nodes)
            if name and i != d.index and probe.connections.get(i) != CONNECTED
        ]
        if missing:
            return f"{base}; members not connected now: {', '.join(missing)}"
        return f"{base}; every current member is connected: it waits for a node no longer in the domain"

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
            node_id=f.node_id,
            instance=f.instance,
            connected_nodes=list(f.connected),
            reason=f.reason,
            disconnected_nodes=list(f.disconnected),
            updated_unix_ms=int(time.time() * 1000),
        )

    def _report_due(self, fields: StatusFields, now: float) -> float | None:
        """When the status should be written next (None: it says what it should)."""
        last = self._reported
        if fields == last.content or last.fence_failed_at == self.desired.member_revision:
            return None
        if last.content is not None and fields[:_IMMEDIATE] == last.content[:_IMMEDIATE]:
            return max(last.at + self.settings.status_coalesce_s, last.retry_at)
        return max(now, last.retry_at)

    async def _load_previous(self) -> None:
        """Continue the counters of a previous agent incarnation, so the status stays monotonic."""
        previous = await self.store.get(self.keys.daemon(self.uid, self.node), pb.DaemonStatus)
        if previous is not None:
            self.lifecycle.restarts += previous.value.restarts
            self.generation += previous.value.config_generation
        self._previous_loaded = True

    async def _report(self) -> None:
        now = self._now()
        due = self._report_due(self._status_fields(), now)
        if due is None or due > now:
            return
        fence = self.desired.member_revision
        try:
            if not self._previous_loaded:
                await self._load_previous()
            fields = self._status_fields()
            record = self.status_record()
            result = await self.store.txn(
                [Unchanged(self.keys.member(self.uid, self.node), fence)],
                [Put(self.keys.daemon(self.uid, self.node), record)],
            )
        except TRANSIENT_ERRORS as exc:
            log.warning("daemon status write failed", cd_uid=self.uid, node=self.node, error=str(exc))
            self._reported.retry_at = self._now() + _STATUS_RETRY_S
            return
        if result.succeeded:
            self._reported = _Reported(fields, now)
            log.debug(
                "daemon status written",
                cd_uid=self.uid,
                node=self.node,
                state=pb.DaemonState(record.state).name,
                revision=result.revision,
            )
        else:
            # Our member record changed (left, lost, deleted): the supervisor re-reads and decides.
            self._reported.fence_failed_at = fence
            self._on_fence_lost()
