"""Settings of the node agent: flags ``--name`` or environment ``CD_NAME``."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from libs.hardware.factory import HARDWARE_KINDS
from libs.runtime.settings import non_negative, positive, setting
from libs.state.config import EtcdConfig


def _required(value: Any) -> str | None:
    return None if value else "is required"


def _port(value: Any) -> str | None:
    return None if 0 <= value <= 65535 else "must be a port number (0 = any free port)"


@dataclass(frozen=True)
class AgentSettings:
    node_name: str = setting("", "This node's name (the Kubernetes node name).", validate=_required)
    node_ip: str = setting(
        "", "Address IMEX peers reach this node at; required with real hardware (simulation: the node's own)."
    )
    kubelet_dir: str = setting("/var/lib/kubelet", "Kubelet directory (plugin and registration sockets).")
    cdi_root: str = setting("/var/run/cdi", "CDI spec directory.")
    # ---- state store
    etcd_endpoint: str = setting("127.0.0.1:2379", "etcd host:port.")
    etcd_prefix: str = setting("/cd/v1/", "Key prefix of this deployment in etcd.")
    etcd_ca_file: str = setting("", "CA bundle for etcd TLS (enables TLS).")
    etcd_cert_file: str = setting("", "Client certificate for etcd TLS.")
    etcd_key_file: str = setting("", "Client key for etcd TLS.")
    etcd_username: str = setting("", "etcd user (RBAC).")
    etcd_password: str = setting("", "etcd password (RBAC).", secret=True)
    etcd_timeout_s: float = setting(5.0, "Deadline of each etcd call, seconds.", validate=positive)
    # ---- hardware
    hardware: str = setting("nvml", "Hardware backend.", choices=HARDWARE_KINDS)
    sim_cluster: str = setting("", "Simulated cluster description file (--hardware simulated).")
    sim_state_dir: str = setting(
        "", "Base of simulated node state directories (default: nodes/ next to the cluster file)."
    )
    proc_devices: str = setting("/proc/devices", "Where to read the IMEX channel major (nvml).")
    driver_root: str = setting("/", "Host root of the NVIDIA driver's /dev (nvml).")
    # ---- IMEX
    imex_work_dir: str = setting("/var/lib/compute-domain/imex", "Per-domain IMEX config directories.")
    imex_backend: str = setting(
        "auto",
        "IMEX daemon: auto (by hardware), nvidia or simulated.",
        choices=("auto", "nvidia", "simulated"),
    )
    nvidia_imex_binary: str = setting("nvidia-imex", "The nvidia-imex daemon.")
    nvidia_imex_ctl_binary: str = setting("nvidia-imex-ctl", "The nvidia-imex-ctl tool.")
    stop_imex_daemons_on_exit: str = setting(
        "auto",
        "Stop IMEX daemons when the agent stops: auto (yes with simulated hardware, where they are "
        "the agent's children; no with real hardware, so running jobs survive an agent upgrade), true, false.",
        choices=("auto", "true", "false"),
    )
    # ---- prepare
    prepare_budget_s: float = setting(
        45.0, "How long a prepare waits for the IMEX daemon, seconds.", validate=positive
    )
    tombstone_ttl_s: float = setting(
        300.0, "How long an unprepared claim refuses stale prepares, seconds.", validate=non_negative
    )
    checkpoint_fsync: bool = setting(
        False,
        "fsync the checkpoint on every save. Not needed for correctness: the checkpoint is "
        "discarded after a reboot (boot id), and a killed agent's writes survive in the page cache.",
    )
    boot_id_file: str = setting(
        "/proc/sys/kernel/random/boot_id", "Kernel boot id (checkpoint reboot detection)."
    )
    membership_check_interval_s: float = setting(
        10.0, "How often to rejoin domains whose membership was marked lost, seconds.", validate=positive
    )
    register_timeout_s: float = setting(
        30.0,
        "Log a warning if the node record is not in the store after this long, seconds.",
        validate=positive,
    )
    # ---- claims and Kubernetes
    claim_source: str = setting(
        "store", "Where claims come from: store (simulation) or kubernetes.", choices=("store", "kubernetes")
    )
    kubeconfig: str = setting("", "Kubeconfig file (kubernetes mode; default: in-cluster).")
    kube_timeout_s: float = setting(10.0, "Deadline of each API server call, seconds.", validate=positive)
    publish_clique_label: bool = setting(
        False, "Maintain the nvidia.com/gpu.clique node label (kubernetes mode)."
    )
    delete_resource_slice_on_exit: bool = setting(False, "Delete this node's ResourceSlice on shutdown.")
    # ---- process
    lease_ttl_s: int = setting(5, "TTL of the node record's lease, seconds.", validate=positive)
    health_host: str = setting("0.0.0.0", "Address of the /healthz /readyz /metrics server.")
    health_port: int = setting(8082, "Port of the health server (0 = any free port).", validate=_port)
    log_format: str = setting("auto", "Log format.", choices=("auto", "json", "console"))
    log_level: str = setting("info", "Log level.", choices=("debug", "info", "warning", "error"))

    def __repr__(self) -> str:
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        if shown["etcd_password"]:
            shown["etcd_password"] = "<redacted>"
        return f"AgentSettings({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def etcd_config(self) -> EtcdConfig:
        return EtcdConfig(
            endpoint=self.etcd_endpoint,
            prefix=self.etcd_prefix,
            ca_file=self.etcd_ca_file or None,
            cert_file=self.etcd_cert_file or None,
            key_file=self.etcd_key_file or None,
            username=self.etcd_username or None,
            password=self.etcd_password or None,
            timeout_s=self.etcd_timeout_s,
        )

    @property
    def stop_daemons_on_exit(self) -> bool:
        if self.stop_imex_daemons_on_exit == "auto":
            return self.hardware == "simulated"
        return self.stop_imex_daemons_on_exit == "true"

    @property
    def kubelet_path(self) -> Path:
        return Path(self.kubelet_dir)
