"""The simulator behind the IMEX daemon port (libs/imex/daemon_port.py).

* `ForkedLauncher`: the simulated daemon, started from this process's fork server (no
  interpreter start-up per daemon, which nvidia-imex does not pay either), in a mount namespace
  of its own with the domain's hosts file over /etc/hosts;
* `SimulatorCtl`: the simulator's ctl (ctl.py) called in-process with its root at
  ``/proc/<daemon pid>/root``, which shows the files as the daemon's namespace does. The same
  program on the same files, minus an interpreter start per probe (see docs/operations.md,
  "Running against the real nvidia-imex").

The IMEX agent loads `simulated_imex_daemon` by name (``SIMULATED_IMEX`` in the port).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from libs.imex import hosts_ns
from libs.imex.daemon_port import CtlOutput, ImexDaemon
from tools.sim.imex import ctl as simctl
from tools.sim.imex.launch import ForkedDaemon, fork_server, simulator_daemon_argv


class ForkedLauncher:
    """Simulated daemons from this process's fork server."""

    def argv(self, config: Path, hosts: Path) -> list[str]:
        return simulator_daemon_argv(str(config))

    def spawn(self, argv: Sequence[str], cwd: Path, log_path: Path, hosts: Path) -> ForkedDaemon:
        return fork_server().spawn(argv, cwd, log_path, hosts)


class SimulatorCtl:
    """The simulator's ctl, in-process, seeing the files through the daemon's root directory."""

    async def __call__(self, args: list[str], pid: int, timeout_s: float) -> CtlOutput:
        try:
            async with asyncio.timeout(timeout_s):
                done = await simctl.run(
                    [*args, "--timeout", f"{timeout_s:g}"], root=hosts_ns.namespace_root(pid)
                )
        except TimeoutError:
            return f"the simulator's ctl {' '.join(args[:2])} gave no answer within {timeout_s:g} s"
        return done.stdout, done.stderr


def simulated_imex_daemon() -> ImexDaemon:
    return ImexDaemon(ForkedLauncher(), SimulatorCtl())
