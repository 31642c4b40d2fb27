"""Injected hardware faults of one simulated node, shared between processes through a JSON file.

``cdsim`` (or a test) writes the file; the node agent's simulated backend reads it on every query
(a ``stat`` when nothing changed). Writes are atomic renames under an advisory lock, so a reader
sees the old or the new fault set, never half of one, and concurrent writers do not lose updates.

File format (version 1)::

    {"version": 1, "non_fabric": false, "fabric_state": "IN_PROGRESS", "health": null,
     "gpus": {"2": {"fabric_state": null, "health": "DEGRADED", "clique_id": null}}}

Node-wide values apply to every GPU; a GPU's own value wins over the node-wide one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import structlog

from libs.fsio.atomic import write_atomic
from libs.hardware.model import ZERO_CLUSTER_UUID, FabricInfo, FabricState, GpuHealth, GpuInfo

log = structlog.get_logger(__name__)

FAULTS_FILE_VERSION = 1


@dataclass(frozen=True, slots=True)
class GpuFault:
    fabric_state: FabricState | None = None
    health: GpuHealth | None = None
    clique_id: int | None = None
    """Report this NVML cliqueId instead of the partition's (makes GPUs of a node disagree)."""

    @property
    def empty(self) -> bool:
        return self == GpuFault()


@dataclass(frozen=True, slots=True)
class NodeFaults:
    non_fabric: bool = False
    """Report the node as having no NVLink fabric (NOT_SUPPORTED, all-zero cluster UUID)."""
    fabric_state: FabricState | None = None
    health: GpuHealth | None = None
    gpus: dict[int, GpuFault] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return self == NodeFaults()

    def with_gpu(self, index: int, **changes: Any) -> NodeFaults:
        """A copy with GPU ``index``'s fault updated (an all-None fault is dropped)."""
        gpus = dict(self.gpus)
        fault = dataclasses.replace(gpus.get(index, GpuFault()), **changes)
        if fault.empty:
            gpus.pop(index, None)
        else:
            gpus[index] = fault
        return dataclasses.replace(self, gpus=gpus)

    # --- JSON --------------------------------------------------------------------------------

    def to_json(self) -> str:
        def gpu(fault: GpuFault) -> dict[str, Any]:
            return {
                "fabric_state": _enum_name(fault.fabric_state),
                "health": _enum_name(fault.health),
                "clique_id": fault.clique_id,
            }

        doc = {
            "version": FAULTS_FILE_VERSION,
            "non_fabric": self.non_fabric,
            "fabric_state": _enum_name(self.fabric_state),
            "health": _enum_name(self.health),
            "gpus": {str(index): gpu(fault) for index, fault in sorted(self.gpus.items())},
        }
        return json.dumps(doc, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> NodeFaults:
        """Strict decode: unknown keys, states or types raise ValueError."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"fault file is not JSON: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("version") != FAULTS_FILE_VERSION:
            raise ValueError(f"fault file must be an object with version {FAULTS_FILE_VERSION}")
        _reject_unknown(doc, {"version", "non_fabric", "fabric_state", "health", "gpus"}, "fault file")
        non_fabric = doc.get("non_fabric", False)
        if not isinstance(non_fabric, bool):
            raise ValueError(f"non_fabric must be a boolean, got {non_fabric!r}")
        gpus_doc = doc.get("gpus", {})
        if not isinstance(gpus_doc, dict):
            raise ValueError("gpus must be an object keyed by GPU index")
        gpus: dict[int, GpuFault] = {}
        for key, value in gpus_doc.items():
            if not key.isdigit() or not isinstance(value, dict):
                raise ValueError(f"bad GPU fault entry {key!r}: {value!r}")
            _reject_unknown(value, {"fabric_state", "health", "clique_id"}, f"GPU {key} fault")
            clique_id = value.get("clique_id")
            if clique_id is not None and (type(clique_id) is not int or not 0 <= clique_id < 2**32):
                raise ValueError(f"GPU {key} clique_id must be a uint32, got {clique_id!r}")
            fault = GpuFault(
                fabric_state=_parse_enum(FabricState, value.get("fabric_state")),
                health=_parse_enum(GpuHealth, value.get("health")),
                clique_id=clique_id,
            )
            if not fault.empty:
                gpus[int(key)] = fault
        return cls(
            non_fabric=non_fabric,
            fabric_state=_parse_enum(FabricState, doc.get("fabric_state")),
            health=_parse_enum(GpuHealth, doc.get("health")),
            gpus=gpus,
        )


def _enum_name(value: FabricState | GpuHealth | None) -> str | None:
    return None if value is None else value.name


_Enum = TypeVar("_Enum", FabricState, GpuHealth)


def _parse_enum(kind: type[_Enum], value: object) -> _Enum | None:
    if value is None:
        return None
    if not isinstance(value, str) or value.upper() not in kind.__members__:
        raise ValueError(f"{value!r} is not a {kind.__name__} (one of {', '.join(kind.__members__)})")
    return kind[value.upper()]


def _reject_unknown(doc: dict[str, Any], known: set[str], what: str) -> None:
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ValueError(f"unknown field(s) in {what}: {', '.join(unknown)}")


def _first_set(first: _Enum | None, second: _Enum | None, default: _Enum) -> _Enum:
    if first is not None:
        return first
    return default if second is None else second


def apply_faults(gpus: tuple[GpuInfo, ...], faults: NodeFaults) -> tuple[GpuInfo, ...]:
    """The GPUs as NVML would report them with ``faults`` in effect (pure).

    A GPU that has not completed fabric registration reports an all-zero cluster UUID and clique
    0, as real GPUs do before the fabric manager has assigned them.
    """
    if faults.empty:
        return gpus
    result = []
    for gpu in gpus:
        own = faults.gpus.get(gpu.index, GpuFault())
        # Explicit None checks: HEALTHY and NOT_SUPPORTED are falsy IntEnum members.
        health = _first_set(own.health, faults.health, gpu.fabric.health)
        if faults.non_fabric:
            fabric = FabricInfo(ZERO_CLUSTER_UUID, 0, FabricState.NOT_SUPPORTED, health=health)
        else:
            state = _first_set(own.fabric_state, faults.fabric_state, gpu.fabric.state)
            if state is FabricState.COMPLETED:
                clique_id = gpu.fabric.clique_id if own.clique_id is None else own.clique_id
                fabric = FabricInfo(gpu.fabric.cluster_uuid, clique_id, state, gpu.fabric.status, health)
            else:
                fabric = FabricInfo(ZERO_CLUSTER_UUID, 0, state, health=health)
        result.append(dataclasses.replace(gpu, fabric=fabric))
    return tuple(result)


class FaultFile:
    """The fault file of one node, read with a stat-keyed cache and updated under a lock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_path = path.with_name(path.name + ".lock")
        self._cache_key: tuple[int, int, int] | None = None
        self._cached = NodeFaults()

    def read(self) -> NodeFaults:
        """Current faults; no file means none. A broken file keeps the last good value (logged)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._cache_key, self._cached = None, NodeFaults()
            return self._cached
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self._cache_key:
            return self._cached
        try:
            faults = NodeFaults.from_json(self.path.read_text())
        except FileNotFoundError:
            return self.read()  # replaced or removed between stat and open
        except ValueError as exc:
            log.warning("ignoring unreadable fault file", path=str(self.path), error=str(exc))
            return self._cached
        self._cache_key, self._cached = key, faults
        return faults

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def update(self, change: Callable[[NodeFaults], NodeFaults]) -> NodeFaults:
        """Apply ``change`` to the current faults and persist the result atomically."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            try:
                current = NodeFaults.from_json(self.path.read_text())
            except FileNotFoundError:
                current = NodeFaults()
            new = change(current)
            write_atomic(self.path, new.to_json().encode())
        return new
