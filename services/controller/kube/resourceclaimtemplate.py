"""The workload ResourceClaimTemplate the controller creates for each ComputeDomain.

Shape (as NVIDIA's driver makes it): in the CD's namespace, named by
`spec.channel.resourceClaimTemplate.name`, labelled and finalized
`resource.nvidia.com/computeDomain`, labelled `resource.nvidia.com/computeDomainTarget: Workload`
(NVIDIA's controller selects its workload templates by that label, so after a rollback to its
driver it finds ours), one request `channel` for exactly one
device of the default channel DeviceClass, and opaque config for our driver
carrying `ComputeDomainChannelConfig` (CD uid, allocation mode). Written in the resource.k8s.io
version the API server prefers (v1; v1beta2 or v1beta1 on Kubernetes 1.33/1.32), whose request
shape differs (see libs.kube.resource_api).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import structlog
from kubernetes_asyncio.client import ApiClient, V1DeleteOptions, V1Preconditions
from kubernetes_asyncio.client.exceptions import ApiException

from libs.contract.channel_config import channel_config
from libs.contract.names import CHANNEL_DEVICE_CLASS, CHANNEL_REQUEST, DRIVER_NAME
from libs.kube.resource_api import api_version, device_request, resource_path, typed_api
from services.controller.kube.computedomain import FINALIZER, LABEL_KEY

log = structlog.get_logger(__name__)

# NVIDIA's controller lists workload templates by these (its daemon templates say "Daemon").
TARGET_LABEL_KEY = "resource.nvidia.com/computeDomainTarget"
TARGET_WORKLOAD = "Workload"


def build_rct(
    cd_uid: str, namespace: str, name: str, allocation_mode: str, version: str = "v1"
) -> dict[str, Any]:
    parameters = channel_config(cd_uid, allocation_mode)  # ValueError for a bad mode
    return {
        "apiVersion": api_version(version),
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {LABEL_KEY: cd_uid, TARGET_LABEL_KEY: TARGET_WORKLOAD},
            "finalizers": [FINALIZER],
        },
        "spec": {
            "spec": {
                "devices": {
                    "requests": [device_request(CHANNEL_REQUEST, CHANNEL_DEVICE_CLASS, version)],
                    "config": [
                        {
                            "requests": [CHANNEL_REQUEST],
                            "opaque": {
                                "driver": DRIVER_NAME,
                                "parameters": parameters,
                            },
                        }
                    ],
                }
            }
        },
    }


def owner_uid(rct: dict[str, Any]) -> str | None:
    """The CD uid an RCT was made for (its label), or None if it is not ours."""
    labels = (rct.get("metadata") or {}).get("labels") or {}
    value = labels.get(LABEL_KEY)
    return value if isinstance(value, str) and value else None


# ---- API side ------------------------------------------------------------------------

_CALL_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class EnsureResult:
    # "created" | "exists" | "conflict" (an RCT of that name belongs to another CD or to nobody)
    outcome: str
    other_owner: str | None = None


async def _create_compact(api: ApiClient, namespace: str, body: dict[str, Any], version: str) -> None:
    """POST the RCT as compact JSON (with the YAML content type, as JSON is YAML).

    The API server keeps opaque parameters byte for byte (a RawExtension) and compares them
    byte for byte on every update of the object, which re-encodes them compactly. The
    client's own encoding puts spaces after ':' and ',', and an RCT created that way can
    never be updated again, not even to remove its finalizer ("spec: field is immutable").
    """
    await api.call_api(
        resource_path(version, "resourceclaimtemplates", "{namespace}"),
        "POST",
        path_params={"namespace": namespace},
        header_params={"Content-Type": "application/yaml", "Accept": "application/json"},
        body=json.dumps(body, separators=(",", ":")).encode(),
        response_types_map={},
        auth_settings=["BearerToken"],
        _request_timeout=_CALL_TIMEOUT_S,
    )


async def ensure_template(
    api: ApiClient, cd_uid: str, namespace: str, name: str, allocation_mode: str, version: str = "v1"
) -> EnsureResult:
    resource = typed_api(api, version)
    body = build_rct(cd_uid, namespace, name, allocation_mode, version)
    try:
        await _create_compact(api, namespace, body, version)
        log.info("resource claim template created", cd_uid=cd_uid, namespace=namespace, rct=name)
        return EnsureResult("created")
    except ApiException as exc:
        if exc.status != 409:
            raise
    existing = await resource.read_namespaced_resource_claim_template(
        name, namespace, _request_timeout=_CALL_TIMEOUT_S
    )
    owner = (existing.metadata.labels or {}).get(LABEL_KEY)
    if owner == cd_uid:
        return EnsureResult("exists")
    return EnsureResult("conflict", owner)


async def remove_template(
    api: ApiClient, namespace: str, name: str, cd_uid: str | None = None, version: str = "v1"
) -> bool:
    """Drop our finalizer from an RCT, then delete it; only if labelled `cd_uid` when given.

    Returns False when there was nothing (of that CD) to remove.
    """
    resource = typed_api(api, version)
    try:
        current = await resource.read_namespaced_resource_claim_template(
            name, namespace, _request_timeout=_CALL_TIMEOUT_S
        )
        if cd_uid is not None and (current.metadata.labels or {}).get(LABEL_KEY) != cd_uid:
            return False
        finalizers = [f for f in (current.metadata.finalizers or []) if f != FINALIZER]
        version = current.metadata.resource_version
        if finalizers != (current.metadata.finalizers or []):
            # A JSON patch: finalizers merge (never shrink) under a strategic merge patch.
            patched = await resource.patch_namespaced_resource_claim_template(
                name,
                namespace,
                [
                    {
                        "op": "test",
                        "path": "/metadata/resourceVersion",
                        "value": current.metadata.resource_version,
                    },
                    {"op": "add", "path": "/metadata/finalizers", "value": finalizers},
                ],
                _request_timeout=_CALL_TIMEOUT_S,
            )
            version = patched.metadata.resource_version
        # Only the object read above, as it is now: not a template re-created under the same name.
        await resource.delete_namespaced_resource_claim_template(
            name,
            namespace,
            body=V1DeleteOptions(
                preconditions=V1Preconditions(uid=current.metadata.uid, resource_version=version)
            ),
            _request_timeout=_CALL_TIMEOUT_S,
        )
        log.info("resource claim template removed", cd_uid=cd_uid, namespace=namespace, rct=name)
        return True
    except ApiException as exc:
        if exc.status != 404:
            raise
        return False
