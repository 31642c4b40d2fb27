"""Where a simulated cluster keeps its files: one state directory per `cdsim up`.

    <state dir>/
        supervisor.lock          held (flock) by the running supervisor: "is cdsim up?"
        run.json                 what the supervisor runs now (endpoints, pids, phase)
        control.sock             the supervisor's control socket (JSON lines)
        cluster.json             the simulated cluster description (libs.hardware)
        jobs.json                jobs submitted with `cdsim job submit`
        pki/                     certificates and keys of a secured run (not with `up --plaintext`)
        etcd/                    etcd's data directory (kept across `fault restart-etcd`)
        kube/                    `up --kubernetes`: the control plane (PKI, its etcd, kubeconfigs,
                                 logs/); kube/admin.kubeconfig is the one `up` prints
        logs/<process>.log       one log per process
        nodes/<node>/            simulated host of one node: proc/devices, dev/, faults,
            kubelet/             its kubelet directory (DRA and registration sockets, checkpoint)
            cdi/                 its CDI root
            imex/                per-domain IMEX config directories

Everything is derived from the state directory, so every command (and cdctl) finds the same
paths without asking the supervisor.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from libs.contract.names import DRIVER_NAME
from libs.invariants.checker import NodeLocalPaths

STATE_DIR_ENV = "CDSIM_STATE_DIR"
# sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_UNIX_SOCKET_PATH = 107


def default_state_dir() -> Path:
    """`$CDSIM_STATE_DIR`, else `<tmp>/cdsim-<uid>`: short, so unix socket paths stay legal."""
    override = os.environ.get(STATE_DIR_ENV)
    if override:
        return Path(override)
    return Path(tempfile.gettempdir()) / f"cdsim-{os.getuid()}"


@dataclass(frozen=True)
class NodeDirs:
    """The per-node directories of one simulated node."""

    name: str
    root: Path

    @property
    def kubelet_dir(self) -> Path:
        return self.root / "kubelet"

    @property
    def cdi_root(self) -> Path:
        return self.root / "cdi"

    @property
    def imex_dir(self) -> Path:
        return self.root / "imex"

    @property
    def dra_socket(self) -> Path:
        return self.kubelet_dir / "plugins" / DRIVER_NAME / "dra.sock"

    @property
    def registration_socket(self) -> Path:
        return self.kubelet_dir / "plugins_registry" / f"{DRIVER_NAME}-reg.sock"

    @property
    def checkpoint_file(self) -> Path:
        return self.kubelet_dir / "plugins" / DRIVER_NAME / "checkpoint.json"


@dataclass(frozen=True)
class StateLayout:
    root: Path

    @classmethod
    def at(cls, state_dir: Path | str | None) -> StateLayout:
        path = Path(state_dir) if state_dir is not None else default_state_dir()
        return cls(path.expanduser().absolute())

    @property
    def lock_file(self) -> Path:
        return self.root / "supervisor.lock"

    @property
    def run_file(self) -> Path:
        return self.root / "run.json"

    @property
    def control_socket(self) -> Path:
        return self.root / "control.sock"

    @property
    def cluster_file(self) -> Path:
        return self.root / "cluster.json"

    @property
    def jobs_file(self) -> Path:
        return self.root / "jobs.json"

    @property
    def etcd_dir(self) -> Path:
        return self.root / "etcd"

    @property
    def pki_dir(self) -> Path:
        return self.root / "pki"

    @property
    def kube_dir(self) -> Path:
        return self.root / "kube"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def nodes_dir(self) -> Path:
        return self.root / "nodes"

    def log_file(self, process: str) -> Path:
        return self.logs_dir / f"{process}.log"

    def node(self, name: str) -> NodeDirs:
        return NodeDirs(name, self.nodes_dir / name)

    def longest_socket_path(self, node_names: list[str]) -> Path | None:
        """The longest unix socket path any process of this cluster will bind, if any node."""
        candidates = [self.control_socket]
        for name in node_names:
            dirs = self.node(name)
            candidates += [dirs.dra_socket, dirs.registration_socket]
        return max(candidates, key=lambda p: len(str(p)))


def cluster_node_paths(layout: StateLayout, node_names: Iterable[str]) -> list[NodeLocalPaths]:
    """The node-local paths of a cdsim cluster's nodes."""
    out = []
    for name in node_names:
        dirs = layout.node(name)
        out.append(NodeLocalPaths(name, dirs.cdi_root, dirs.imex_dir, dirs.checkpoint_file))
    return out
