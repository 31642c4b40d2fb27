"""NVIDIA's compute-domain kubelet plugin checkpoint: read it, verify it, map its claims to ours.

A node switched from NVIDIA's driver to this one still has claims that NVIDIA's plugin prepared
(running pods); kubelet will unprepare them, or prepare them again after a kubelet restart, and
both must succeed. The first start of our agent therefore takes these claims over
(:meth:`services.nodeagent.core.checkpoint.Checkpoint.load` calls :func:`parse_nvidia_checkpoint` and
:func:`map_claims`).

Facts used, read from github.com/NVIDIA/k8s-dra-driver-gpu at commit
22407113785e78c7763b4637689a201eb39c6199 (last change of the checkpoint types in 37bad40de63f):

- File: ``checkpoint.json`` in the plugin directory ``<kubelet plugins dir>/compute-domain.nvidia.com``
  (``cmd/compute-domain-kubelet-plugin/main.go``: ``DriverPluginCheckpointFileBasename``,
  ``DriverPluginPath``), written through kubelet's checkpointmanager (``device_state.go``). It is
  the very path of our own checkpoint, so the two are told apart by content.
- Layout (``checkpoint.go``, ``checkpointv.go``, ``prepared.go``): compact Go JSON
  ``{"checksum": <uint>, "v1": {...}, "v2": {...}}``; a current writer fills both versions.

  * V1 (driver 25.3): ``v1.preparedClaims[<claim uid>] = {"status": <ResourceClaimStatus>,
    "preparedDevices": [...]}``; every V1 claim counts as PrepareCompleted.
  * V2: ``v2 = {"checksum": <uint>, "preparedClaims": {<claim uid>: {"checkpointState":
    "PrepareStarted"|"PrepareCompleted", "status", "preparedDevices", "name", "namespace"}},
    "nodeBootID": "<kernel boot id>"}``. Name and namespace are only written with PrepareStarted.
  * ``preparedDevices`` is a list of groups ``{"devices": [{"channel": {"info": {"id": N},
    "device": D} | null, "daemon": {...} | null}], "configState": {"Type": "channel"|"daemon",
    "ComputeDomain": "<ComputeDomain UID>"}}`` with D = ``{"Requests", "PoolName",
    "DeviceName", "CDIDeviceIDs"}`` (channel claims: ``k8s.compute-domain.nvidia.com/claim=<uid>-
    channel-0``, the id our agent gives the same claim).
  * The 25.3.0-rc.2 layout (``checkpoint_legacy.go``: claim -> list of groups) is not read.
- Checksum (``vendor/k8s.io/kubernetes/pkg/kubelet/checkpointmanager/checksum/checksum.go``,
  ``vendor/k8s.io/kubernetes/pkg/util/hash/hash.go``, ``vendor/k8s.io/utils/dump/dump.go``):
  FNV-1a 32 bit (stored as an unsigned integer) of the go-spew ``%#v`` rendering of the JSON
  bytes, which for a byte slice is ``([]uint8)[b0 b1 ...]`` (decimal bytes, one space apart).
  The top-level checksum covers ``{"checksum":0,"v1":...}`` (V2 left out), the V2 checksum the
  V2 object with its own checksum set to 0. NVIDIA's plugin re-marshals the decoded file to
  verify; we hash the file's own bytes of each part, which is the same text for any file that
  plugin wrote (and refuses a hand-edited one that it might have accepted).

Nothing here writes: the caller keeps the file and records the mapped claims.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from libs.contract.names import CHANNEL_CONFIG_KIND, DRIVER_NAME
from libs.runtime.errors import PermanentError

SUPPORTED_VERSIONS = ("v1", "v2")
_TOP_LEVEL_KEYS = frozenset({"checksum", *SUPPORTED_VERSIONS})
_FNV32_OFFSET = 0x811C9DC5
_FNV32_PRIME = 0x01000193
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()

STATE_STARTED = "PrepareStarted"
STATE_COMPLETED = "PrepareCompleted"


class DeviceKind(StrEnum):
    CHANNEL = "channel"
    DAEMON = "daemon"


class NvidiaCheckpointError(PermanentError):
    """NVIDIA's checkpoint cannot be read: the message names the problem."""


@dataclass(frozen=True)
class NvidiaDevice:
    kind: DeviceKind
    domain_uid: str  # the group's configState.ComputeDomain ("" if absent)
    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...]


@dataclass(frozen=True)
class NvidiaClaim:
    claim_uid: str
    state: str  # as written; anything but the two known states is not mapped
    namespace: str
    name: str
    devices: tuple[NvidiaDevice, ...]
    config_domain_uids: tuple[str, ...]  # domainID of our driver's channel configs in the status


@dataclass(frozen=True)
class NvidiaCheckpoint:
    version: str  # "v2" or "v1": the newest one present, which NVIDIA's plugin itself reads
    boot_id: str  # V2 nodeBootID, "" in V1
    claims: tuple[NvidiaClaim, ...]


@dataclass(frozen=True)
class MappedClaim:
    """One NVIDIA claim as our checkpoint keeps it.

    ``domain_uid`` is "" and ``problem`` says why when the claim cannot be mapped to a channel
    of one ComputeDomain (it is kept all the same, so kubelet can unprepare it)."""

    claim_uid: str
    completed: bool
    namespace: str
    name: str
    domain_uid: str
    cdi_device_ids: tuple[str, ...]
    request_names: tuple[str, ...]
    problem: str | None


def upstream_checksum(data: bytes) -> int:
    """kubelet checkpointmanager's checksum of ``data`` (a Go ``[]byte``)."""
    rendered = b"([]uint8)[" + b" ".join(str(b).encode() for b in data) + b"]"
    h = _FNV32_OFFSET
    for byte in rendered:
        h = ((h ^ byte) * _FNV32_PRIME) & 0xFFFFFFFF
    return h


def looks_like_nvidia_checkpoint(raw: bytes) -> bool:
    """True for a JSON object in NVIDIA's layout (a numeric or versioned checksum document,
    not ours: ours has ``version`` and ``entries`` and a ``sha256:`` checksum)."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(doc, dict) or "version" in doc or "entries" in doc:
        return False
    checksum = doc.get("checksum")
    return (isinstance(checksum, int) and not isinstance(checksum, bool)) or "v1" in doc or "v2" in doc


def parse_nvidia_checkpoint(raw: bytes) -> NvidiaCheckpoint:
    """Verify and decode NVIDIA's checkpoint; :class:`NvidiaCheckpointError` names what is wrong."""
    try:
        text = raw.decode()
        doc = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NvidiaCheckpointError(f"invalid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise NvidiaCheckpointError("top level is not a JSON object")
    unknown = sorted(set(doc) - _TOP_LEVEL_KEYS)
    if unknown:
        raise NvidiaCheckpointError(
            f"unknown checkpoint version or field(s) {unknown}: this agent reads versions "
            f"{', '.join(SUPPORTED_VERSIONS)} of NVIDIA's format"
        )
    _verify_checksums(text, doc)
    v2 = doc.get("v2")
    v1 = doc.get("v1")
    try:
        if v2 is not None:
            body = _obj(v2, "v2")
            claims = _obj(body.get("preparedClaims") or {}, "v2.preparedClaims")
            return NvidiaCheckpoint(
                version="v2",
                boot_id=_str(body.get("nodeBootID", ""), "v2.nodeBootID"),
                claims=tuple(_claim(uid, value, "v2") for uid, value in sorted(claims.items())),
            )
        if v1 is not None:
            claims = _obj(_obj(v1, "v1").get("preparedClaims") or {}, "v1.preparedClaims")
            if any(isinstance(value, list) for value in claims.values()):
                raise NvidiaCheckpointError(
                    "the 25.3.0-rc.2 layout (claims as lists of device groups) is not supported"
                )
            return NvidiaCheckpoint(
                version="v1",
                boot_id="",
                claims=tuple(_claim(uid, value, "v1") for uid, value in sorted(claims.items())),
            )
    except (TypeError, ValueError, AttributeError) as exc:
        raise NvidiaCheckpointError(f"malformed content: {exc}") from None
    return NvidiaCheckpoint(version="v1", boot_id="", claims=())


def map_claims(checkpoint: NvidiaCheckpoint) -> list[MappedClaim]:
    """Our view of each claim: its ComputeDomain and CDI ids, or why they cannot be mapped."""
    return [_map(claim) for claim in checkpoint.claims]


# ---- checksums ---------------------------------------------------------------------------------


def _verify_checksums(text: str, doc: dict[str, Any]) -> None:
    checksum = doc.get("checksum")
    if not isinstance(checksum, int) or isinstance(checksum, bool):
        raise NvidiaCheckpointError(f"checksum is not an unsigned integer: {checksum!r}")
    spans = _member_spans(text, _skip(text, 0))
    v1_text = ""
    if doc.get("v1") is not None:
        start, end = spans["v1"]
        v1_text = f',"v1":{text[start:end]}'
    # What the writer hashed for the top-level checksum: itself 0, V2 left out.
    top = upstream_checksum(f'{{"checksum":0{v1_text}}}'.encode())
    if top != checksum:
        raise NvidiaCheckpointError(f"checksum mismatch: file says {checksum}, content hashes to {top}")
    if doc.get("v2") is None:
        return
    v2_checksum = doc["v2"].get("checksum") if isinstance(doc["v2"], dict) else None
    if not isinstance(v2_checksum, int) or isinstance(v2_checksum, bool):
        raise NvidiaCheckpointError(f"v2 checksum is not an unsigned integer: {v2_checksum!r}")
    start, end = spans["v2"]
    v2_text = text[start:end]
    v2_spans = _member_spans(v2_text, 0)
    c_start, c_end = v2_spans["checksum"]
    zeroed = f"{v2_text[:c_start]}0{v2_text[c_end:]}"
    got = upstream_checksum(zeroed.encode())
    if got != v2_checksum:
        raise NvidiaCheckpointError(
            f"v2 checksum mismatch: file says {v2_checksum!r}, content hashes to {got}"
        )


def _skip(text: str, pos: int) -> int:
    match = _WS.match(text, pos)
    return match.end() if match else pos


def _member_spans(text: str, pos: int) -> dict[str, tuple[int, int]]:
    """Where each member value of the JSON object starting at ``pos`` lies in ``text`` (the
    checksum covers the writer's exact bytes, so they are sliced, not re-encoded)."""
    spans: dict[str, tuple[int, int]] = {}
    try:
        if text[pos] != "{":
            raise ValueError("not an object")
        pos = _skip(text, pos + 1)
        if text[pos] == "}":
            return spans
        while True:
            if text[pos] != '"':
                raise ValueError("member name expected")
            key, pos = json.decoder.scanstring(text, pos + 1)  # type: ignore[attr-defined]
            pos = _skip(text, pos)
            if text[pos] != ":":
                raise ValueError("':' expected")
            pos = _skip(text, pos + 1)
            _, end = _DECODER.raw_decode(text, pos)
            spans[key] = (pos, end)
            pos = _skip(text, end)
            if text[pos] == "}":
                return spans
            if text[pos] != ",":
                raise ValueError("',' expected")
            pos = _skip(text, pos + 1)
    except (IndexError, ValueError) as exc:
        raise NvidiaCheckpointError(f"cannot locate checksummed parts: {exc}") from None


# ---- decoding ----------------------------------------------------------------------------------


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{where}: object expected, got {type(value).__name__}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise TypeError(f"{where}: array expected, got {type(value).__name__}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where}: string expected, got {type(value).__name__}")
    return value


def _strs(value: Any, where: str) -> tuple[str, ...]:
    return tuple(_str(v, where) for v in _list(value, where))


def _claim(uid: str, value: Any, version: str) -> NvidiaClaim:
    where = f"{version}.preparedClaims[{uid}]"
    body = _obj(value, where)
    state = STATE_COMPLETED if version == "v1" else _str(body.get("checkpointState", ""), where)
    devices: list[NvidiaDevice] = []
    for group in _list(body.get("preparedDevices"), f"{where}.preparedDevices"):
        group = _obj(group, f"{where}.preparedDevices[]")
        config = _obj(group.get("configState") or {}, f"{where}.configState")
        domain = _str(config.get("ComputeDomain", ""), f"{where}.configState.ComputeDomain")
        for item in _list(group.get("devices"), f"{where}.devices"):
            item = _obj(item, f"{where}.devices[]")
            for kind in DeviceKind:
                prepared = item.get(kind.value)
                if prepared is None:
                    continue
                device = _obj(_obj(prepared, f"{where}.{kind.value}").get("device") or {}, f"{where}.device")
                devices.append(
                    NvidiaDevice(
                        kind=kind,
                        domain_uid=domain,
                        requests=_strs(device.get("Requests"), f"{where}.Requests"),
                        pool=_str(device.get("PoolName", ""), f"{where}.PoolName"),
                        device=_str(device.get("DeviceName", ""), f"{where}.DeviceName"),
                        cdi_device_ids=_strs(device.get("CDIDeviceIDs"), f"{where}.CDIDeviceIDs"),
                    )
                )
    return NvidiaClaim(
        claim_uid=uid,
        state=state,
        namespace=_str(body.get("namespace", ""), f"{where}.namespace"),
        name=_str(body.get("name", ""), f"{where}.name"),
        devices=tuple(devices),
        config_domain_uids=_config_domains(_obj(body.get("status") or {}, f"{where}.status")),
    )


def _config_domains(status: dict[str, Any]) -> tuple[str, ...]:
    """domainIDs of our driver's ComputeDomainChannelConfigs in the claim's allocation (what
    a claim that was only PrepareStarted, with no devices yet, says about its domain)."""
    allocation = status.get("allocation") or {}
    configs = (allocation.get("devices") or {}).get("config") or []
    domains: list[str] = []
    for config in configs:
        opaque = config.get("opaque") or {}
        params = opaque.get("parameters") or {}
        if opaque.get("driver") == DRIVER_NAME and params.get("kind") == CHANNEL_CONFIG_KIND:
            domains.append(str(params.get("domainID", "")))
    return tuple(dict.fromkeys(domains))


def _map(claim: NvidiaClaim) -> MappedClaim:
    completed = claim.state == STATE_COMPLETED
    cdi_ids = tuple(dict.fromkeys(i for d in claim.devices for i in d.cdi_device_ids))
    requests = tuple(dict.fromkeys(r for d in claim.devices for r in d.requests))
    problem: str | None = None
    domain = ""
    daemons = [d for d in claim.devices if d.kind is DeviceKind.DAEMON]
    if claim.state not in (STATE_STARTED, STATE_COMPLETED):
        problem = f"unknown checkpoint state {claim.state!r}"
    elif daemons:
        problem = (
            f"holds NVIDIA's IMEX daemon device {daemons[0].device!r} (a claim of NVIDIA's daemon "
            "pods); this driver has no such device"
        )
    else:
        domains = {d.domain_uid for d in claim.devices} if claim.devices else set(claim.config_domain_uids)
        if completed and not claim.devices:
            problem = "completed without prepared devices"
        elif len(domains) != 1 or "" in domains:
            problem = f"names {len(domains - {''})} ComputeDomains (want exactly one)"
        else:
            domain = domains.pop()
    return MappedClaim(
        claim_uid=claim.claim_uid,
        completed=completed,
        namespace=claim.namespace,
        name=claim.name,
        domain_uid=domain,
        cdi_device_ids=cdi_ids,
        request_names=requests,
        problem=problem,
    )
