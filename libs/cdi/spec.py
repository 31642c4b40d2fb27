"""The per-claim CDI spec of a ComputeDomain channel claim (pure: no I/O).

One spec per prepared claim, kind ``k8s.compute-domain.nvidia.com/claim``, holding one device
``<claimUID>-channel-0``. On a fabric node the device injects IMEX channel device nodes
(``/dev/nvidia-caps-imex-channels/channel<N>``, char device, the channel driver's major, minor N);
on a non-fabric node it injects no device node, only an environment variable saying so, because
the loader refuses a device with empty containerEdits and the pod must still start.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from libs.cdi.versions import required_cdi_version

VENDOR = "k8s.compute-domain.nvidia.com"
CLAIM_CLASS = "claim"
KIND = f"{VENDOR}/{CLAIM_CLASS}"

CHANNEL_DEVICE_DIR = "/dev/nvidia-caps-imex-channels"
MAX_CHANNELS = 2048  # channels 0..2047, what allocationMode All injects
CHANNEL_FILE_MODE = 0o666
# CDI `permissions` is the device cgroup access string, not a file mode: read and write suffice.
CHANNEL_CGROUP_ACCESS = "rw"
# Tells the workload which channels it got: "0" (Single), "all" (All) or "none" (non-fabric
# node). Deliberately not an NVIDIA_* name: those are interpreted by the NVIDIA container runtime.
CHANNELS_ENV = "COMPUTE_DOMAIN_IMEX_CHANNELS"

ALLOCATION_SINGLE = "Single"
ALLOCATION_ALL = "All"

# A device-name segment as the loader accepts it (the name is "<uid>-channel-0", so only the
# first character and the inner ones matter); also keeps the file name inside the CDI root.
_CLAIM_UID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")


def validate_claim_uid(claim_uid: str) -> None:
    if not _CLAIM_UID_RE.fullmatch(claim_uid):
        raise ValueError(f"claim UID {claim_uid!r} cannot be part of a CDI device name")


def claim_device_name(claim_uid: str) -> str:
    return f"{claim_uid}-channel-0"


def claim_cdi_device_id(claim_uid: str) -> str:
    """Fully qualified CDI device id returned to kubelet for the claim."""
    return f"{KIND}={claim_device_name(claim_uid)}"


def claim_spec_basename(claim_uid: str) -> str:
    """File name without extension, as the CDI library's transient spec names are built."""
    return f"{VENDOR}-{CLAIM_CLASS}_{claim_uid}"


def channels_for(allocation_mode: str, *, fabric: bool) -> range:
    """The channel numbers a claim injects on a node."""
    if allocation_mode not in (ALLOCATION_SINGLE, ALLOCATION_ALL):
        raise ValueError(f"unknown allocationMode {allocation_mode!r}")
    if not fabric:
        return range(0)
    return range(1) if allocation_mode == ALLOCATION_SINGLE else range(MAX_CHANNELS)


def _channels_env_value(channels: Sequence[int]) -> str:
    if not channels:
        return "none"
    if channels == range(MAX_CHANNELS) or (
        len(channels) == MAX_CHANNELS and sorted(channels) == list(range(MAX_CHANNELS))
    ):
        return "all"
    return ",".join(str(c) for c in channels)


def build_claim_spec(
    claim_uid: str,
    *,
    channels: Sequence[int],
    major: int | None,
    host_dev_root: str | PurePosixPath | None = None,
) -> dict[str, Any]:
    """The CDI spec (JSON form) for one claim, as :func:`render_claim_spec` writes it.

    ``channels`` empty means a non-fabric node: no device node is injected. ``major`` is the
    ``nvidia-caps-imex-channels`` major from ``/proc/devices`` (required when channels are
    given; 0 would make the runtime stat the host node instead). ``host_dev_root`` is the host
    directory that plays ``/dev`` (simulation, or a driver root mounted elsewhere); when set and
    not ``/dev`` each device node carries a ``hostPath`` under it.
    """
    spec, nodes = _assemble(claim_uid, channels, major, host_dev_root)
    if nodes is not None:
        # The cached node dicts are shared; hand out copies.
        spec["devices"][0]["containerEdits"]["deviceNodes"] = [dict(n) for n in nodes.dicts]
    return spec


def render_claim_spec(
    claim_uid: str,
    *,
    channels: Sequence[int],
    major: int | None,
    host_dev_root: str | PurePosixPath | None = None,
) -> bytes:
    """The file content for :func:`build_claim_spec`'s spec: compact JSON.

    Fast path for allocationMode All: the 2048-node array is encoded once per (channels, major,
    host dir) and spliced in, instead of re-encoding ~370 kB of JSON on every prepare.
    """
    spec, nodes = _assemble(claim_uid, channels, major, host_dev_root)
    if nodes is None:
        return _dumps(spec).encode()
    device = spec["devices"][0]
    return (
        f'{{"cdiVersion":{_dumps(spec["cdiVersion"])},"kind":{_dumps(spec["kind"])},'
        f'"devices":[{{"name":{_dumps(device["name"])},"containerEdits":'
        f'{{"env":{_dumps(device["containerEdits"]["env"])},"deviceNodes":{nodes.json}}}}}]}}'
    ).encode()


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


@dataclass(frozen=True)
class _ChannelNodes:
    dicts: tuple[dict[str, Any], ...]  # shared: never mutate
    json: str


def _assemble(
    claim_uid: str,
    channels: Sequence[int],
    major: int | None,
    host_dev_root: str | PurePosixPath | None,
) -> tuple[dict[str, Any], _ChannelNodes | None]:
    validate_claim_uid(claim_uid)
    edits: dict[str, Any] = {"env": [f"{CHANNELS_ENV}={_channels_env_value(channels)}"]}
    nodes: _ChannelNodes | None = None
    if channels:
        if major is None or major <= 0:
            raise ValueError(f"IMEX channel device major must be > 0, got {major!r}")
        host_dir: str | None = None
        if host_dev_root is not None and PurePosixPath(host_dev_root) != PurePosixPath("/dev"):
            host_dir = f"{PurePosixPath(host_dev_root)}/nvidia-caps-imex-channels"
        key = channels if isinstance(channels, range) else tuple(channels)
        nodes = _channel_nodes(key, major, host_dir)
        edits["deviceNodes"] = nodes.dicts
    spec: dict[str, Any] = {
        "cdiVersion": "",
        "kind": KIND,
        "devices": [{"name": claim_device_name(claim_uid), "containerEdits": edits}],
    }
    spec["cdiVersion"] = required_cdi_version(spec)
    return spec, nodes


@functools.lru_cache(maxsize=8)
def _channel_nodes(channels: tuple[int, ...] | range, major: int, host_dir: str | None) -> _ChannelNodes:
    bad = [c for c in channels if not 0 <= c < MAX_CHANNELS]
    if bad:
        raise ValueError(f"IMEX channel numbers out of range 0..{MAX_CHANNELS - 1}: {bad[:5]}")
    dicts = tuple(_device_node(c, major, host_dir) for c in channels)
    return _ChannelNodes(dicts=dicts, json=_dumps(list(dicts)))


def _device_node(channel: int, major: int, host_dir: str | None) -> dict[str, Any]:
    node: dict[str, Any] = {
        "path": f"{CHANNEL_DEVICE_DIR}/channel{channel}",
        "type": "c",
        "major": major,
        "minor": channel,
        "fileMode": CHANNEL_FILE_MODE,
        "permissions": CHANNEL_CGROUP_ACCESS,
    }
    if host_dir is not None:
        node["hostPath"] = f"{host_dir}/channel{channel}"
    return node
