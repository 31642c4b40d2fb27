"""Locate (building on first use) the control-plane and etcd binaries.

Both come from their build scripts through tools/cachedtool.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tools.cachedtool import BuildError, cached_tool

# A cold build of the Kubernetes binaries takes 10-25 minutes on two cores.
BUILD_TIMEOUT_S = 3600.0

CONTROLPLANE_BINARIES = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl")


@dataclass(frozen=True)
class Binaries:
    """Where the binaries of one control plane live."""

    bin_dir: Path  # kube-apiserver, kube-scheduler, kube-controller-manager, kubectl
    etcd: Path

    def path(self, name: str) -> Path:
        return self.bin_dir / name


def ensure_binaries(timeout_s: float = BUILD_TIMEOUT_S) -> Binaries:
    """Build (if not cached) and return the control-plane binaries and etcd."""
    bin_dir = cached_tool("tools/controlplane/build.sh", timeout_s=timeout_s)
    missing = [b for b in CONTROLPLANE_BINARIES if not (bin_dir / b).is_file()]
    if missing:
        raise BuildError(f"{bin_dir} lacks {', '.join(missing)}")
    etcd = cached_tool("tools/etcd/build.sh", timeout_s=timeout_s)
    if etcd.is_dir():
        etcd = etcd / "etcd"
    if not etcd.is_file():
        raise BuildError(f"etcd binary not found at {etcd}")
    return Binaries(bin_dir=bin_dir, etcd=etcd)
