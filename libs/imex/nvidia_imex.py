"""The real nvidia-imex behind the IMEX daemon port (libs/imex/daemon_port.py): both programs exec'd.

* `ExecLauncher`: ``nvidia-imex -c <config>`` (or any daemon command) started with ``unshare``
  in a mount namespace of its own with the domain's hosts file over /etc/hosts, in its own
  session so that it outlives an agent restart;
* `ExecCtl`: ``nvidia-imex-ctl`` (or any ctl command) started with ``nsenter`` in the daemon's
  mount namespace, where the slot names of its nodes config resolve.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from libs.imex import hosts_ns

TYPE_CHECKING = False
if TYPE_CHECKING:
    from libs.imex.daemon_port import CtlOutput


def spawn_daemon(argv: Sequence[str], cwd: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """Start a daemon in its own session with output appended to its log (blocking: fork/exec).

    OSError if the log cannot be opened or the program not started."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
            cwd=cwd,
            start_new_session=True,  # outlives an agent restart; adopted by the next one
            close_fds=True,
        )
    finally:
        os.close(log_fd)


class ExecLauncher:
    """The daemon program `command`, exec'd on ``-c <config>`` behind ``unshare``."""

    def __init__(self, command: Sequence[str]) -> None:
        self.command = list(command)

    def argv(self, config: Path, hosts: Path) -> list[str]:
        return hosts_ns.private_hosts_argv([*self.command, "-c", str(config)], str(hosts))

    def spawn(self, argv: Sequence[str], cwd: Path, log_path: Path, hosts: Path) -> subprocess.Popen[bytes]:
        # The hosts file is in the command line already (`argv`).
        return spawn_daemon(argv, cwd, log_path)


class ExecCtl:
    """The ctl program, run in the mount namespace of the daemon `pid` with nsenter."""

    def __init__(self, command: Sequence[str]) -> None:
        self.command = list(command)

    async def __call__(self, args: list[str], pid: int, timeout_s: float) -> CtlOutput:
        argv = hosts_ns.in_namespace_argv(pid, [*self.command, *args])
        name = " ".join(self.command)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
        except OSError as exc:
            return f"cannot run {argv[0]}: {exc.strerror or exc}"
        try:
            async with asyncio.timeout(timeout_s):
                out, err = await proc.communicate()
        except TimeoutError:
            return f"{name} {' '.join(args[:2])} gave no answer within {timeout_s:g} s"
        finally:
            if proc.returncode is None:  # timed out, or the probe was cancelled: no orphan
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        text, why = out.decode(errors="replace"), err.decode(errors="replace")
        if not text.strip() and proc.returncode != 0 and why.strip().startswith("nsenter"):
            return f"ctl in the daemon's mount namespace: {why.strip()[-300:]}"
        return text, why
