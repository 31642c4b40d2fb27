"""Description of a simulated NVL72-style cluster: racks of compute trays joined by NVLink.

Everything is derived on demand from a handful of integers and a seed, so a 10,000-node cluster
costs a few hundred bytes to hold; the same description always yields the same names, UUIDs,
cliques and addresses (in every process that loads the same JSON file).

Numbering is 0-based throughout: racks ``0..racks-1``, trays ``0..trays_per_rack-1``, GPUs
``0..gpus_per_tray-1``; node names are ``rack<R>-tray<T>`` (``rack0-tray0`` is the first node).

* Each rack is one NVLink domain with its own cluster UUID. Its trays are split into
  ``partitions_per_rack`` contiguous NVLink partitions (sizes differ by at most one), and each
  partition is one clique with its own clique id: clique string ``<clusterUUID>.<cliqueId>``.
* Node addresses are ``127.<address_block + R // 256>.<R % 256>.<T + 1>``: one loopback address
  per node (so each simulated IMEX daemon binds its own port 50000), never ``127.0.0.1`` and never
  a ``.0`` / ``.255`` last octet. Separate clusters on one machine can use separate blocks.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from libs.fsio.atomic import write_atomic
from libs.hardware.clique import format_clique_id
from libs.hardware.errors import UnknownNodeError
from libs.hardware.model import FabricInfo, FabricState, GpuInfo
from libs.imex.driver import SIMULATED_DRIVER_VERSION, parse_driver_version

CLUSTER_FILE_KIND = "SimulatedNVLinkCluster"
CLUSTER_FILE_VERSION = 1

_UUID_NAMESPACE = uuid.UUID("6f1c2a3e-9d4b-5e7f-8a1b-2c3d4e5f6a7b")
_NODE_NAME = re.compile(r"rack(0|[1-9][0-9]*)-tray(0|[1-9][0-9]*)")
_MAX_TRAYS_PER_RACK = 254  # last address octet is tray + 1, must stay in 1..254
_BOOL_FIELDS = ("imex_channel_device_nodes",)
_CLIQUE_ID_SPAN = 30000


def _uuid5(name: str) -> str:
    """``str(uuid.uuid5(_UUID_NAMESPACE, name))`` without the UUID object (hot for 10k+ nodes)."""
    h = hashlib.sha1(_UUID_NAMESPACE.bytes + name.encode(), usedforsecurity=False).hexdigest()
    variant = "89ab"[int(h[16], 16) & 0x3]
    return f"{h[:8]}-{h[8:12]}-5{h[13:16]}-{variant}{h[17:20]}-{h[20:32]}"


@functools.lru_cache(maxsize=4096)
def _rack_identity(seed: str, rack: int) -> tuple[str, int]:
    """(cluster UUID, clique id base) of a rack; cached because every node of the rack needs it."""
    digest = hashlib.sha256(f"{seed}/rack{rack}/clique".encode()).digest()
    return _uuid5(f"{seed}/rack{rack}"), 1 + int.from_bytes(digest[:4], "big") % _CLIQUE_ID_SPAN


GB200_MEMORY_BYTES = 189_471 * 2**20
"""HBM of one GB200 GPU as NVML reports it (189471 MiB)."""


@dataclass(frozen=True, slots=True)
class SimulatedNode:
    name: str
    rack: int
    tray: int
    ordinal: int
    """Position in the cluster (rack-major), 0-based."""
    partition: int
    address: str
    cluster_uuid: str
    clique_id: int

    @property
    def clique(self) -> str:
        """``<clusterUUID>.<cliqueId>``, the node's ``nvidia.com/gpu.clique`` value when healthy."""
        return format_clique_id(self.cluster_uuid, self.clique_id)


@dataclass(frozen=True, slots=True)
class ClusterDescription:
    racks: int
    trays_per_rack: int = 18
    gpus_per_tray: int = 4
    partitions_per_rack: int = 1
    seed: str = "cdsim"
    """Namespace of every derived UUID and clique id: two seeds give two disjoint clusters."""
    address_block: int = 1
    """Second octet of the first rack's addresses (127.<block>.0.1 is rack0-tray0)."""
    gpu_memory_bytes: int = GB200_MEMORY_BYTES
    driver_version: str = SIMULATED_DRIVER_VERSION
    """What NVML's nvmlSystemGetDriverVersion reports on every node not in the next field."""
    imex_channel_major: int = 234
    """Major the simulated ``/proc/devices`` gives ``nvidia-caps-imex-channels``."""
    imex_channel_device_nodes: bool = False
    """Whether a node's channels are real character devices (major:channel, made with mknod, for a
    real container runtime to inject; needs CAP_MKNOD and that major unused on the host) rather
    than regular files standing in for them."""
    node_driver_versions: tuple[tuple[str, str], ...] = ()
    """(node name, driver version) of nodes that run another driver (a JSON object in the file)."""

    def __post_init__(self) -> None:
        problems = []
        if self.racks < 1:
            problems.append(f"racks must be >= 1, got {self.racks}")
        if not 1 <= self.trays_per_rack <= _MAX_TRAYS_PER_RACK:
            problems.append(
                f"trays_per_rack must be in [1, {_MAX_TRAYS_PER_RACK}], got {self.trays_per_rack}"
            )
        if self.gpus_per_tray < 1:
            problems.append(f"gpus_per_tray must be >= 1, got {self.gpus_per_tray}")
        if not 1 <= self.partitions_per_rack <= max(self.trays_per_rack, 1):
            problems.append(
                f"partitions_per_rack must be in [1, trays_per_rack={self.trays_per_rack}], "
                f"got {self.partitions_per_rack}"
            )
        if not self.seed:
            problems.append("seed must not be empty")
        if not 1 <= self.address_block <= 255:
            problems.append(f"address_block must be in [1, 255], got {self.address_block}")
        elif self.racks >= 1 and self.address_block + (self.racks - 1) // 256 > 255:
            capacity = (256 - self.address_block) * 256
            problems.append(
                f"{self.racks} racks do not fit in 127.{self.address_block}+ (at most {capacity})"
            )
        if self.gpu_memory_bytes <= 0:
            problems.append(f"gpu_memory_bytes must be > 0, got {self.gpu_memory_bytes}")
        for name, version in (("driver_version", self.driver_version), *self.node_driver_versions):
            try:
                parse_driver_version(version)
            except ValueError as exc:
                problems.append(f"driver version of {name}: {exc}")
            if name != "driver_version":
                try:
                    self.parse_node_name(name)
                except UnknownNodeError as exc:
                    problems.append(f"driver version for an unknown node: {exc}")
        if len({name for name, _ in self.node_driver_versions}) != len(self.node_driver_versions):
            problems.append("node_driver_versions names a node twice")
        if not 1 <= self.imex_channel_major <= 4095:
            problems.append(
                f"imex_channel_major must be a Linux major in [1, 4095], got {self.imex_channel_major}"
            )
        if problems:
            raise ValueError("invalid cluster description: " + "; ".join(problems))

    # --- sizes -------------------------------------------------------------------------------

    @property
    def node_count(self) -> int:
        return self.racks * self.trays_per_rack

    @property
    def gpu_count(self) -> int:
        return self.node_count * self.gpus_per_tray

    @property
    def clique_count(self) -> int:
        return self.racks * self.partitions_per_rack

    # --- names -------------------------------------------------------------------------------

    def _check_position(self, rack: int, tray: int) -> None:
        if not (0 <= rack < self.racks and 0 <= tray < self.trays_per_rack):
            raise UnknownNodeError(
                f"no node rack{rack}-tray{tray} in a cluster of {self.racks} racks x {self.trays_per_rack} trays"
            )

    def _check_rack(self, rack: int) -> None:
        if not 0 <= rack < self.racks:
            raise UnknownNodeError(f"no rack {rack} in a cluster of {self.racks} racks")

    def _check_tray(self, tray: int) -> None:
        if not 0 <= tray < self.trays_per_rack:
            raise UnknownNodeError(f"no tray {tray} in racks of {self.trays_per_rack} trays")

    def node_name(self, rack: int, tray: int) -> str:
        self._check_position(rack, tray)
        return f"rack{rack}-tray{tray}"

    def parse_node_name(self, name: str) -> tuple[int, int]:
        """(rack, tray) of a node name of this cluster; UnknownNodeError otherwise."""
        match = _NODE_NAME.fullmatch(name)
        if match is None:
            raise UnknownNodeError(f"{name!r} is not a simulated node name (want rack<R>-tray<T>, 0-based)")
        rack, tray = int(match.group(1)), int(match.group(2))
        self._check_position(rack, tray)
        return rack, tray

    def node_names(self) -> Iterator[str]:
        for rack in range(self.racks):
            for tray in range(self.trays_per_rack):
                yield f"rack{rack}-tray{tray}"

    # --- fabric ------------------------------------------------------------------------------

    def rack_cluster_uuid(self, rack: int) -> str:
        self._check_rack(rack)
        return _rack_identity(self.seed, rack)[0]

    def partition_of_tray(self, tray: int) -> int:
        self._check_tray(tray)
        return tray * self.partitions_per_rack // self.trays_per_rack

    def partition_trays(self, partition: int) -> range:
        """The contiguous trays of NVLink partition ``partition`` (same for every rack)."""
        if not 0 <= partition < self.partitions_per_rack:
            raise ValueError(f"partition {partition} out of range [0, {self.partitions_per_rack})")
        parts, trays = self.partitions_per_rack, self.trays_per_rack
        # Tray t is in partition floor(t * parts / trays); invert with ceilings.
        return range(-(-partition * trays // parts), -(-(partition + 1) * trays // parts))

    def clique_id(self, rack: int, partition: int) -> int:
        """NVML ``cliqueId`` of a partition: a per-rack pseudo-random base plus the partition."""
        self._check_rack(rack)
        if not 0 <= partition < self.partitions_per_rack:
            raise ValueError(f"partition {partition} out of range [0, {self.partitions_per_rack})")
        return _rack_identity(self.seed, rack)[1] + partition

    def clique_nodes(self, rack: int, partition: int) -> list[str]:
        """Names of the nodes of one clique, in tray order."""
        return [self.node_name(rack, tray) for tray in self.partition_trays(partition)]

    # --- nodes -------------------------------------------------------------------------------

    def node_address(self, rack: int, tray: int) -> str:
        self._check_position(rack, tray)
        return f"127.{self.address_block + rack // 256}.{rack % 256}.{tray + 1}"

    def node_by_address(self, address: str) -> SimulatedNode:
        octets = address.split(".")
        if len(octets) != 4 or octets[0] != "127" or not all(o.isdigit() for o in octets):
            raise UnknownNodeError(f"{address!r} is not a simulated node address")
        a, b, c = (int(o) for o in octets[1:])
        rack = (a - self.address_block) * 256 + b
        tray = c - 1
        if (
            a < self.address_block
            or b > 255
            or not (0 <= rack < self.racks and 0 <= tray < self.trays_per_rack)
        ):
            raise UnknownNodeError(f"no node of this cluster has address {address}")
        return self._node(rack, tray)

    def _node(self, rack: int, tray: int) -> SimulatedNode:
        self._check_position(rack, tray)
        partition = tray * self.partitions_per_rack // self.trays_per_rack
        cluster_uuid, clique_base = _rack_identity(self.seed, rack)
        return SimulatedNode(
            name=f"rack{rack}-tray{tray}",
            rack=rack,
            tray=tray,
            ordinal=rack * self.trays_per_rack + tray,
            partition=partition,
            address=f"127.{self.address_block + rack // 256}.{rack % 256}.{tray + 1}",
            cluster_uuid=cluster_uuid,
            clique_id=clique_base + partition,
        )

    def node(self, name: str) -> SimulatedNode:
        return self._node(*self.parse_node_name(name))

    def node_at(self, ordinal: int) -> SimulatedNode:
        if not 0 <= ordinal < self.node_count:
            raise UnknownNodeError(f"node ordinal {ordinal} out of range [0, {self.node_count})")
        return self._node(*divmod(ordinal, self.trays_per_rack))

    def nodes(self) -> Iterator[SimulatedNode]:
        for ordinal in range(self.node_count):
            yield self.node_at(ordinal)

    def node_driver_version(self, name: str) -> str:
        """The driver version node `name` runs (NVML's nvmlSystemGetDriverVersion)."""
        self.parse_node_name(name)
        return dict(self.node_driver_versions).get(name, self.driver_version)

    # --- GPUs --------------------------------------------------------------------------------

    def gpu_uuid(self, rack: int, tray: int, gpu: int) -> str:
        self._check_position(rack, tray)
        if not 0 <= gpu < self.gpus_per_tray:
            raise ValueError(f"GPU {gpu} out of range [0, {self.gpus_per_tray})")
        return "GPU-" + _uuid5(f"{self.seed}/rack{rack}/tray{tray}/gpu{gpu}")

    def node_gpus(self, node: SimulatedNode) -> tuple[GpuInfo, ...]:
        """The node's GPUs with a healthy, completed fabric (before any injected fault)."""
        fabric = FabricInfo(
            cluster_uuid=node.cluster_uuid, clique_id=node.clique_id, state=FabricState.COMPLETED
        )
        return tuple(
            GpuInfo(
                uuid=self.gpu_uuid(node.rack, node.tray, index),
                index=index,
                memory_bytes=self.gpu_memory_bytes,
                fabric=fabric,
            )
            for index in range(self.gpus_per_tray)
        )

    # --- serialization -----------------------------------------------------------------------

    def to_json(self) -> str:
        fields_ = asdict(self)
        fields_["node_driver_versions"] = dict(self.node_driver_versions)
        return json.dumps({"kind": CLUSTER_FILE_KIND, "version": CLUSTER_FILE_VERSION, **fields_}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> ClusterDescription:
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"cluster description is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError("cluster description must be a JSON object")
        kind, version = data.pop("kind", None), data.pop("version", None)
        if kind != CLUSTER_FILE_KIND or version != CLUSTER_FILE_VERSION:
            raise ValueError(
                f"not a cluster description: kind={kind!r} version={version!r} "
                f"(want {CLUSTER_FILE_KIND!r} version {CLUSTER_FILE_VERSION})"
            )
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown field(s) in cluster description: {', '.join(unknown)}")
        per_node = data.pop("node_driver_versions", {})
        if not isinstance(per_node, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in per_node.items()
        ):
            raise ValueError(
                "cluster description field 'node_driver_versions' must map node names to versions"
            )
        for name, value in data.items():
            wanted = str if name in ("seed", "driver_version") else bool if name in _BOOL_FIELDS else int
            if type(value) is not wanted:
                raise ValueError(
                    f"cluster description field {name!r} must be {wanted.__name__}, got {value!r}"
                )
        return cls(**data, node_driver_versions=tuple(sorted(per_node.items())))

    def save(self, path: Path) -> None:
        write_atomic(path, self.to_json().encode())

    @classmethod
    def load(cls, path: Path) -> ClusterDescription:
        return cls.from_json(path.read_text())
