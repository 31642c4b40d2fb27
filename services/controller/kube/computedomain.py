"""The ComputeDomain custom resource and its mapping to the store (pure).

Names are those of NVIDIA's driver, so existing manifests and
tooling keep working: group `resource.nvidia.com`, version `v1beta1`, plural
`computedomains`, finalizer and label `resource.nvidia.com/computeDomain`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from libs.gen.computedomain.state import v1 as pb
from libs.runtime.errors import PermanentError
from services.controller.status_model import StatusValue

GROUP = "resource.nvidia.com"
VERSION = "v1beta1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ComputeDomain"
PLURAL = "computedomains"

# Finalizer on the CD and on the objects made for it; also the label key (value: CD uid).
FINALIZER = "resource.nvidia.com/computeDomain"
LABEL_KEY = "resource.nvidia.com/computeDomain"

SOURCE_KUBERNETES = "kubernetes"

_MODES = {"Single": pb.AllocationMode.SINGLE, "All": pb.AllocationMode.ALL}
_MODE_NAMES = {v: k for k, v in _MODES.items()}


class InvalidComputeDomain(PermanentError, ValueError):
    """The CR's spec cannot be mirrored (the CRD's validation should have refused it)."""


def allocation_mode_name(mode: pb.AllocationMode) -> str:
    return _MODE_NAMES[pb.AllocationMode(mode)]


def spec_from_cr(cr: dict[str, Any]) -> pb.ComputeDomainSpec:
    spec = cr.get("spec") or {}
    num_nodes = spec.get("numNodes", 0)
    if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 0:
        raise InvalidComputeDomain(f"spec.numNodes must be an integer >= 0, got {num_nodes!r}")
    channel = spec.get("channel") or {}
    rct = (channel.get("resourceClaimTemplate") or {}).get("name")
    if not isinstance(rct, str) or not rct:
        raise InvalidComputeDomain("spec.channel.resourceClaimTemplate.name is required")
    mode = channel.get("allocationMode", "Single")
    if mode not in _MODES:
        raise InvalidComputeDomain(f"spec.channel.allocationMode must be Single or All, got {mode!r}")
    return pb.ComputeDomainSpec(
        num_nodes=num_nodes,
        channel=pb.ChannelSpec(resource_claim_template_name=rct, allocation_mode=_MODES[mode]),
    )


def _parse_time_ms(value: str | None) -> int:
    if not value:
        return 0
    return int(datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1000)


def format_time(unix_ms: int) -> str:
    return datetime.fromtimestamp(unix_ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def domain_from_cr(cr: dict[str, Any]) -> pb.ComputeDomain:
    """The store record mirroring a live CR (no status: the controller computes it)."""
    meta = cr["metadata"]
    return pb.ComputeDomain(
        uid=meta["uid"],
        namespace=meta["namespace"],
        name=meta["name"],
        spec=spec_from_cr(cr),
        created_unix_ms=_parse_time_ms(meta.get("creationTimestamp")),
        source=SOURCE_KUBERNETES,
    )


def cr_status(status: StatusValue) -> dict[str, Any]:
    """status.status, status.nodes (and nodeCount, the Nodes printer column), status.conditions
    and, once decided, status.imexMesh, as the CRD declares them."""
    mesh = {"imexMesh": status.imex_mesh} if status.imex_mesh else {}
    return mesh | {
        "status": "Ready" if status.ready else "NotReady",
        "nodeCount": len(status.nodes),
        "nodes": [
            {
                "name": n.name,
                "ipAddress": n.ip_address,
                "cliqueID": n.clique_id,
                "index": n.index,
                "status": "Ready" if n.ready else "NotReady",
            }
            for n in status.nodes
        ],
        "conditions": [
            {
                "type": c.type,
                "status": c.status,
                "reason": c.reason,
                "message": c.message,
                "lastTransitionTime": format_time(c.last_transition_unix_ms),
            }
            for c in status.conditions
        ],
    }


def cr_status_differs(current: dict[str, Any] | None, desired: dict[str, Any]) -> bool:
    current = current or {}
    return any(
        current.get(k) != desired.get(k) for k in ("status", "nodeCount", "nodes", "conditions", "imexMesh")
    )


@dataclass(frozen=True, slots=True)
class StatusEcho:
    """A status this controller wrote to a CR, and what the API server kept of it: a CRD that
    does not declare some of our fields (NVIDIA's, left installed) prunes them."""

    sent: dict[str, Any]
    kept: dict[str, Any]


def seen_status(current: dict[str, Any] | None, echo: StatusEcho | None) -> dict[str, Any] | None:
    """The status to compare a desired one with: what was last written, while the CR shows exactly
    what the server kept of that write; otherwise the CR's own (someone else changed it). Without
    this, a pruned field reads as a difference, and every pass writes again. Pure."""
    if echo is not None and not cr_status_differs(current, echo.kept):
        return echo.sent
    return current


def status_transition(current: dict[str, Any] | None, desired: dict[str, Any]) -> bool:
    """Whether `desired` changes what a user waits for: status.status, a condition's type, status
    or reason (what events report), or the mesh mode; not merely the node list, the node count or
    a message. Pure."""

    def summary(s: dict[str, Any]) -> tuple[Any, ...]:
        conditions = tuple(
            (c.get("type"), c.get("status"), c.get("reason")) for c in s.get("conditions") or []
        )
        return s.get("status"), s.get("imexMesh"), conditions

    return summary(current or {}) != summary(desired)


def has_finalizer(cr: dict[str, Any]) -> bool:
    return FINALIZER in (cr.get("metadata", {}).get("finalizers") or [])


def finalizers_patch(cr: dict[str, Any], present: bool) -> list[dict[str, Any]]:
    """A JSON patch adding or removing our finalizer, refused if the CR changed since it was read."""
    meta = cr["metadata"]
    current = list(meta.get("finalizers") or [])
    wanted = [f for f in current if f != FINALIZER] + ([FINALIZER] if present else [])
    return [
        {"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]},
        {"op": "add", "path": "/metadata/finalizers", "value": wanted},
    ]


def status_patch(status: dict[str, Any]) -> list[dict[str, Any]]:
    """A JSON patch setting the status subresource (the controller owns all of it)."""
    return [{"op": "add", "path": "/status", "value": status}]


def is_deleting(cr: dict[str, Any]) -> bool:
    return bool(cr.get("metadata", {}).get("deletionTimestamp"))


def object_ref(cr: dict[str, Any]) -> dict[str, Any]:
    meta = cr["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "namespace": meta["namespace"],
        "uid": meta["uid"],
        "resourceVersion": meta.get("resourceVersion", ""),
    }
