"""How to start the simulated IMEX daemon as a process (for the node agent's supervisor)."""

from __future__ import annotations

import sys
from pathlib import Path

RUN_DAEMON_SCRIPT = str(Path(__file__).resolve().with_name("run_daemon.py"))


def simulator_daemon_argv(config_path: str, python: str | None = None) -> list[str]:
    """Return the argv that starts the simulated daemon on ``config_path``, fastest form.

    The tail is ``-c <config_path>``, exactly as for ``nvidia-imex``. ``-I -S`` keep the start
    cheap (no site-packages scan, no environment-driven imports); the daemon needs only the
    standard library and this repository.
    """
    return [python or sys.executable, "-I", "-S", RUN_DAEMON_SCRIPT, "-c", config_path]
