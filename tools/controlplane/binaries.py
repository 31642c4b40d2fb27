"""Locate (building on first use) the control-plane and etcd binaries.

Both build scripts cache their output per user and version and print the
resulting path on the last line of stdout, so calling them is cheap once built.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
CONTROLPLANE_BUILD_SCRIPT = REPO_ROOT / "tools" / "controlplane" / "build.sh"
ETCD_BUILD_SCRIPT = REPO_ROOT / "tools" / "etcd" / "build.sh"

# A cold build of the Kubernetes binaries takes 10-25 minutes on two cores.
BUILD_TIMEOUT_S = 3600.0

CONTROLPLANE_BINARIES = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl")


class BuildError(RuntimeError):
    """A build script failed; the message carries the tail of its output."""


@dataclass(frozen=True)
class Binaries:
    """Where the binaries of one control plane live."""

    bin_dir: Path  # kube-apiserver, kube-scheduler, kube-controller-manager, kubectl
    etcd: Path

    def path(self, name: str) -> Path:
        return self.bin_dir / name


def _run_build_script(script: Path, timeout_s: float) -> Path:
    if not script.is_file():
        raise BuildError(f"build script {script} does not exist")
    log.info("build_script_started", script=str(script))
    try:
        proc = subprocess.run(
            ["bash", str(script)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise BuildError(f"{script} did not finish within {timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr + proc.stdout).strip().splitlines()[-40:])
        raise BuildError(f"{script} failed with exit code {proc.returncode}:\n{tail}")
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise BuildError(f"{script} printed no path")
    path = Path(lines[-1].strip())
    if not path.exists():
        raise BuildError(f"{script} reported {path}, which does not exist")
    return path


def ensure_binaries(timeout_s: float = BUILD_TIMEOUT_S) -> Binaries:
    """Build (if not cached) and return the control-plane binaries and etcd."""
    bin_dir = _run_build_script(CONTROLPLANE_BUILD_SCRIPT, timeout_s)
    missing = [b for b in CONTROLPLANE_BINARIES if not (bin_dir / b).is_file()]
    if missing:
        raise BuildError(f"{bin_dir} lacks {', '.join(missing)}")
    etcd = _run_build_script(ETCD_BUILD_SCRIPT, timeout_s)
    if etcd.is_dir():
        etcd = etcd / "etcd"
    if not etcd.is_file():
        raise BuildError(f"etcd binary not found at {etcd}")
    return Binaries(bin_dir=bin_dir, etcd=etcd)
