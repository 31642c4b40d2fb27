"""Settings of ``cd-imex-agent``: the command line / environment (``--name`` or ``CD_NAME``), and
the tuning of daemon supervision that tools and tests set in code (`ImexSettings`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from libs.hardware import ImexBackendName
from libs.hardware.factory import HARDWARE_KINDS
from libs.imex import config as imexcfg
from libs.imex import slots
from libs.runtime.settings import ProcessSettings, port, positive, required, setting
from libs.state.config import EtcdSettings
from services.imexagent.daemon_lifecycle import LifecyclePolicy

BackendChoice = Literal["auto", "nvidia", "simulated"]

# IMEX_NODE_DISCONNECTED_GRACE_TIME rendered for every daemon: a peer unreachable this long has its
# imports and exports cleaned up (nvidia-imex's default, -1, keeps them forever). Ten minutes is
# PyTorch's default NCCL collective timeout: a job cut off from a peer that long has aborted by
# itself, so the clean-up costs it nothing, while any shorter partition (a switch port flapping, a
# link re-dialled) leaves a running job's imports valid. Why not forever: see docs/operations.md.
DEFAULT_DISCONNECTED_GRACE_S = 600


@dataclass(frozen=True)
class ImexSettings:
    """How daemons are started, polled, told to re-resolve, restarted and stopped."""

    # "nvidia" (nvidia-imex) or "simulated"; None = what the node's hardware backend says.
    backend: ImexBackendName | None = None
    nvidia_imex_binary: str = "nvidia-imex"
    nvidia_imex_ctl_binary: str = "nvidia-imex-ctl"
    # Replaces the backend's daemon command (argv before "-c <config>"); tests use it.
    daemon_command: tuple[str, ...] = ()
    # Replaces the backend's ctl (run with nsenter in the daemon's mount namespace); tests use it.
    ctl_command: tuple[str, ...] = ()
    server_port: int = imexcfg.DEFAULT_SERVER_PORT
    cmd_port: int = imexcfg.DEFAULT_CMD_PORT
    # Where the command service listens; "" = this node's address.
    cmd_bind_ip: str = ""
    wait_for_quorum: str = imexcfg.QUORUM_RECOVERY
    # IMEX_NODE_DISCONNECTED_GRACE_TIME: -1 forever, 0 at once, else seconds.
    disconnected_grace_s: int = DEFAULT_DISCONNECTED_GRACE_S
    log_file_max_size_mb: int = 64
    # What an empty slot resolves to: an address nothing listens on.
    placeholder_address: str = slots.PLACEHOLDER_ADDRESS
    # Probing: from fast, growing, just after a start or a change (services/imexagent/probe_pace.py),
    # slow once READY (a READY daemon is still probed, for the peers it reports connected).
    poll_interval_starting_s: float = 0.025
    # ... and while a peer is not connected yet (the domain's Ready waits for exactly that).
    poll_interval_waiting_s: float = 0.25
    poll_interval_ready_s: float = 1.0
    query_timeout_s: float = 1.0
    not_ready_debounce_s: float = 0.5
    # A peer link that was up stays reported connected this long after it went down: SIGUSR1
    # makes a daemon re-dial every link, which is no reason to mark the domain NotReady.
    disconnect_debounce_s: float = 1.0
    waiting_detail_after_s: float = 5.0
    unresponsive_kill_s: float = 20.0
    failed_after: int = 3
    restart_backoff_initial_s: float = 0.2
    restart_backoff_cap_s: float = 10.0
    stable_after_s: float = 10.0
    # SIGTERM -> SIGKILL grace period when stopping a daemon (leaving, a new identity, or silent
    # for unresponsive_kill_s): a daemon killed without SIGTERM waits for recovery when restarted.
    stop_grace_s: float = 5.0
    # At most one SIGUSR1 this often (nvidia-imex ignores repeats within 5 s).
    reload_min_interval_s: float = 5.2
    # An owed SIGUSR1 waits until the slot map was quiet this long (at most reload_settle_max_s
    # after the first change): one signal after a burst of joins instead of one at its start.
    reload_settle_s: float = 0.15
    reload_settle_max_s: float = 1.0
    # A status change that only concerns peers / connections / generation is written at most
    # this often; state changes are written at once.
    status_coalesce_s: float = 0.2
    log_tail_lines: int = 10
    # Deadline of one blocking file operation or spawn done in a worker thread.
    io_timeout_s: float = 30.0
    # Simulator tuning (rendered as simulator-only comment directives; None = its default).
    sim_sigusr1_min_interval_s: float | None = None
    sim_heartbeat_interval_s: float | None = None
    sim_reconnect_initial_s: float | None = None
    sim_reconnect_max_s: float | None = None
    # Stop the daemons when the supervisor ends (default: leave them for the next incarnation).
    stop_daemons_on_exit: bool = False
    # The node's driver version as NVML reports it; the supervisor fills it in at start (a fact
    # about the node, not a setting). "" = unknown: the daemon is started and judges itself.
    node_driver_version: str = ""

    def __post_init__(self) -> None:
        problems = []
        for name in (
            "poll_interval_starting_s",
            "poll_interval_waiting_s",
            "poll_interval_ready_s",
            "query_timeout_s",
            "io_timeout_s",
        ):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0")
        for name in ("stop_grace_s", "reload_min_interval_s", "status_coalesce_s"):
            if not getattr(self, name) >= 0:
                problems.append(f"{name} must be >= 0")
        if self.poll_interval_starting_s > self.poll_interval_ready_s:
            problems.append("poll_interval_starting_s must be <= poll_interval_ready_s")
        if self.disconnected_grace_s < -1:
            problems.append("disconnected_grace_s must be -1 (forever), 0 or seconds")
        if self.wait_for_quorum not in imexcfg.WAIT_FOR_QUORUM_VALUES:
            problems.append(f"wait_for_quorum must be one of {imexcfg.WAIT_FOR_QUORUM_VALUES}")
        if not self.placeholder_address or any(ch.isspace() for ch in self.placeholder_address):
            problems.append("placeholder_address must be one address")
        if problems:
            raise ValueError("invalid IMEX settings: " + "; ".join(problems))
        self.lifecycle_policy()  # validates its part

    def lifecycle_policy(self) -> LifecyclePolicy:
        return LifecyclePolicy(
            not_ready_debounce_s=self.not_ready_debounce_s,
            failed_after=self.failed_after,
            restart_backoff_initial_s=self.restart_backoff_initial_s,
            restart_backoff_cap_s=self.restart_backoff_cap_s,
            stable_after_s=self.stable_after_s,
            unresponsive_kill_s=self.unresponsive_kill_s,
            waiting_detail_after_s=self.waiting_detail_after_s,
        )


def _grace(value: Any) -> str | None:
    return None if value >= -1 else "must be -1 (forever), 0 (at once) or a number of seconds"


def _address(value: Any) -> str | None:
    return None if value and not any(ch.isspace() or ch == "#" for ch in value) else "must be one address"


@dataclass(frozen=True, repr=False)
class ImexAgentSettings(ProcessSettings, EtcdSettings):
    node_name: str = setting("", "This node's name (the Kubernetes node name).", validate=required)
    node_ip: str = setting(
        "", "Address IMEX peers reach this node at; required with real hardware (simulation: the node's own)."
    )
    # Hardware
    hardware: str = setting("nvml", "Hardware backend.", choices=HARDWARE_KINDS)
    sim_cluster: str = setting("", "Simulated cluster description file (--hardware simulated).")
    sim_state_dir: str = setting(
        "", "Base of simulated node state directories (default: nodes/ next to the cluster file)."
    )
    proc_devices: str = setting("/proc/devices", "Where to read the IMEX channel major (nvml).")
    driver_root: str = setting("/", "Host root of the NVIDIA driver's /dev (nvml).")
    # Node record
    lease_ttl_s: int = setting(
        5, "TTL of the node record's lease (node loss is seen after it), seconds.", validate=positive
    )
    kubelet_dir: str = setting("/var/lib/kubelet", "Kubelet directory (recorded in the node record).")
    cdi_root: str = setting("/var/run/cdi", "CDI spec directory (recorded in the node record).")
    # IMEX
    imex_work_dir: str = setting("/var/lib/compute-domain/imex", "Per-domain IMEX daemon directories.")
    imex_backend: str = setting(
        "auto",
        "IMEX daemon: auto (by hardware), nvidia or simulated.",
        choices=("auto", "nvidia", "simulated"),
    )
    nvidia_imex_binary: str = setting("nvidia-imex", "The nvidia-imex daemon.")
    nvidia_imex_ctl_binary: str = setting("nvidia-imex-ctl", "The nvidia-imex-ctl tool.")
    placeholder_address: str = setting(
        slots.PLACEHOLDER_ADDRESS,
        "Address an empty IMEX slot resolves to (nothing may listen there).",
        validate=_address,
    )
    imex_disconnected_grace_s: int = setting(
        DEFAULT_DISCONNECTED_GRACE_S,
        "IMEX_NODE_DISCONNECTED_GRACE_TIME of the daemons: seconds an unreachable peer keeps its "
        "imports and exports before they are cleaned up (-1: forever, nvidia-imex's default).",
        validate=_grace,
    )
    stop_daemons_on_exit: bool = setting(
        False,
        "Stop the IMEX daemons when the agent stops (default: leave them running; the next "
        "agent adopts them, so running jobs survive an agent restart or upgrade).",
    )
    # This program's own default port (the other process settings: ProcessSettings).
    health_port: int = setting(8083, "Port of the health server (0 = any free port).", validate=port)

    def imex_settings(self) -> ImexSettings:
        backend: ImexBackendName | None = None
        if self.imex_backend == "nvidia":
            backend = "nvidia"
        elif self.imex_backend == "simulated":
            backend = "simulated"
        return ImexSettings(
            backend=backend,
            nvidia_imex_binary=self.nvidia_imex_binary,
            nvidia_imex_ctl_binary=self.nvidia_imex_ctl_binary,
            placeholder_address=self.placeholder_address,
            disconnected_grace_s=self.imex_disconnected_grace_s,
            stop_daemons_on_exit=self.stop_daemons_on_exit,
        )
