"""Settings of the kubelet plugin (``cd-node-agent``): flags ``--name`` or environment ``CD_NAME``.

The IMEX side (daemons, node record, lease) is ``cd-imex-agent``'s, with settings of its own. The
plugin still opens the node's hardware: the IMEX channel major (``/proc/devices``), the channel
device nodes it creates and the host ``/dev`` root its CDI specs name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from libs.hardware.factory import HARDWARE_KINDS
from libs.runtime.settings import ProcessSettings, non_negative, port, positive, required, setting
from libs.state.config import EtcdSettings


@dataclass(frozen=True, repr=False)
class AgentSettings(ProcessSettings, EtcdSettings):
    node_name: str = setting("", "This node's name (the Kubernetes node name).", validate=required)
    kubelet_dir: str = setting("/var/lib/kubelet", "Kubelet directory (plugin and registration sockets).")
    cdi_root: str = setting("/var/run/cdi", "CDI spec directory.")
    # Hardware
    hardware: str = setting("nvml", "Hardware backend.", choices=HARDWARE_KINDS)
    sim_cluster: str = setting("", "Simulated cluster description file (--hardware simulated).")
    sim_state_dir: str = setting(
        "", "Base of simulated node state directories (default: nodes/ next to the cluster file)."
    )
    proc_devices: str = setting("/proc/devices", "Where to read the IMEX channel major (nvml).")
    driver_root: str = setting("/", "Host root of the NVIDIA driver's /dev (nvml).")
    # Prepare
    prepare_budget_s: float = setting(
        45.0, "How long a prepare waits for this node's IMEX daemon to be READY, seconds.", validate=positive
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
    register_timeout_s: float = setting(
        30.0,
        "Log a warning if this node's record (written by the IMEX agent) is not in the store "
        "after this long, seconds; the plugin serves kubelet only once it was seen.",
        validate=positive,
    )
    dra_max_message_bytes: int = setting(
        4 * 1024 * 1024,
        "Largest request message the DRA socket takes (larger: RESOURCE_EXHAUSTED naming the limit).",
        validate=positive,
    )
    max_claim_uid_bytes: int = setting(
        128,
        "Longest claim UID taken from kubelet (Kubernetes UIDs are 36); a claim's namespace and name "
        "are held to Kubernetes' own limits (63 and 253).",
        validate=positive,
    )
    # Claims and Kubernetes
    claim_source: str = setting(
        "store", "Where claims come from: store (simulation) or kubernetes.", choices=("store", "kubernetes")
    )
    kubeconfig: str = setting("", "Kubeconfig file (kubernetes mode; default: in-cluster).")
    kube_timeout_s: float = setting(10.0, "Deadline of each API server call, seconds.", validate=positive)
    publish_clique_label: bool = setting(
        False, "Maintain the nvidia.com/gpu.clique node label (kubernetes mode)."
    )
    delete_resource_slice_on_exit: bool = setting(False, "Delete this node's ResourceSlice on shutdown.")
    # This program's own default port (the other process settings: ProcessSettings).
    health_port: int = setting(8082, "Port of the health server (0 = any free port).", validate=port)

    @property
    def kubelet_path(self) -> Path:
        return Path(self.kubelet_dir)
