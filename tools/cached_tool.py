"""The tools the project builds into the per-user cache (etcd, the control plane, cdi-check, buf, helm,
the Go plugins): each has a build script that caches its output per user and version and prints
where it is on the last line of stdout, so calling one is cheap once built."""

from __future__ import annotations

import subprocess
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

REPO = Path(__file__).resolve().parents[1]


class BuildError(RuntimeError):
    """A build script failed; the message names it and carries the tail of its output."""


def cached_tool(script: str, *args: str, timeout_s: float = 3600.0) -> Path:
    """Run `script` (a path in the repo) with `args` and return the existing path it printed last.

    It builds what is missing (unless given --cached-only, then it fails naming `make setup`)."""
    path = REPO / script
    if not path.is_file():
        raise BuildError(f"build script {script} does not exist")
    log.info("build_script_started", script=script)
    try:
        proc = subprocess.run(
            ["bash", str(path), *args], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise BuildError(f"{script} did not finish within {timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr + proc.stdout).strip().splitlines()[-40:])
        raise BuildError(
            f"{script} {' '.join(args)} failed with exit code {proc.returncode} (make setup builds it):\n{tail}"
        )
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise BuildError(f"{script} printed no path")
    result = Path(lines[-1].strip())
    if not result.exists():
        raise BuildError(f"{script} reported {result}, which does not exist")
    return result
