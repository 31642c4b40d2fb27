"""IMEX daemon supervision on one node: the store's view of this node's domain, made real.

Level-triggered: two watches keep an in-memory view of this node's binding
(``nodebindings/<node>``) and of its domain's members (``members/<uid>/``, kept by clique); each
starts with a full listing, and a re-listing replaces the view. The reconciler makes the local
daemons match the view, whatever sequence of events led to it:

* this node a member (ACTIVE, or LOST) of D with a slot -> one daemon for D (`DomainDaemon`),
  told about every change of its clique's slot addresses;
* started when the member is ACTIVE; kept while it is LOST (a lapsed lease is usually a node that
  is fine, and restarting a daemon drops every import of memory it exported); never stopped
  because of the node record;
* member record gone or binding gone -> daemon stopped, directory and status removed.

At its first reconcile the supervisor adopts a daemon left running by the previous incarnation of
the agent when it serves the domain with the same identity and configuration (same pid: a restart
of the agent disturbs no job), and stops every other leftover daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterable, AsyncIterator, Callable
from pathlib import Path

import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.hardware import ImexBackendName, NodeHardware
from libs.imex.daemon_port import ImexDaemon, open_imex_daemon
from libs.imex.nvidia_imex import ExecCtl, ExecLauncher
from libs.runtime.backoff import Backoff
from libs.state.keys import Keys
from libs.state.store import TRANSIENT_ERRORS, Store
from libs.state.watch import M, PrefixWatcher, Resync, WatchEvent, watch_prefix
from services.imexagent import process as proc
from services.imexagent.domain_dir import DomainDir, domain_dirs
from services.imexagent.probe import CtlProbe, ReadinessProbe
from services.imexagent.runner import DomainDaemon
from services.imexagent.settings import ImexSettings
from services.imexagent.slot_map import DesiredDaemon, Membership, membership_of

log = structlog.get_logger(__name__)


def imex_daemon_for(backend: ImexBackendName, settings: ImexSettings) -> ImexDaemon:
    """The IMEX daemon port's implementation for `backend`, with its daemon or ctl replaced by
    the command the settings give (tests run stand-ins that way)."""
    port = open_imex_daemon(
        backend, daemon_binary=settings.nvidia_imex_binary, ctl_binary=settings.nvidia_imex_ctl_binary
    )
    return ImexDaemon(
        ExecLauncher(settings.daemon_command) if settings.daemon_command else port.launcher,
        ExecCtl(settings.ctl_command) if settings.ctl_command else port.ctl,
    )


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
        self.hardware = hardware
        self.backend: ImexBackendName = settings.backend or hardware.imex_backend
        self.daemon = imex_daemon_for(self.backend, settings)
        self._runners: dict[str, DomainDaemon] = {}
        self._membership = Membership(None)
        self._wake = asyncio.Event()
        self._binding: pb.NodeBinding | None = None
        self._binding_synced = False
        self._members_uid: str | None = None
        self._members: dict[str, tuple[pb.Member, int]] = {}
        # The same members by clique: a reconcile reads only its own clique's (<= 18).
        self._cliques: dict[str, dict[str, tuple[pb.Member, int]]] = {}
        # Each member's clique, read from its record once: every member of a large domain sees
        # every other's changes, and a message field read costs microseconds.
        self._clique_of: dict[str, str] = {}
        # The domain whose record of this node was read directly (once per binding).
        self._own_member_read: str | None = None
        self._members_synced = False
        self._members_task: asyncio.Task[None] | None = None
        # Replaced on every readiness change; waiters hold the old one (set = look again).
        self._state_changed = asyncio.Event()
        self._recovered = False

    def make_probe(self) -> ReadinessProbe:
        """A daemon's probe: its ctl in its mount namespace (the simulator's in-process)."""
        return CtlProbe(self.daemon.ctl, placeholder=self.settings.placeholder_address)

    def nudge(self, domain_uid: str) -> None:
        """Act now (e.g. right after this node joined or left `domain_uid`)."""
        self._wake.set()

    async def wait_ready(self, domain_uid: str, timeout_s: float, node_id: int | None = None) -> bool:
        """True once this node's daemon for the domain is READY (at once for a non-fabric member),
        and when `node_id` is given, running as that slot; False if that does not happen within
        `timeout_s`. (The in-process form of what the kubelet plugin reads from the store.)"""

        def ready() -> bool:
            if self._membership.domain_uid == domain_uid and self._membership.non_fabric:
                return True
            runner = self._runners.get(domain_uid)
            if runner is None or not runner.ready.is_set():
                return False
            return node_id is None or (runner.identity is not None and runner.identity.index == node_id)

        if ready():
            return True
        self.nudge(domain_uid)
        try:
            async with asyncio.timeout(timeout_s):
                while not ready():
                    await self._state_changed.wait()
        except TimeoutError:
            return False
        return True

    def runner(self, domain_uid: str) -> DomainDaemon | None:
        return self._runners.get(domain_uid)

    def member(self, node_name: str) -> pb.Member | None:
        """A member of the followed domain as this supervisor last saw it."""
        entry = self._members.get(node_name)
        return entry[0] if entry is not None else None

    def runners(self) -> list[DomainDaemon]:
        return list(self._runners.values())

    def domain_dirs(self) -> list[Path]:
        return domain_dirs(self.work_dir)

    def daemon_pid(self, domain_uid: str) -> int | None:
        runner = self._runners.get(domain_uid)
        return runner.pid if runner is not None else None

    async def run(self) -> None:
        await asyncio.to_thread(self.work_dir.mkdir, parents=True, exist_ok=True)
        await self._read_driver_version()
        binding_watch = asyncio.create_task(self._watch_binding(), name=f"imex-binding-{self.node_name}")
        try:
            await self._reconcile_loop()
        finally:
            binding_watch.cancel()
            if self._members_task is not None:
                self._members_task.cancel()
            # Finish the shutdown even if cancelled again meanwhile: stopping daemons and
            # deleting their status must not be cut off halfway (the caller closes the store next).
            shutdown = asyncio.ensure_future(self._shutdown())
            while not shutdown.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(shutdown)

    async def _read_driver_version(self) -> None:
        """The node's driver version (NVML), which decides whether its daemons can use slot
        names (libs/imex/driver.py). Unknown after a failed read: daemons are started and the
        real daemon judges for itself."""
        if self.settings.node_driver_version:
            return
        try:
            async with asyncio.timeout(self.settings.io_timeout_s):
                version = await asyncio.to_thread(self.hardware.driver_version)
        except Exception as exc:  # NVML error, timeout: not worth failing the node over
            log.warning("cannot read the driver version", node=self.node_name, error=str(exc))
            return
        self.settings = dataclasses.replace(self.settings, node_driver_version=version)
        log.info("driver version", node=self.node_name, driver_version=version)

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
                "binding seen",
                node=self.node_name,
                cd_uid=self._binding.domain_uid if self._binding is not None else None,
                resync=isinstance(event, Resync),
            )
            self._wake.set()

    async def _watch_members(self, domain_uid: str) -> None:
        prefix = self.keys.members(domain_uid)
        async for event in _resilient(lambda: self._watch(self.store, prefix, pb.Member), prefix):
            if self._members_uid != domain_uid:
                return
            if isinstance(event, Resync):
                self._members, self._cliques, self._clique_of = {}, {}, {}
                for item in event.items:
                    self._set_member(Keys.last_segment(item.key), (item.value, item.mod_revision))
                self._members_synced = True
                self._wake.set()
                continue
            name = Keys.last_segment(event.key)
            known = self._members.get(name)
            if known is not None and event.revision < known[1]:
                continue  # older than this node's own record as read directly
            entry = None if event.value is None else (event.value, event.revision)
            before, after = self._set_member(name, entry)
            if self._concerns_me(name, before, after):
                self._wake.set()

    def _set_member(self, name: str, entry: tuple[pb.Member, int] | None) -> tuple[str | None, str | None]:
        """Put (or with None remove) a member in both views; its clique before and after."""
        before = self._clique_of.pop(name, None)
        if self._members.pop(name, None) is not None and before is not None:
            bucket = self._cliques.get(before)
            if bucket is not None:
                bucket.pop(name, None)
                if not bucket:
                    del self._cliques[before]
        if entry is None:
            return before, None
        after = entry[0].clique_id
        self._members[name] = entry
        self._clique_of[name] = after
        self._cliques.setdefault(after, {})[name] = entry
        return before, after

    def _concerns_me(self, name: str, before: str | None, after: str | None) -> bool:
        """Whether a member change (its clique before and after) can alter this node's daemon: its
        own record, or a member of its clique (other cliques never reach its slots; waking every
        member on every join of a large domain would cost O(N^2))."""
        if name == self.node_name:
            return True
        clique = self._clique_of.get(self.node_name)
        return clique is not None and clique in (before, after)

    async def _read_own_member(self, domain_uid: str) -> None:
        """The binding names a domain, but the members view has no record of this node yet: read
        it once. The join wrote both in one transaction; the view comes from a watch, which can
        lag (etcd's slow watchers; a scale host's shared feed), and the daemon waited for it
        seconds at a time in a 256-pod formation."""
        if self._own_member_read == domain_uid or self.node_name in self._members:
            return
        found = await self.store.get(self.keys.member(domain_uid, self.node_name), pb.Member)
        self._own_member_read = domain_uid
        if found is not None and self._members_uid == domain_uid and self.node_name not in self._members:
            self._set_member(self.node_name, (found.value, found.mod_revision))

    def _follow_members_of(self, domain_uid: str | None) -> None:
        if self._members_uid == domain_uid:
            return
        if self._members_task is not None:
            self._members_task.cancel()
            self._members_task = None
        self._members_uid = domain_uid
        self._own_member_read = None
        self._members, self._cliques, self._clique_of = {}, {}, {}
        self._members_synced = False
        if domain_uid is not None:
            self._members_task = asyncio.create_task(
                self._watch_members(domain_uid), name=f"imex-members-{domain_uid}"
            )

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

    def _current_membership(self) -> Membership:
        mine = self._members.get(self.node_name)
        relevant = (
            list(self._cliques.get(mine[0].clique_id, {}).values())
            if mine is not None and mine[0].clique_id
            else [mine]
            if mine is not None
            else []
        )
        return membership_of(self.node_name, self._binding, relevant, self.settings.placeholder_address)

    async def _reconcile(self) -> None:
        if not self._binding_synced:
            return
        binding = self._binding
        self._follow_members_of(binding.domain_uid if binding is not None else None)
        if binding is not None and not self._members_synced:
            return  # the members watch has not listed yet: decide nothing on half a view
        if binding is not None:
            await self._read_own_member(binding.domain_uid)
        membership = self._current_membership()
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
            if runner is not None:
                runner.update(desired)
            elif not desired.lost:
                self._start_runner(desired, adopted_pid=None)
        self._membership = membership
        self._signal_change()

    def _start_runner(self, desired: DesiredDaemon, adopted_pid: int | None) -> DomainDaemon:
        runner = DomainDaemon(
            self.store,
            self.settings,
            self.daemon.launcher,
            self.make_probe(),
            DomainDir(self.work_dir / desired.domain_uid),
            desired,
            self._signal_change,
            self._wake.set,
            watch=self._watch,
        )
        self._runners[desired.domain_uid] = runner
        runner.start(adopted_pid)
        return runner

    def _signal_change(self) -> None:
        event, self._state_changed = self._state_changed, asyncio.Event()
        event.set()

    async def _leftovers(self, keep: Callable[[str], bool]) -> list[tuple[DomainDir, list[int]]]:
        """Domain directories whose uid `keep` accepts, with the daemons running on them."""

        def scan() -> list[tuple[DomainDir, list[int]]]:
            dirs = [DomainDir(path) for path in domain_dirs(self.work_dir) if keep(path.name)]
            return [(d, proc.leftover_pids(d.path, d.config)) for d in dirs]

        if not any(keep(path.name) for path in domain_dirs(self.work_dir)):
            return []  # the common case on every reconcile: no /proc scan, no thread

        async with asyncio.timeout(self.settings.io_timeout_s):
            return await asyncio.to_thread(scan)

    async def _recover(self, desired: DesiredDaemon | None) -> None:
        """Adopt the previous incarnation's daemon for the current domain if it still has the
        right identity and configuration; stop every other leftover daemon."""
        for domain_dir, pids in await self._leftovers(lambda uid: True):
            if not pids:
                continue
            if (
                desired is not None
                and domain_dir.uid == desired.domain_uid
                and len(pids) == 1
                and await asyncio.to_thread(
                    domain_dir.serves, desired.identity, self.node_name, self.settings
                )
            ):
                self._start_runner(desired, adopted_pid=pids[0])
                continue
            for pid in pids:
                log.warning(
                    "stopping leftover IMEX daemon", cd_uid=domain_dir.uid, node=self.node_name, pid=pid
                )
                await self._stop_pid(pid)

    async def _stop_pid(self, pid: int) -> None:
        process = proc.DaemonProcess(pid, None, lambda: None)
        await process.stop(self.settings.stop_grace_s)
        process.close()

    async def _remove_stale_dirs(self, keep: str | None) -> None:
        stale = await self._leftovers(lambda uid: uid != keep and uid not in self._runners)
        for domain_dir, pids in stale:
            for pid in pids:
                await self._stop_pid(pid)
            log.info("removing stale IMEX domain directory", cd_uid=domain_dir.uid, node=self.node_name)
            async with asyncio.timeout(self.settings.io_timeout_s):
                await asyncio.to_thread(domain_dir.remove)
            try:
                await self.store.delete(self.keys.daemon(domain_dir.uid, self.node_name))
            except TRANSIENT_ERRORS as exc:
                log.warning("could not delete a stale daemon status", cd_uid=domain_dir.uid, error=str(exc))

    async def _shutdown(self) -> None:
        runners, self._runners = list(self._runners.values()), {}
        for runner in runners:
            if self.settings.stop_daemons_on_exit:
                await runner.stop()
            else:
                await runner.detach()
