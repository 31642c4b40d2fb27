"""Simulated hardware of one node of a simulated NVL72 cluster.

A node's simulated host lives in its *state directory*::

    <state base>/<node name>/
        proc/devices                          driver majors, incl. nvidia-caps-imex-channels
        dev/nvidia-caps-imex-channels/        dev root = the state directory itself; channel<N> is a
                                              regular file, or with the cluster's
                                              imex_channel_device_nodes a real char device
        hardware-faults.json                  injected faults (see tools.sim.hardware.fault_file)

The backend derives the GPUs from the cluster description and overlays the fault file on every
query, so a fault injected by another process (``cdsim``) is seen on the next query or poll.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path

from libs.fsio.atomic import write_atomic
from libs.hardware.clique import CliqueResult
from libs.hardware.errors import HardwareError
from libs.hardware.health import poll_health_events
from libs.hardware.imex_channels import (
    DEFAULT_PROC_DEVICES,
    IMEX_CHANNELS_DEVICE_NAME,
    IMEX_CHANNELS_DIR,
    create_imex_channel_node,
    imex_channel_host_path,
    read_imex_channel_major,
)
from libs.hardware.interface import HardwareSnapshot, HealthEvent, ImexBackendName
from libs.hardware.model import FabricState, GpuHealth, GpuInfo
from libs.hardware.off_loop import OffLoopCalls
from tools.sim.hardware.cluster import ClusterDescription, SimulatedNode
from tools.sim.hardware.fault_file import FaultFile, NodeFaults, apply_faults

FAULTS_FILE_NAME = "hardware-faults.json"
DEFAULT_SIM_POLL_INTERVAL = 0.25
"""Seconds between fault-file checks for health events (one stat per check)."""

# Other drivers' majors that a real GB200 host shows next to the IMEX channels; only realism.
_OTHER_CHARACTER_DEVICES = (
    (1, "mem"),
    (4, "tty"),
    (5, "/dev/tty"),
    (10, "misc"),
    (195, "nvidia-frontend"),
    (236, "nvidia-caps"),
    (508, "nvidia-nvswitch"),
    (510, "nvidia-uvm"),
)
_BLOCK_DEVICES = ((7, "loop"), (8, "sd"), (259, "blkext"))


@dataclass(frozen=True, slots=True)
class SimulatedNodePaths:
    state_dir: Path
    proc_devices: Path
    dev_root: Path
    faults_file: Path

    @classmethod
    def under(cls, state_base: Path, node_name: str) -> SimulatedNodePaths:
        state_dir = state_base / node_name
        return cls(
            state_dir=state_dir,
            proc_devices=state_dir / "proc" / "devices",
            dev_root=state_dir,
            faults_file=state_dir / FAULTS_FILE_NAME,
        )


def default_state_base(cluster_file: Path) -> Path:
    """Where node state directories go by default: ``nodes/`` next to the cluster file."""
    return cluster_file.parent / "nodes"


def render_proc_devices(imex_channel_major: int) -> str:
    """A ``/proc/devices`` as a GB200 host shows it, with the given IMEX channels major."""
    character = sorted(
        [(m, n) for m, n in _OTHER_CHARACTER_DEVICES if m != imex_channel_major]
        + [(imex_channel_major, IMEX_CHANNELS_DEVICE_NAME)]
    )
    lines = ["Character devices:"]
    lines += [f"{major:3d} {name}" for major, name in character]
    lines += ["", "Block devices:"]
    lines += [f"{major:3d} {name}" for major, name in _BLOCK_DEVICES]
    return "\n".join(lines) + "\n"


def host_character_driver(major: int, proc_devices: Path = DEFAULT_PROC_DEVICES) -> str | None:
    """The driver of this host that owns character major `major` (its real /proc/devices), or None."""
    in_character_section = True
    for raw in proc_devices.read_text().splitlines():
        line = raw.strip()
        if line.endswith(":"):
            in_character_section = line.lower() == "character devices:"
            continue
        fields = line.split()
        if in_character_section and len(fields) == 2 and fields[0] == str(major):
            return fields[1]
    return None


def prepare_node_dirs(cluster: ClusterDescription, node_name: str, state_base: Path) -> SimulatedNodePaths:
    """Create (or refresh) one node's state directory; idempotent, keeps injected faults."""
    cluster.parse_node_name(node_name)
    paths = SimulatedNodePaths.under(state_base, node_name)
    paths.proc_devices.parent.mkdir(parents=True, exist_ok=True)
    (paths.dev_root / IMEX_CHANNELS_DIR).mkdir(parents=True, exist_ok=True)
    write_atomic(paths.proc_devices, render_proc_devices(cluster.imex_channel_major).encode())
    return paths


class FaultInjector:
    """Inject and clear faults of one simulated node (any process; effective on the next query)."""

    def __init__(self, faults_file: Path, gpus_per_tray: int) -> None:
        self._file = FaultFile(faults_file)
        self._gpus_per_tray = gpus_per_tray

    def _check_gpu(self, gpu: int) -> None:
        if not 0 <= gpu < self._gpus_per_tray:
            raise ValueError(f"GPU {gpu} out of range [0, {self._gpus_per_tray})")

    def current(self) -> NodeFaults:
        return self._file.read()

    def set_fabric_state(self, state: FabricState | None, gpu: int | None = None) -> NodeFaults:
        """Force the fabric state of one GPU or (gpu=None) all GPUs; None removes the override."""
        if gpu is None:
            return self._file.update(lambda f: NodeFaults(f.non_fabric, state, f.health, f.gpus))
        self._check_gpu(gpu)
        return self._file.update(lambda f: f.with_gpu(gpu, fabric_state=state))

    def set_health(self, health: GpuHealth | None, gpu: int | None = None) -> NodeFaults:
        if gpu is None:
            return self._file.update(lambda f: NodeFaults(f.non_fabric, f.fabric_state, health, f.gpus))
        self._check_gpu(gpu)
        return self._file.update(lambda f: f.with_gpu(gpu, health=health))

    def set_clique_id(self, gpu: int, clique_id: int | None) -> NodeFaults:
        """Make one GPU report another NVML cliqueId (its node's GPUs then disagree)."""
        self._check_gpu(gpu)
        return self._file.update(lambda f: f.with_gpu(gpu, clique_id=clique_id))

    def set_non_fabric(self, non_fabric: bool = True) -> NodeFaults:
        return self._file.update(lambda f: NodeFaults(non_fabric, f.fabric_state, f.health, f.gpus))

    def clear(self) -> NodeFaults:
        return self._file.update(lambda _: NodeFaults())


class SimulatedNodeHardware:
    """:class:`~libs.hardware.interface.NodeHardware` for one node of a simulated cluster."""

    imex_backend: ImexBackendName = "simulated"

    def __init__(
        self,
        cluster: ClusterDescription,
        node_name: str,
        state_dir: Path,
        *,
        proc_devices: Path | None = None,
        poll_interval: float = DEFAULT_SIM_POLL_INTERVAL,
    ) -> None:
        self.cluster = cluster
        self.node: SimulatedNode = cluster.node(node_name)
        self.state_dir = state_dir
        self.proc_devices = proc_devices if proc_devices is not None else state_dir / "proc" / "devices"
        self.dev_root = state_dir
        self.poll_interval = poll_interval
        self.faults = FaultInjector(state_dir / FAULTS_FILE_NAME, cluster.gpus_per_tray)
        self._fault_file = FaultFile(state_dir / FAULTS_FILE_NAME)
        self._baseline = cluster.node_gpus(self.node)

    @classmethod
    def from_cluster_file(
        cls,
        cluster_file: Path,
        node_name: str,
        state_base: Path | None = None,
        *,
        poll_interval: float = DEFAULT_SIM_POLL_INTERVAL,
    ) -> SimulatedNodeHardware:
        """The backend for ``--hardware simulated --sim-cluster <file> --node <name>``."""
        cluster = ClusterDescription.load(cluster_file)
        base = state_base if state_base is not None else default_state_base(cluster_file)
        state_dir = SimulatedNodePaths.under(base, node_name).state_dir
        return cls(cluster, node_name, state_dir, poll_interval=poll_interval)

    def gpus(self) -> tuple[GpuInfo, ...]:
        return apply_faults(self._baseline, self._fault_file.read())

    def snapshot(self) -> HardwareSnapshot:
        return HardwareSnapshot.of(self.gpus())

    def clique(self) -> CliqueResult:
        return self.snapshot().clique

    def driver_version(self) -> str:
        return self.cluster.node_driver_version(self.node.name)

    def imex_channel_major(self) -> int:
        return read_imex_channel_major(self.proc_devices)

    def imex_channel_path(self, channel: int) -> Path:
        return imex_channel_host_path(self.dev_root, channel)

    def ensure_imex_channel_device(self, channel: int) -> Path:
        """The channel's device node, as the real driver's would be (when the cluster asks for real
        nodes), else a regular file standing in for it (mknod needs CAP_MKNOD)."""
        if self.cluster.imex_channel_device_nodes:
            return self._make_channel_node(channel)
        path = self.imex_channel_path(channel)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, f"c {self.imex_channel_major()}:{channel}\n".encode(), mode=0o666)
        return path

    def _make_channel_node(self, channel: int) -> Path:
        """A real character device major:channel, which a container runtime can inject. Harmless
        only while no driver of this host owns that major (opening it then fails with ENXIO), so
        that is checked first: the simulated major must not be a real one here."""
        major = self.imex_channel_major()
        owner = host_character_driver(major)
        if owner is not None:
            raise HardwareError(
                f"cannot make simulated IMEX channel {channel} as a real device node: major {major} "
                f"is {owner!r} on this host (choose another imex_channel_major for the simulated cluster)"
            )
        try:
            return create_imex_channel_node(self.dev_root, channel, major)
        except OSError as exc:
            raise HardwareError(f"cannot create simulated IMEX channel {channel}: {exc}") from exc

    def health_events(
        self,
        since: HardwareSnapshot | None = None,
        interval: float | None = None,
        calls: OffLoopCalls | None = None,
    ) -> AsyncGenerator[HealthEvent, None]:
        return poll_health_events(self.snapshot, interval or self.poll_interval, since, calls)

    def close(self) -> None:
        pass
