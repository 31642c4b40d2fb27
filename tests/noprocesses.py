"""A pytest plugin that refuses to start any process, for counting the tests that need none.

    python -m pytest -p tests.noprocesses -q tests/nodeagent tests/imexagent

A test that starts etcd, an IMEX daemon or any other program fails with `ProcessesBlocked`;
the tests that pass are those that run without etcd or processes (issue 30's figure).
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest


class ProcessesBlocked(OSError):
    """Raised in place of starting a process while this plugin is loaded."""


def _refuse(*_args: Any, **_kwargs: Any) -> Any:
    raise ProcessesBlocked("this run starts no processes (tests.noprocesses)")


def pytest_configure(config: pytest.Config) -> None:
    subprocess.Popen.__init__ = _refuse  # type: ignore[method-assign]
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve", "system"):
        if hasattr(os, name):
            setattr(os, name, _refuse)
