"""An IMEX daemon process: spawned, found again after an agent restart, signalled, stopped.

Processes are watched through pidfds (Linux >= 5.3) on the event loop: no thread per child, and
a signal through a pidfd can never hit a recycled pid. Daemons run in their own session, so they
outlive the agent; the pidfile (pid and start time, since pids get reused) and, should the agent
have died before writing it, the daemon's command line let the next incarnation find and adopt
them. The blocking parts (fork/exec, pidfile writes) run in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import structlog

from libs.fsio.atomic import write_atomic
from libs.imex.daemon_port import StartedProcess

log = structlog.get_logger(__name__)

PID_FILE = "daemon.pid"
_TAIL_BYTES = 16 * 1024


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
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


def proc_start_ticks(pid: int) -> int | None:
    """Start time of a process (clock ticks since boot), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    try:
        if fields[0] == "Z":
            return None  # a zombie is gone for our purposes
        return int(fields[19])  # field 22 of proc(5); fields[0] is field 3
    except (IndexError, ValueError):
        return None


def proc_cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
    except OSError:
        return []


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


class DaemonProcess:
    """A daemon process watched through a pidfd: started here, or adopted from a previous agent."""

    def __init__(self, pid: int, popen: StartedProcess | None, on_exit: Callable[[], None]) -> None:
        self.pid = pid
        self.popen = popen
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
        self._unwatch()
        if self.popen is not None:
            self.popen.wait()  # the pidfd says it exited: reaping does not block
            self.returncode = self.popen.returncode
        if not self.exited.is_set():
            self.exited.set()
            self._on_exit()

    def _unwatch(self) -> None:
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

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
        if await wait_event(self.exited, grace_s):
            return
        log.warning("daemon ignored SIGTERM; killing it", pid=self.pid, grace_s=grace_s)
        self.send(signal.SIGKILL)
        if not await wait_event(self.exited, 10.0):
            log.error("daemon did not die after SIGKILL", pid=self.pid)

    def close(self) -> None:
        """Stop watching (the process keeps running)."""
        self._unwatch()


def write_pidfile(domain_dir: Path, pid: int) -> None:
    """Record the daemon for the next agent incarnation (pid + start time: pids get reused).

    Atomic, so an agent killed right after a start finds the daemon next time; not fsynced: only
    a machine crash loses it, and that ends the daemon too."""
    record = {"pid": pid, "start_ticks": proc_start_ticks(pid)}
    write_atomic(domain_dir / PID_FILE, json.dumps(record).encode(), durable=False)


def remove_pidfile(domain_dir: Path) -> None:
    with contextlib.suppress(OSError):
        (domain_dir / PID_FILE).unlink()


def leftover_pids(domain_dir: Path, config_path: Path) -> list[int]:
    """Live daemons of a domain directory: the pidfile's (if still the same process), and any
    process whose command line names the directory's config (a crash can beat the pidfile)."""
    pids: list[int] = []
    try:
        record = json.loads((domain_dir / PID_FILE).read_text())
        pid, ticks = int(record["pid"]), record.get("start_ticks")
        if ticks is not None and proc_start_ticks(pid) == ticks:
            pids.append(pid)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    config = str(config_path)
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if (
                entry.name.isdigit()
                and int(entry.name) not in pids
                and config in proc_cmdline(int(entry.name))
                and proc_start_ticks(int(entry.name)) is not None
            ):
                pids.append(int(entry.name))
    return [pid for pid in pids if pid != os.getpid()]
