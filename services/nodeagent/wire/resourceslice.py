"""Kubernetes mode: this node's ResourceSlice and its clique label.

The scheduler allocates our channel device from a `resource.k8s.io` ResourceSlice per node (v1, or
v1beta2/v1beta1 on Kubernetes 1.32-1.33: the version is discovered from the API server first):
driver ``compute-domain.nvidia.com``, pool = node name, one device ``channel-0`` with attributes
``type`` ("channel"), ``id`` (0) and ``cliqueID`` (the node's clique, "" on a non-fabric node),
so the DeviceClass CEL selector and clique-aware selectors both match. The slice is published once
the node's clique is settled, rewritten when it changes (with the pool generation bumped), and
deleted on shutdown only when configured. It is watched, and published again whenever someone else
deletes or changes it: kubelet deletes every ResourceSlice of its node when it starts (its DRA
manager's wipe, as no driver has registered yet), so without this a kubelet restart would leave
the node with no channel device to allocate until the agent restarted. Optionally the Node gets the label
``nvidia.com/gpu.clique=<clusterUUID>.<cliqueId>`` (removed on a non-fabric node).

Pure core: `build_resource_slice`, `slice_content`, `clique_label_patch`. Thin shell:
`ResourceSlicePublisher` over kubernetes-asyncio's typed ``ResourceV1*Api``/``CoreV1Api``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio import watch as k8s_watch
from kubernetes_asyncio.client import ApiClient, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from libs.contract.names import CHANNEL_DEVICE, DRIVER_NAME
from libs.gen.computedomain.state import v1 as pb
from libs.kube.resource_api import (
    ResourceApiUnavailable,
    ServedVersion,
    api_version,
    device_attributes,
    slice_device,
    typed_api,
)
from libs.runtime.backoff import Backoff
from libs.state.node_record import clique_settled

log = structlog.get_logger(__name__)

CLIQUE_LABEL = "nvidia.com/gpu.clique"
FIELD_MANAGER = "compute-domain-node-agent"
_MAX_NAME = 253  # a ResourceSlice name is a DNS subdomain
# Server-side end of each watch of our slice; the next watch starts with a fresh check.
_WATCH_ERRORS = (ApiException, aiohttp.ClientError, OSError, TimeoutError, ResourceApiUnavailable)


@dataclass(frozen=True)
class ResourceSliceSettings:
    # Maintain the nvidia.com/gpu.clique node label.
    publish_clique_label: bool = False
    # Delete the ResourceSlice when the agent stops (off by default: a restarting agent should
    # not make its node briefly unschedulable for CD pods).
    delete_on_shutdown: bool = False
    request_timeout_s: float = 10.0
    retry_initial_s: float = 0.2
    retry_cap_s: float = 10.0
    # resource.k8s.io version to write ("" = discover the API server's preferred one).
    resource_api_version: str = ""
    # How long one watch of the slice lasts before the server ends it and it is resumed.
    watch_timeout_s: int = 300


def resource_slice_name(node_name: str) -> str:
    """``<node>-compute-domain.nvidia.com``, shortened with a hash if that is too long."""
    name = f"{node_name}-{DRIVER_NAME}"
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(node_name.encode()).hexdigest()[:10]
    keep = _MAX_NAME - len(DRIVER_NAME) - len(digest) - 2
    return f"{node_name[:keep].rstrip('.-')}-{digest}-{DRIVER_NAME}"


def slice_content(node_name: str, clique_id: str) -> dict[str, Any]:
    """The parts of the slice spec that we own (compared to decide whether to rewrite)."""
    return {
        "driver": DRIVER_NAME,
        "nodeName": node_name,
        "pool": node_name,
        "devices": [
            {
                "name": CHANNEL_DEVICE,
                "attributes": {
                    "type": {"string": "channel"},
                    "id": {"int": 0},
                    "cliqueID": {"string": clique_id},
                },
            }
        ],
    }


def build_resource_slice(
    node_name: str,
    clique_id: str,
    generation: int = 1,
    node_uid: str = "",
    resource_version: str = "",
    version: str = "v1",
) -> dict[str, Any]:
    """The ResourceSlice object (JSON shape of resource.k8s.io/`version`) for this node."""
    content = slice_content(node_name, clique_id)
    metadata: dict[str, Any] = {
        "name": resource_slice_name(node_name),
        "labels": {"app.kubernetes.io/managed-by": FIELD_MANAGER},
    }
    if node_uid:
        # Owned by the Node: deleting the Node garbage-collects its slice.
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}
        ]
    if resource_version:
        metadata["resourceVersion"] = resource_version
    return {
        "apiVersion": api_version(version),
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": content["driver"],
            "nodeName": content["nodeName"],
            "pool": {"name": content["pool"], "generation": generation, "resourceSliceCount": 1},
            "devices": [slice_device(d["name"], d["attributes"], version) for d in content["devices"]],
        },
    }


def live_slice_content(obj: dict[str, Any]) -> dict[str, Any]:
    """`slice_content` read back from a slice as the apiserver returns it (JSON shape, any version)."""
    spec = obj.get("spec") or {}
    devices = []
    for device in spec.get("devices") or []:
        attributes = {
            name: {k: v for k, v in (value or {}).items() if v is not None}
            for name, value in device_attributes(device).items()
        }
        devices.append({"name": device.get("name"), "attributes": attributes})
    return {
        "driver": spec.get("driver"),
        "nodeName": spec.get("nodeName"),
        "pool": (spec.get("pool") or {}).get("name"),
        "devices": devices,
    }


def clique_label_patch(clique_id: str) -> dict[str, Any]:
    """Strategic-merge patch of the Node: set the clique label, or remove it ("" clique)."""
    return {"metadata": {"labels": {CLIQUE_LABEL: clique_id or None}}}


class ResourceSlicePublisher:
    """Keeps this node's ResourceSlice (and optionally its clique label) in step with the node record."""

    def __init__(self, api: ApiClient, node_name: str, settings: ResourceSliceSettings) -> None:
        self.api = api
        self.node_name = node_name
        self.settings = settings
        self.served = ServedVersion(api, settings.resource_api_version, settings.request_timeout_s)
        self.core: Any = CoreV1Api(api)
        self.name = resource_slice_name(node_name)
        self.published_clique: str | None = None
        self.labelled_clique: str | None = None
        # Bumped whenever the slice may be gone; a publish from an older epoch is done again.
        self._epoch = 0
        self._published_epoch = 0

    async def run(self, nodes: AsyncIterator[pb.Node]) -> None:
        """Publish for every settled record `nodes` yields (``NodeView.changes()``)."""
        latest: pb.Node | None = None
        wake = asyncio.Event()

        async def follow() -> None:
            nonlocal latest
            async for node in nodes:
                latest = node
                wake.set()

        def republish() -> None:
            self._epoch += 1
            wake.set()

        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(follow(), name=f"resourceslice-follow-{self.node_name}")
                tasks.create_task(self.watch(republish), name=f"resourceslice-watch-{self.node_name}")
                backoff = Backoff(initial=self.settings.retry_initial_s, cap=self.settings.retry_cap_s)
                while True:
                    await wake.wait()
                    wake.clear()
                    node = latest
                    if node is None or not clique_settled(node):
                        continue
                    try:
                        await self.sync(node.clique_id)
                        backoff.reset()
                    except (ApiException, OSError, TimeoutError, ResourceApiUnavailable) as exc:
                        delay = backoff.next_delay()
                        log.warning(
                            "publishing ResourceSlice failed; retrying",
                            node=self.node_name,
                            error=_describe(exc),
                            retry_in_s=round(delay, 3),
                        )
                        await asyncio.sleep(delay)
                        wake.set()
        finally:
            if self.settings.delete_on_shutdown:
                try:
                    await asyncio.shield(self.delete())
                except Exception as exc:
                    log.warning("deleting ResourceSlice failed", node=self.node_name, error=_describe(exc))

    async def watch(self, republish: Callable[[], None]) -> None:
        """Watch our slice; call `republish` whenever the slice is deleted or changed away from
        what we published, and when a watch starts without knowing what happened since the last
        one: the first, one after an error, or one the server refused because it no longer has
        our resourceVersion (410 Gone). A watch the server ended at its timeout resumes at the
        last resourceVersion seen (bookmarks keep it recent), as client-go's reflector does, so
        the periodic reopen costs no read of the slice."""
        backoff = Backoff(initial=self.settings.retry_initial_s, cap=self.settings.retry_cap_s)
        resume: str | None = None
        while True:
            try:
                _, resource = await self._resource()
                async with k8s_watch.Watch() as w:
                    since = {"resource_version": resume} if resume else {}
                    stream = w.stream(
                        resource.list_resource_slice,
                        field_selector=f"metadata.name={self.name}",
                        allow_watch_bookmarks=True,
                        timeout_seconds=self.settings.watch_timeout_s,
                        _request_timeout=self.settings.watch_timeout_s + 30,
                        **since,
                    )
                    if resume is None:
                        republish()
                    async for event in stream:
                        backoff.reset()
                        if self._lost_by(event["type"], event.get("raw_object") or {}):
                            log.info(
                                "ResourceSlice deleted or changed by someone else; publishing it again",
                                node=self.node_name,
                                change=event["type"],
                            )
                            republish()
                    resume = w.resource_version
            except ApiException as exc:
                resume = None
                if exc.status == 410:  # our resourceVersion is compacted away: start over
                    log.info("ResourceSlice watch expired; watching afresh", node=self.node_name)
                    continue
                await self._watch_failed(backoff, exc)
            except _WATCH_ERRORS as exc:
                resume = None
                await self._watch_failed(backoff, exc)

    async def _watch_failed(self, backoff: Backoff, exc: BaseException) -> None:
        delay = backoff.next_delay()
        log.warning(
            "watching ResourceSlice failed; retrying",
            node=self.node_name,
            error=_describe(exc),
            retry_in_s=round(delay, 3),
        )
        await asyncio.sleep(delay)

    def _lost_by(self, change: str, obj: dict[str, Any]) -> bool:
        """Whether a watch event shows our published slice gone or not ours any more."""
        if self.published_clique is None:
            return False  # nothing published yet
        if change == "DELETED":
            return True
        if change in ("ADDED", "MODIFIED"):
            return live_slice_content(obj) != slice_content(self.node_name, self.published_clique)
        return False

    async def sync(self, clique_id: str) -> None:
        """Make the slice (and label) say `clique_id`; no write when it already does."""
        if self.published_clique != clique_id or self._published_epoch != self._epoch:
            epoch = self._epoch
            await self._sync_slice(clique_id)
            self.published_clique, self._published_epoch = clique_id, epoch
        if self.settings.publish_clique_label and self.labelled_clique != clique_id:
            await self.core.patch_node(
                self.node_name,
                clique_label_patch(clique_id),
                field_manager=FIELD_MANAGER,
                _request_timeout=self.settings.request_timeout_s,
            )
            self.labelled_clique = clique_id
            log.info("node clique label set", node=self.node_name, clique=clique_id or None)

    async def _resource(self) -> tuple[str, Any]:
        """The served version and kubernetes-asyncio's typed client of it. Typed as Any: the client
        accepts plain JSON-shaped dicts as bodies at run time, and building the objects as dicts
        keeps the exact field names of each version in view."""
        version = await self.served.get()
        return version, typed_api(self.api, version)

    async def _sync_slice(self, clique_id: str) -> None:
        timeout = self.settings.request_timeout_s
        version, resource = await self._resource()
        for _ in range(10):  # conflicts only: a concurrent writer changed the slice
            current = await self._read_slice(resource)
            if current is None:
                body = build_resource_slice(
                    self.node_name, clique_id, 1, await self._node_uid(), version=version
                )
                try:
                    await resource.create_resource_slice(
                        body, field_manager=FIELD_MANAGER, _request_timeout=timeout
                    )
                except ApiException as exc:
                    if exc.status == 409:
                        continue
                    raise
                log.info("ResourceSlice created", node=self.node_name, clique=clique_id, name=self.name)
                return
            if live_slice_content(current) == slice_content(self.node_name, clique_id):
                return
            meta = current.get("metadata") or {}
            generation = int(((current.get("spec") or {}).get("pool") or {}).get("generation") or 0) + 1
            owners = meta.get("ownerReferences") or []
            node_uid = next((o.get("uid", "") for o in owners if o.get("kind") == "Node"), "")
            body = build_resource_slice(
                self.node_name, clique_id, generation, node_uid, meta.get("resourceVersion", ""), version
            )
            try:
                await resource.replace_resource_slice(
                    self.name, body, field_manager=FIELD_MANAGER, _request_timeout=timeout
                )
            except ApiException as exc:
                if exc.status in (404, 409):
                    continue
                raise
            log.info("ResourceSlice updated", node=self.node_name, clique=clique_id, generation=generation)
            return
        raise TimeoutError(f"ResourceSlice {self.name} kept changing under concurrent writers")

    async def _read_slice(self, resource: Any) -> dict[str, Any] | None:
        try:
            obj = await resource.read_resource_slice(
                self.name, _request_timeout=self.settings.request_timeout_s
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        result: dict[str, Any] = self.api.sanitize_for_serialization(obj)
        return result

    async def _node_uid(self) -> str:
        try:
            node = await self.core.read_node(self.node_name, _request_timeout=self.settings.request_timeout_s)
        except ApiException as exc:
            if exc.status == 404:
                log.warning(
                    "Node object not found; ResourceSlice published without owner", node=self.node_name
                )
                return ""
            raise
        return str(node.metadata.uid or "")

    async def delete(self) -> None:
        try:
            async with asyncio.timeout(self.settings.request_timeout_s):
                # The answer is not needed (and not always a ResourceSlice): leave it undecoded.
                _, resource = await self._resource()
                response = await resource.delete_resource_slice(
                    self.name, _request_timeout=self.settings.request_timeout_s, _preload_content=False
                )
                response.release()
        except ApiException as exc:
            if exc.status != 404:
                raise
        self.published_clique = None
        log.info("ResourceSlice deleted", node=self.node_name, name=self.name)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status}: {exc.reason}"
    return str(exc) or type(exc).__name__
