"""The IMEX daemon port: what the IMEX agent does with a daemon, whichever program it is.

The agent starts a daemon on its config file in a mount namespace of its own, with the domain's
hosts file over /etc/hosts (libs/imex/hosts_ns.py), and asks the daemon's ctl, run in that
namespace, for its state and its links. The words the ctl prints are in
libs/imex/daemon_state.py. Two implementations:

* nvidia-imex and nvidia-imex-ctl, exec'd (libs/imex/nvidia_imex.py);
* the simulator (tools/sim/imex/port.py): daemons forked from its fork server and its ctl called
  in-process. It is part of the rig, which the product does not import, so `open_imex_daemon`
  loads it by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

from libs.hardware.interface import ImexBackendName
from libs.imex.nvidia_imex import ExecCtl, ExecLauncher
from libs.runtime.stand_ins import load_standin

# A callable of no argument returning the simulator's ImexDaemon (see the module docstring).
SIMULATED_IMEX = "tools.sim.imex.port:simulated_imex_daemon"


class StartedProcess(Protocol):
    """A daemon process the agent started (`subprocess.Popen`, or a daemon of the simulator's
    fork server): `wait` reaps it once it exited and sets `returncode` (None if it cannot be known)."""

    pid: int
    returncode: int | None

    def wait(self) -> int | None: ...


class DaemonLauncher(Protocol):
    """Starts a daemon (blocking: fork/exec; run it in a worker thread)."""

    def argv(self, config: Path, hosts: Path) -> list[str]:
        """The daemon's command line on `config` (its tail is ``-c <config>``, as nvidia-imex's)."""
        ...

    def spawn(self, argv: Sequence[str], cwd: Path, log_path: Path, hosts: Path) -> StartedProcess:
        """Start `argv` in its own session and a mount namespace with `hosts` over /etc/hosts,
        output appended to `log_path`. OSError (or ValueError for a bad command line) if it
        cannot be started."""
        ...


# (stdout, stderr) of a ctl call, or the text of why it gave nothing.
CtlOutput = tuple[str, str] | str


class CtlRunner(Protocol):
    """Runs the ctl with `args` in the mount namespace of the daemon `pid`."""

    async def __call__(self, args: list[str], pid: int, timeout_s: float) -> CtlOutput: ...


@dataclass(frozen=True)
class ImexDaemon:
    """One implementation of the port: how its daemons start and how their ctl is run."""

    launcher: DaemonLauncher
    ctl: CtlRunner


def open_imex_daemon(backend: ImexBackendName, *, daemon_binary: str, ctl_binary: str) -> ImexDaemon:
    """nvidia-imex (the binaries given) or the simulator."""
    if backend == "simulated":
        open_simulated = cast(Callable[[], ImexDaemon], load_standin(SIMULATED_IMEX))
        return open_simulated()
    return ImexDaemon(ExecLauncher([daemon_binary]), ExecCtl([ctl_binary]))
