"""Which version of ``resource.k8s.io`` (DRA) the API server serves, and the shapes that differ.

Kubernetes 1.34 and later serve ``v1`` (DRA is GA there). 1.33 serves ``v1beta2`` and ``v1beta1``,
1.32 only ``v1beta1``, and on both only when DRA (beta, off by default) is enabled. Every component
that writes or reads DRA objects discovers the version once, from the group's discovery document
(``GET /apis/resource.k8s.io``), and prefers v1, then v1beta2, then v1beta1.

The shapes differ in two places we use:

- a device request: v1beta1 carries ``deviceClassName`` (and ``allocationMode``/``count``) on the
  request itself; v1beta2 and v1 nest them under ``exactly``;
- a ResourceSlice device: v1beta1 nests ``attributes`` (and ``capacity``) under ``basic``; v1beta2
  and v1 put them on the device.

ResourceClaim allocations (``status.allocation.devices.results``/``config``) and DeviceClasses have
the same shape in all three.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import structlog

log = structlog.get_logger(__name__)

GROUP = "resource.k8s.io"
# Most preferred first.
VERSIONS = ("v1", "v1beta2", "v1beta1")
DISCOVERY_TIMEOUT_S = 10.0


class ResourceApiUnavailable(RuntimeError):
    """The API server serves none of the resource.k8s.io versions we speak."""


def check_version(version: str) -> str:
    """`version` if it is one we speak; ValueError naming the problem otherwise."""
    if version not in VERSIONS:
        raise ValueError(
            f"resource.k8s.io version {version!r} is not supported (one of {', '.join(VERSIONS)})"
        )
    return version


def api_version(version: str) -> str:
    """The apiVersion field of an object: ``resource.k8s.io/<version>``."""
    return f"{GROUP}/{check_version(version)}"


def choose_version(discovery: Any) -> str:
    """The preferred version we speak among those an APIGroup discovery document lists."""
    served: list[str] = []
    if isinstance(discovery, Mapping):
        for entry in discovery.get("versions") or ():
            if isinstance(entry, Mapping) and isinstance(entry.get("version"), str):
                served.append(entry["version"])
    for version in VERSIONS:
        if version in served:
            return version
    listed = ", ".join(served) or "none"
    raise ResourceApiUnavailable(
        f"the API server serves resource.k8s.io versions [{listed}], none of {', '.join(VERSIONS)}; "
        "on Kubernetes 1.32 and 1.33 enable the DynamicResourceAllocation feature gate and "
        "--runtime-config=resource.k8s.io/v1beta1=true"
    )


def resource_path(version: str, plural: str, namespace: str = "", name: str = "") -> str:
    """The REST path of a collection or object, e.g. /apis/resource.k8s.io/v1/resourceslices/x."""
    path = f"/apis/{GROUP}/{check_version(version)}"
    if namespace:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    if name:
        path += f"/{name}"
    return path


# ---- shapes -------------------------------------------------------------------------------


def device_request(name: str, device_class: str, version: str) -> dict[str, Any]:
    """A request for exactly one device of `device_class`."""
    if check_version(version) == "v1beta1":
        return {"name": name, "deviceClassName": device_class}
    return {"name": name, "exactly": {"deviceClassName": device_class}}


def request_device_class(request: Mapping[str, Any]) -> str:
    """The device class of a request in either shape ("" when it names none)."""
    exactly = request.get("exactly")
    if isinstance(exactly, Mapping):
        return str(exactly.get("deviceClassName") or "")
    return str(request.get("deviceClassName") or "")


def slice_device(name: str, attributes: Mapping[str, Any], version: str) -> dict[str, Any]:
    """One ResourceSlice device with `attributes` (already in the API's value shape)."""
    if check_version(version) == "v1beta1":
        return {"name": name, "basic": {"attributes": dict(attributes)}}
    return {"name": name, "attributes": dict(attributes)}


def device_attributes(device: Mapping[str, Any]) -> Mapping[str, Any]:
    """A slice device's attributes in either shape (empty when it has none)."""
    basic = device.get("basic")
    source = basic if isinstance(basic, Mapping) else device
    attributes = source.get("attributes")
    return attributes if isinstance(attributes, Mapping) else {}


def typed_api(api_client: Any, version: str) -> Any:
    """kubernetes-asyncio's typed client of that version (the method names are the same in all)."""
    from kubernetes_asyncio import client

    classes = {
        "v1": client.ResourceV1Api,
        "v1beta2": client.ResourceV1beta2Api,
        "v1beta1": client.ResourceV1beta1Api,
    }
    return classes[check_version(version)](api_client)


# ---- discovery ----------------------------------------------------------------------------


async def discover_version(api_client: Any, timeout_s: float = DISCOVERY_TIMEOUT_S) -> str:
    """GET /apis/resource.k8s.io and choose. Raises ResourceApiUnavailable when the group is not
    served (HTTP 404) or lists no version we speak; the client's errors (ApiException, OSError,
    TimeoutError) pass through for the caller to retry."""
    from kubernetes_asyncio.client.exceptions import ApiException

    try:
        async with asyncio.timeout(timeout_s):
            response: Any = await api_client.call_api(
                f"/apis/{GROUP}",
                "GET",
                header_params={"Accept": "application/json"},
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=timeout_s,
            )
            resp = response[0] if isinstance(response, tuple) else response
            try:
                status, body = resp.status, await resp.read()
            finally:
                resp.release()
    except ApiException as exc:
        if exc.status != 404:
            raise
        status, body = 404, b""
    if status == 404:
        raise ResourceApiUnavailable(
            "the API server does not serve resource.k8s.io (DRA); on Kubernetes 1.32 and 1.33 enable the "
            "DynamicResourceAllocation feature gate and --runtime-config=resource.k8s.io/v1beta1=true"
        )
    if status != 200:
        raise ApiException(
            status=status, reason=f"discovery of {GROUP}: {body.decode(errors='replace')[:200]}"
        )
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise ResourceApiUnavailable(f"undecodable discovery document for {GROUP}: {exc}") from None
    return choose_version(document)


class ServedVersion:
    """The version to use with one API server: `fixed` when configured, else discovered on first
    use and remembered (the served versions change only with an API server upgrade, after which
    our pods restart too). A failed discovery is not remembered: the caller retries."""

    def __init__(self, api_client: Any, fixed: str = "", timeout_s: float = DISCOVERY_TIMEOUT_S) -> None:
        self.api_client = api_client
        self.timeout_s = timeout_s
        self._version = check_version(fixed) if fixed else ""
        self._lock = asyncio.Lock()

    @property
    def known(self) -> str:
        """The version if already known, else ""."""
        return self._version

    async def get(self) -> str:
        if self._version:
            return self._version
        async with self._lock:
            if not self._version:
                self._version = await discover_version(self.api_client, self.timeout_s)
                log.info("resource_api_version_discovered", group=GROUP, version=self._version)
        return self._version
