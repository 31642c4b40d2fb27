"""What kubelet reads from a pod and its ResourceClaims before calling a DRA driver (pure).

A pod entry in ``spec.resourceClaims`` names a claim directly (``resourceClaimName``) or through a
template (``resourceClaimTemplateName``; the resourceclaim controller creates the claim and
records its name in ``status.resourceClaimStatuses``). Kubelet prepares a claim only when it is
allocated and reserved for the pod, and hands it to each driver that has allocation results in it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class PodKey:
    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A claim as NodePrepareResources names it."""

    namespace: str
    name: str
    uid: str


class NotReadyYet(Exception):
    """The pod's claims cannot be prepared yet (not created, allocated or reserved); the message says why."""


def pod_key(pod: Mapping[str, Any]) -> PodKey:
    meta = pod.get("metadata") or {}
    return PodKey(str(meta.get("namespace", "")), str(meta.get("name", "")), str(meta.get("uid", "")))


def is_terminating(pod: Mapping[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def is_finished(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def is_running(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
        if isinstance(c, Mapping)
    )


def claim_names(pod: Mapping[str, Any]) -> list[str]:
    """Names of the pod's ResourceClaims in spec order; NotReadyYet while one is still being created.

    A template entry whose status says no claim was needed (resourceClaimName unset) is skipped,
    as kubelet does.
    """
    statuses: dict[str, Any] = {}
    for entry in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
        if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
            statuses[entry["name"]] = entry.get("resourceClaimName")
    names: list[str] = []
    for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
        if not isinstance(entry, Mapping):
            continue
        direct = entry.get("resourceClaimName")
        if isinstance(direct, str) and direct:
            names.append(direct)
            continue
        if entry.get("name") not in statuses:
            raise NotReadyYet(
                f"the ResourceClaim for pod claim {entry.get('name')!r} has not been created yet"
            )
        generated = statuses[entry["name"]]
        if isinstance(generated, str) and generated:
            names.append(generated)
    return names


def allocated_to_driver(claim: Mapping[str, Any], driver: str) -> ClaimRef | None:
    """The claim as our driver is told about it if a device of `driver` is allocated in it."""
    meta = claim.get("metadata") or {}
    allocation = (claim.get("status") or {}).get("allocation")
    if not isinstance(allocation, Mapping):
        return None
    results = ((allocation.get("devices") or {}).get("results")) or []
    if not any(isinstance(r, Mapping) and r.get("driver") == driver for r in results):
        return None
    return ClaimRef(str(meta.get("namespace", "")), str(meta.get("name", "")), str(meta.get("uid", "")))


def claim_for_driver(claim: Mapping[str, Any], pod_uid: str, driver: str) -> ClaimRef | None:
    """The claim as our driver is told about it, None if no device of `driver` is allocated in it.

    NotReadyYet while the claim is not allocated or not reserved for the pod (kubelet refuses to
    run a pod whose claim is not reserved for it).
    """
    meta = claim.get("metadata") or {}
    ref = ClaimRef(str(meta.get("namespace", "")), str(meta.get("name", "")), str(meta.get("uid", "")))
    status = claim.get("status") or {}
    allocation = status.get("allocation")
    if not isinstance(allocation, Mapping):
        raise NotReadyYet(f"ResourceClaim {ref.namespace}/{ref.name} is not allocated yet")
    reserved = {str(r.get("uid", "")) for r in status.get("reservedFor") or [] if isinstance(r, Mapping)}
    if pod_uid not in reserved:
        raise NotReadyYet(f"ResourceClaim {ref.namespace}/{ref.name} is not reserved for the pod yet")
    return allocated_to_driver(claim, driver)
