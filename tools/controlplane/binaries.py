"""Locate (building on first use) the control-plane and etcd binaries, per Kubernetes minor.

Both come from their build scripts through tools/cached_tool.py. tools/controlplane/go.mod pins the
newest supported release; versions/v<minor>.mod pins each older one (same cmd/ mains). Each is
cached in its own folder, ~/.cache/computedomains/controlplane/<version>/.

CD_K8S_MINOR (e.g. 1.32) chooses the minor of every control plane that does not ask for one, so
`CD_K8S_MINOR=1.32 .venv/bin/python -m pytest tests/e2e` runs every end-to-end scenario on 1.32.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from tools.cached_tool import REPO, BuildError, cached_tool

# A cold build of the Kubernetes binaries takes 10-25 minutes on two cores.
BUILD_TIMEOUT_S = 3600.0

CONTROLPLANE_BINARIES = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl")
# A simulated node: kubelet and the simulated container runtime (node/, build.sh --node).
NODE_BINARIES = ("kubelet", "crisim")
MODULE_DIR = REPO / "tools" / "controlplane"
MINOR_ENV = "CD_K8S_MINOR"

_MINOR_RE = re.compile(r"^1\.(\d+)$")


@dataclass(frozen=True)
class Binaries:
    """Where the binaries of one control plane live."""

    bin_dir: Path  # kube-apiserver, kube-scheduler, kube-controller-manager, kubectl
    etcd: Path
    version: str = ""  # e.g. v1.37.2; "" when not known

    def path(self, name: str) -> Path:
        return self.bin_dir / name

    @property
    def minor(self) -> int:
        """The minor release (37 for v1.37.2); the newest supported when the version is not known."""
        return minor_of(self.version or kubernetes_version(newest_minor()))


def minor_of(version: str) -> int:
    """37 for "v1.37.2", "1.37" or "v1.37"; ValueError naming the problem otherwise."""
    match = re.match(r"^v?1\.(\d+)(\.\d+)?$", version)
    if not match:
        raise ValueError(f"{version!r} is not a Kubernetes version such as v1.37.2 or 1.37")
    return int(match.group(1))


def _module_version(mod_file: Path) -> str:
    for line in mod_file.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "k8s.io/kubernetes" and parts[1].startswith("v"):
            return parts[1]
    raise BuildError(f"{mod_file} names no k8s.io/kubernetes version")


def newest_minor() -> str:
    """The newest supported minor, e.g. "1.37" (from go.mod)."""
    return f"1.{minor_of(_module_version(MODULE_DIR / 'go.mod'))}"


def supported_minors() -> tuple[str, ...]:
    """Every minor a control plane can be built for, newest first."""
    older = [p.stem.removeprefix("v") for p in (MODULE_DIR / "versions").glob("v1.*.mod")]
    return (newest_minor(), *sorted(older, key=minor_of, reverse=True))


def kubernetes_version(minor: str) -> str:
    """The release pinned for `minor`, e.g. "v1.32.13" for "1.32"."""
    if minor == newest_minor():
        return _module_version(MODULE_DIR / "go.mod")
    mod_file = MODULE_DIR / "versions" / f"v{minor}.mod"
    if not _MINOR_RE.match(minor) or not mod_file.is_file():
        raise BuildError(f"Kubernetes {minor} is not supported (supported: {', '.join(supported_minors())})")
    return _module_version(mod_file)


def default_minor() -> str:
    """$CD_K8S_MINOR when set, else the newest supported minor."""
    chosen = os.environ.get(MINOR_ENV, "").strip().removeprefix("v")
    if not chosen:
        return newest_minor()
    if chosen not in supported_minors():
        raise BuildError(
            f"{MINOR_ENV}={chosen} is not supported (supported: {', '.join(supported_minors())})"
        )
    return chosen


def ensure_binaries(timeout_s: float = BUILD_TIMEOUT_S, minor: str | None = None) -> Binaries:
    """Build (if not cached) and return the control-plane binaries of `minor` (default:
    default_minor()) and etcd."""
    minor = minor or default_minor()
    version = kubernetes_version(minor)
    bin_dir = cached_tool("tools/controlplane/build.sh", minor, timeout_s=timeout_s)
    missing = [b for b in CONTROLPLANE_BINARIES if not (bin_dir / b).is_file()]
    if missing:
        raise BuildError(f"{bin_dir} lacks {', '.join(missing)}")
    etcd = cached_tool("tools/etcd/build.sh", timeout_s=timeout_s)
    if etcd.is_dir():
        etcd = etcd / "etcd"
    if not etcd.is_file():
        raise BuildError(f"etcd binary not found at {etcd}")
    return Binaries(bin_dir=bin_dir, etcd=etcd, version=version)


def ensure_node_binaries(timeout_s: float = BUILD_TIMEOUT_S, minor: str | None = None) -> Path:
    """Build (if not cached) and return the folder holding kubelet and crisim of `minor` (default:
    default_minor())."""
    bin_dir = cached_tool(
        "tools/controlplane/build.sh", "--node", minor or default_minor(), timeout_s=timeout_s
    )
    missing = [b for b in NODE_BINARIES if not (bin_dir / b).is_file()]
    if missing:
        raise BuildError(f"{bin_dir} lacks {', '.join(missing)}")
    return bin_dir
