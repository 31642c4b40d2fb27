"""One program of the image, run in its own buildah working container (`buildah run --isolation
chroot`, the host's network), as `make image-smoke` runs the services.

A chroot-isolated process is a plain host process (no PID namespace), and buildah does not pass
SIGTERM on to it: killing `buildah run` SIGKILLs the program. So stop() signals the program
itself (found among the descendants of our own `buildah run`), waits for it to exit, then
SIGKILLs whatever still runs inside that container's root (a daemon it left behind), and removes
the working container. Only processes this object started, or that run inside its root, are
ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import structlog

from tools.image.program import ContainerProgram

log = structlog.get_logger(__name__)

BUILDAH_TIMEOUT_S = 60.0
# Processes of buildah's own machinery between `buildah run` and the program.
_BUILDAH_COMMS = ("buildah", "memfd:buildah-c")


class ContainerError(RuntimeError):
    """A buildah command failed; the message names it and carries its output."""


def buildah(*args: str, timeout_s: float = BUILDAH_TIMEOUT_S) -> str:
    try:
        proc = subprocess.run(
            ["buildah", *args], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise ContainerError(f"buildah {' '.join(args)} did not finish within {timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        raise ContainerError(f"buildah {' '.join(args)} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout.strip()


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc."""
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            out.setdefault(ppid, []).append(int(entry.name))
    return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _root(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/root")
    except OSError:
        return ""


class Container(ContainerProgram):
    """A working container of `image` named `name`, running `argv` with `binds` mounted."""

    def __init__(
        self,
        name: str,
        image: str,
        argv: list[str],
        binds: list[Path],
        log_file: Path,
        cap_add: tuple[str, ...] = (),
    ) -> None:
        super().__init__(name, image, argv, binds, log_file)
        self.cap_add = cap_add
        self.created = False

    def start(self) -> None:
        buildah("from", "--quiet", "--name", self.name, self.image)
        self.created = True
        caps = [f"--cap-add={cap}" for cap in self.cap_add]
        self.spawn(
            [
                "buildah",
                "run",
                "--isolation",
                "chroot",
                *caps,
                *self.volume_args(),
                self.name,
                "--",
                *self.argv,
            ]
        )

    def program_pid(self) -> int | None:
        """The program's pid: the first descendant of our `buildah run` that is not buildah's."""
        if not self.running():
            return None
        assert self.process is not None
        tree = _children()
        queue = list(tree.get(self.process.pid, []))
        while queue:
            pid = queue.pop(0)
            if _comm(pid) not in _BUILDAH_COMMS:
                return pid
            queue += tree.get(pid, [])
        return None

    def processes_inside(self, root: str) -> list[int]:
        """Every process whose root is this container's (the program and anything it started)."""
        if not root or root == "/":
            return []
        return [
            int(entry.name)
            for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and _root(int(entry.name)) == root
        ]

    def stop(self, grace_s: float = 15.0) -> list[int]:
        """SIGTERM the program, wait, SIGKILL what is left inside, remove the container.

        Returns the pids that had to be killed (empty when the program ended everything it ran)."""
        killed: list[int] = []
        pid = self.program_pid()
        root = _root(pid) if pid else ""
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if self.process is not None:
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                killed = self.processes_inside(root)
                for leftover in killed:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(leftover, signal.SIGKILL)
                try:
                    self.process.wait(timeout=10.0)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(timeout=10.0)
        if self.created:
            buildah("rm", self.name)
            self.created = False
        log.info("container_stopped", container=self.name, killed=killed)
        return killed
