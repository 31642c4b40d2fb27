"""Which IMEX daemon the agent runs and asks: the port's implementation for its backend.

nvidia-imex and nvidia-imex-ctl are exec'd (the daemon behind ``unshare`` with the domain's hosts
file, the ctl through ``nsenter``); the simulated daemon comes from the simulator's fork server
and its ctl runs in-process. A daemon or ctl command in the settings replaces just that part.
"""

from __future__ import annotations

from pathlib import Path

from libs.imex.hosts_ns import private_hosts_argv
from libs.imex.nvidia_imex import ExecCtl, ExecLauncher
from services.imexagent.daemon_supervisor import imex_daemon_for
from services.imexagent.settings import ImexSettings
from tools.sim.imex.launch import simulator_daemon_argv
from tools.sim.imex.port import ForkedLauncher, SimulatorCtl

CONFIG = Path("/var/lib/imex/cd-1/config.cfg")
HOSTS = Path("/var/lib/imex/cd-1/hosts")


def test_nvidia_runs_the_configured_binaries_behind_a_private_hosts_file() -> None:
    settings = ImexSettings(nvidia_imex_binary="/opt/nv/nvidia-imex", nvidia_imex_ctl_binary="/opt/nv/ctl")

    daemon = imex_daemon_for("nvidia", settings)

    assert isinstance(daemon.launcher, ExecLauncher)
    assert daemon.launcher.argv(CONFIG, HOSTS) == private_hosts_argv(
        ["/opt/nv/nvidia-imex", "-c", str(CONFIG)], str(HOSTS)
    )
    assert isinstance(daemon.ctl, ExecCtl) and daemon.ctl.command == ["/opt/nv/ctl"]


def test_the_simulator_forks_its_daemon_and_asks_its_ctl_in_process() -> None:
    daemon = imex_daemon_for("simulated", ImexSettings())

    assert isinstance(daemon.launcher, ForkedLauncher)
    assert daemon.launcher.argv(CONFIG, HOSTS) == simulator_daemon_argv(str(CONFIG))
    assert isinstance(daemon.ctl, SimulatorCtl)


def test_a_daemon_command_replaces_only_the_daemon() -> None:
    settings = ImexSettings(daemon_command=("python3", "stand-in.py"))

    daemon = imex_daemon_for("simulated", settings)

    assert daemon.launcher.argv(CONFIG, HOSTS) == private_hosts_argv(
        ["python3", "stand-in.py", "-c", str(CONFIG)], str(HOSTS)
    )
    assert isinstance(daemon.ctl, SimulatorCtl)


def test_a_ctl_command_replaces_only_the_ctl() -> None:
    settings = ImexSettings(ctl_command=("stand-in-ctl", "--quiet"))

    daemon = imex_daemon_for("nvidia", settings)

    assert isinstance(daemon.ctl, ExecCtl) and daemon.ctl.command == ["stand-in-ctl", "--quiet"]
    assert daemon.launcher.argv(CONFIG, HOSTS)[-3:] == ["nvidia-imex", "-c", str(CONFIG)]
