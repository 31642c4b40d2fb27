"""The files through which `cdsim` commands and the supervisor share what runs.

`config.json` is written by `cdsim up` before the supervisor starts (what to run); `run.json` is
written by the supervisor (what runs now: phase, endpoints, pids). Both are replaced atomically,
so a reader never sees half a file.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from libs.fsio.atomic import write_atomic
from tools.cdsim.layout import StateLayout
from tools.launch import pid_alive

CONFIG_FILE_NAME = "config.json"


@dataclass(frozen=True)
class SimConfig:
    racks: int = 1
    trays_per_rack: int = 18
    partitions_per_rack: int = 1
    controllers: int = 2
    etcd_client_port: int = 0
    etcd_peer_port: int = 0
    log_level: str = "info"
    mesh: str = "tls"
    mesh_certificate_validity_s: float = 24 * 3600.0
    # etcd with TLS and auth, the advisor with mutual TLS (tools.cdsim.credentials); `up --plaintext`: off.
    secure: bool = False
    # Seconds before a killed node agent / controller replica is started again.
    agent_restart_delay_s: float = 1.0
    controller_restart_delay_s: float = 3.0
    # `cdsim up --kubernetes`: a real control plane from these binaries (tools/controlplane).
    kubernetes: bool = False
    kube_bin_dir: str = ""
    kube_etcd: str = ""
    kube_node_bin_dir: str = ""  # kubelet and crisim of the same release

    def save(self, layout: StateLayout) -> None:
        write_atomic(layout.root / CONFIG_FILE_NAME, json.dumps(asdict(self), indent=2).encode())

    @classmethod
    def load(cls, layout: StateLayout) -> SimConfig:
        data = json.loads((layout.root / CONFIG_FILE_NAME).read_text())
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class ProcessInfo:
    name: str
    kind: str  # etcd | advisor | controller | agent
    pid: int = 0
    health_url: str = ""
    running: bool = False
    healthy: bool = False
    restarts: int = 0
    last_exit: str = ""
    node: str = ""


@dataclass
class RunState:
    # starting | ready | failed | stopping | stopped
    phase: str = "starting"
    supervisor_pid: int = 0
    etcd_endpoint: str = ""
    advisor_endpoint: str = ""
    kubeconfig: str = ""  # Kubernetes mode: the admin kubeconfig of the control plane
    kube_bin_dir: str = ""  # Kubernetes mode: where kubectl is
    # A secured run: the directory of the CA and client certificates cdsim's clients use ("" = plaintext).
    tls_dir: str = ""
    error: str = ""
    started_unix_ms: int = 0
    ready_unix_ms: int = 0
    processes: dict[str, ProcessInfo] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunState:
        data: dict[str, Any] = json.loads(text)
        processes = {name: ProcessInfo(**info) for name, info in (data.pop("processes", {}) or {}).items()}
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__}, processes=processes)

    def live_nodes(self, kind: str) -> list[str]:
        """The nodes whose process of `kind` runs now (by run.json and by its pid)."""
        return sorted(
            p.node for p in self.processes.values() if p.kind == kind and p.running and pid_alive(p.pid)
        )

    def save(self, layout: StateLayout) -> None:
        write_atomic(layout.run_file, self.to_json().encode())

    @classmethod
    def load(cls, layout: StateLayout) -> RunState | None:
        try:
            return cls.from_json(layout.run_file.read_text())
        except (FileNotFoundError, ValueError):
            return None


def supervisor_running(layout: StateLayout) -> bool:
    """True while a supervisor holds the state dir's lock (a crashed one releases it)."""
    try:
        fd = os.open(layout.lock_file, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def try_lock(layout: StateLayout) -> int | None:
    """Take the state dir's lock; the fd (to hand to the supervisor), or None if it is held."""
    layout.root.mkdir(parents=True, exist_ok=True)
    fd = os.open(layout.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
