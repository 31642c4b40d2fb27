"""Async helpers of the end-to-end tests: objects as plain JSON, polling with bounded waits."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from kubernetes_asyncio.client import ApiClient, BatchV1Api, CoreV1Api, CustomObjectsApi
from kubernetes_asyncio.client.exceptions import ApiException

from libs.kube.resource_api import device_request, discover_version, resource_path, typed_api
from tests import polling
from tests.e2e.harness import DEVICE_CLASS

T = TypeVar("T")

GROUP, VERSION, PLURAL = "resource.nvidia.com", "v1beta1", "computedomains"
# Generous: other test sessions share the two cores; every wait is still bounded.
WAIT_S = 90.0


async def eventually(
    probe: Callable[[], Awaitable[T | None]],
    what: str,
    timeout_s: float = WAIT_S,
    explain: Callable[[], str] = str,
) -> T:
    """tests/polling.eventually for probes that call the API server: an ApiException (the server
    restarting, a 409 of a racing write) counts as "not yet", and the last one is reported."""
    last_error = ""

    async def tolerant() -> T | None:
        nonlocal last_error
        try:
            return await probe()
        except ApiException as exc:
            last_error = f"HTTP {exc.status}: {exc.reason}"
            return None

    def explanation() -> str:
        detail = f"(last API error: {last_error})\n" if last_error else ""
        return detail + explain()

    return await polling.eventually(
        tolerant, what, timeout_s, explain=explanation, first_delay_s=0.1, max_delay_s=1.0
    )


async def raw_get(api: ApiClient, path: str) -> dict[str, Any] | None:
    """GET an API path as JSON; None on 404."""
    try:
        response = await api.call_api(
            path,
            "GET",
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=15,
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    resp = response[0] if isinstance(response, tuple) else response
    try:
        status, body = resp.status, await resp.read()
    finally:
        resp.release()
    if status == 404:
        return None
    if status != 200:
        raise ApiException(status=status, reason=body.decode(errors="replace")[:300])
    result: dict[str, Any] = json.loads(body)
    return result


async def get_cd(api: ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    return await raw_get(api, f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}")


async def create_cd(api: ApiClient, cd: dict[str, Any]) -> dict[str, Any]:
    created: dict[str, Any] = await CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, cd["metadata"]["namespace"], PLURAL, cd
    )
    return created


async def delete_cd(api: ApiClient, namespace: str, name: str) -> None:
    try:
        await CustomObjectsApi(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except ApiException as exc:
        if exc.status != 404:
            raise


async def list_pods(api: ApiClient, namespace: str, selector: str = "") -> list[dict[str, Any]]:
    query = f"?labelSelector={selector}" if selector else ""
    listing = await raw_get(api, f"/api/v1/namespaces/{namespace}/pods{query}")
    return list((listing or {}).get("items") or [])


# API server URL -> the resource.k8s.io version it serves (v1 on 1.34+, v1beta1 on 1.32).
_served: dict[str, str] = {}


async def resource_api(api: ApiClient) -> str:
    """The resource.k8s.io version this API server serves (asked once per server)."""
    host = str(api.configuration.host)
    if host not in _served:
        _served[host] = await discover_version(api)
    return _served[host]


async def list_claims(api: ApiClient, namespace: str) -> list[dict[str, Any]]:
    listing = await raw_get(api, resource_path(await resource_api(api), "resourceclaims", namespace))
    return list((listing or {}).get("items") or [])


async def get_claim(api: ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    return await raw_get(api, resource_path(await resource_api(api), "resourceclaims", namespace, name))


async def get_template(api: ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    return await raw_get(
        api, resource_path(await resource_api(api), "resourceclaimtemplates", namespace, name)
    )


async def node_labels(api: ApiClient) -> dict[str, dict[str, str]]:
    listing = await raw_get(api, "/api/v1/nodes")
    return {
        n["metadata"]["name"]: dict(n["metadata"].get("labels") or {})
        for n in (listing or {}).get("items", [])
    }


async def pod_events(api: ApiClient, namespace: str, pod: str) -> list[dict[str, Any]]:
    return await object_events(api, namespace, "Pod", pod)


async def object_events(api: ApiClient, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
    """The Events of one object, oldest first."""
    listing = await raw_get(
        api,
        f"/api/v1/namespaces/{namespace}/events?fieldSelector=involvedObject.kind={kind},involvedObject.name={name}",
    )
    return sorted((listing or {}).get("items") or [], key=lambda e: e.get("lastTimestamp") or "")


def is_running(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    return status.get("phase") == "Running" and ready


def indexed_job(
    name: str, namespace: str, template: str, pods: int, size_hint: int | None = None
) -> dict[str, Any]:
    """An Indexed Job of `pods` pods, each claiming the CD's channel through the CD's template."""
    annotations = {"resource.nvidia.com/computeDomainSize": str(size_hint)} if size_hint else {}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "completionMode": "Indexed",
            "completions": pods,
            "parallelism": pods,
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {"e2e-job": name}, "annotations": annotations},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "worker",
                            "image": "ubuntu:22.04",
                            "command": [
                                "bash",
                                "-c",
                                "ls -la /dev/nvidia-caps-imex-channels; sleep infinity",
                            ],
                            "resources": {"claims": [{"name": "imex-channel"}]},
                        }
                    ],
                    "resourceClaims": [{"name": "imex-channel", "resourceClaimTemplateName": template}],
                },
            },
        },
    }


async def create_job(api: ApiClient, job: dict[str, Any]) -> None:
    # The client sends plain dicts as they are.
    await BatchV1Api(api).create_namespaced_job(job["metadata"]["namespace"], cast(Any, job))


async def delete_job(api: ApiClient, namespace: str, name: str) -> None:
    await BatchV1Api(api).delete_namespaced_job(name, namespace, propagation_policy="Background")


def channel_claim(name: str, namespace: str, domain_uid: str, version: str = "v1") -> dict[str, Any]:
    """A ResourceClaim for our channel whose opaque config names the domain `domain_uid` directly."""
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "devices": {
                "requests": [device_request("channel", DEVICE_CLASS, version)],
                "config": [
                    {
                        "requests": ["channel"],
                        "opaque": {
                            "driver": "compute-domain.nvidia.com",
                            "parameters": {
                                "apiVersion": "resource.nvidia.com/v1beta1",
                                "kind": "ComputeDomainChannelConfig",
                                "domainID": domain_uid,
                                "allocationMode": "Single",
                            },
                        },
                    }
                ],
            }
        },
    }


def pod_with_claim(name: str, namespace: str, claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "ubuntu:22.04",
                    "resources": {"claims": [{"name": "imex-channel"}]},
                }
            ],
            "resourceClaims": [{"name": "imex-channel", "resourceClaimName": claim}],
        },
    }


async def delete_pod(api: ApiClient, namespace: str, name: str) -> None:
    try:
        await CoreV1Api(api).delete_namespaced_pod(name, namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise


async def delete_claim(api: ApiClient, namespace: str, name: str) -> None:
    try:
        await typed_api(api, await resource_api(api)).delete_namespaced_resource_claim(name, namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
