"""The kubelet of one simulated node: Node and Lease, plugin registration, pod sync.

Per node: the Node object is created (or its labels refreshed) and its status posted Ready; the
Lease in ``kube-node-lease`` is renewed and the Ready condition re-posted periodically. Pods bound
to the node are followed with a list + watch (field selector ``spec.nodeName``), each by a
`PodWorker`:

- a live pod: its ResourceClaims are read (allocated and reserved for the pod, else wait), the
  claims with devices of our driver go to the plugin's ``NodePrepareResources`` in one call; a
  per-claim error becomes a ``FailedPrepareDynamicResources`` Warning Event on the pod and the
  sync is retried with capped backoff, as kubelet does; once prepared the pod is marked Running;
- a pod being deleted (or deleted outright): its claims are unprepared (retried until the plugin
  agrees), then the pod is removed (grace period 0, preconditioned on its UID).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import structlog
from kubernetes_asyncio.client import ApiClient, CoordinationV1Api, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from libs.kube.resource_api import typed_api
from libs.runtime.backoff import Backoff
from tools.sim.kubeletshim import plugin
from tools.sim.kubeletshim.api_json import TRANSPORT_ERRORS, read_json, watch_events
from tools.sim.kubeletshim.nodes import ShimNode
from tools.sim.kubeletshim.objects import (
    FAILED_PREPARE_REASON,
    NODE_LEASE_NAMESPACE,
    node_lease,
    node_object,
    node_status,
    pod_event,
    ready_condition,
    running_pod_status,
    timestamp,
)
from tools.sim.kubeletshim.pods import (
    ClaimRef,
    NotReadyYet,
    PodKey,
    allocated_to_driver,
    claim_for_driver,
    claim_names,
    is_finished,
    is_running,
    is_terminating,
    pod_key,
)
from tools.sim.kubeletshim.release import KubeletRelease
from tools.sim.kubeletshim.settings import ShimSettings

log = structlog.get_logger(__name__)

API_ERRORS: tuple[type[BaseException], ...] = (ApiException, *TRANSPORT_ERRORS)
_REGISTRATION_ERRORS: tuple[type[BaseException], ...] = (plugin.RegistrationRejected, *plugin.CALL_ERRORS)


def _now() -> datetime:
    return datetime.now(UTC)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status}: {exc.reason}"
    return str(exc) or type(exc).__name__


class PrepareFailed(Exception):
    """NodePrepareResources failed for at least one claim (already reported as a pod Event)."""


class NodeKubelet:
    """Everything kubelet does for one node, as far as the control plane and our plugin can tell."""

    def __init__(
        self, node: ShimNode, api: ApiClient, settings: ShimSettings, release: KubeletRelease | None = None
    ) -> None:
        self.node = node
        self.settings = settings
        # The control plane's release: kubeletVersion, the claims' API version, the DRA service.
        self.release = release or KubeletRelease()
        # Typed as Any: bodies are JSON-shaped dicts (exact API field names), which the client
        # accepts at run time although its stubs ask for model classes.
        self.core: Any = CoreV1Api(api)
        self.coordination: Any = CoordinationV1Api(api)
        self.resource: Any = typed_api(api, self.release.resource_api)
        self.node_uid = ""
        self.ready_since = _now()
        self.plugin_info: plugin.PluginInfo | None = None
        self._register_lock = asyncio.Lock()
        self.workers: dict[str, PodWorker] = {}
        self.log = log.bind(node=node.name)

    @property
    def timeout(self) -> float:
        return self.settings.api_timeout_s

    async def run(self) -> None:
        self.workers.clear()  # a restart after a failure: the old workers went with their task group
        await self._until_done("register node", self.ensure_node)
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._heartbeat(), name=f"heartbeat-{self.node.name}")
            tasks.create_task(self._register_at_start(), name=f"register-{self.node.name}")
            tasks.create_task(self._follow_pods(tasks), name=f"pods-{self.node.name}")

    async def _until_done(self, what: str, action: Callable[[], Awaitable[None]]) -> None:
        backoff = Backoff(initial=self.settings.retry_initial_s, cap=self.settings.retry_cap_s)
        while True:
            try:
                await action()
                return
            except API_ERRORS as exc:
                delay = backoff.next_delay()
                self.log.warning(f"{what} failed; retrying", error=_describe(exc), retry_in_s=round(delay, 2))
                await asyncio.sleep(delay)

    # ---- Node and Lease -------------------------------------------------------------------

    async def ensure_node(self) -> None:
        name = self.node.name
        try:
            created = await read_json(
                self.core.create_node(
                    node_object(self.node), _preload_content=False, _request_timeout=self.timeout
                )
            )
        except ApiException as exc:
            if exc.status != 409:
                raise
            # Registered before (shim restart): refresh our labels, keep everyone else's.
            created = await read_json(
                self.core.patch_node(
                    name,
                    {"metadata": {"labels": self.node.all_labels}},
                    _preload_content=False,
                    _request_timeout=self.timeout,
                )
            )
        self.node_uid = str(created["metadata"]["uid"])
        await self.post_status()
        self.log.info("node registered", node_uid=self.node_uid, address=self.node.address or None)

    async def post_status(self) -> None:
        await read_json(
            self.core.patch_node_status(
                self.node.name,
                {"status": node_status(self.node, _now(), self.ready_since, self.release.kubelet_version)},
                _preload_content=False,
                _request_timeout=self.timeout,
            )
        )

    async def renew_lease(self) -> None:
        body = node_lease(self.node.name, self.node_uid, _now(), self.settings.lease_duration_s)
        try:
            await read_json(
                self.coordination.patch_namespaced_lease(
                    self.node.name,
                    NODE_LEASE_NAMESPACE,
                    {"spec": body["spec"]},
                    _preload_content=False,
                    _request_timeout=self.timeout,
                )
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            await read_json(
                self.coordination.create_namespaced_lease(
                    NODE_LEASE_NAMESPACE, body, _preload_content=False, _request_timeout=self.timeout
                )
            )

    async def _heartbeat(self) -> None:
        loop = asyncio.get_running_loop()
        next_status = loop.time() + self.settings.status_report_interval_s
        while True:
            try:
                await self.renew_lease()
                if loop.time() >= next_status:
                    await read_json(
                        self.core.patch_node_status(
                            self.node.name,
                            {"status": {"conditions": [ready_condition(_now(), self.ready_since)]}},
                            _preload_content=False,
                            _request_timeout=self.timeout,
                        )
                    )
                    next_status = loop.time() + self.settings.status_report_interval_s
            except API_ERRORS as exc:
                self.log.warning("node heartbeat failed", error=_describe(exc))
            await asyncio.sleep(self.settings.lease_renew_interval_s)

    # ---- the plugin ------------------------------------------------------------------------

    async def plugin_endpoint(self) -> plugin.PluginInfo:
        """The registered plugin (DRA socket, chosen service), registering first if needed (raises
        plugin.CALL_ERRORS or RegistrationRejected)."""
        async with self._register_lock:
            if self.plugin_info is None:
                self.plugin_info = await plugin.register(
                    self.node.kubelet_dir, self.settings.driver, self.release.dra_services
                )
                self.log.info(
                    "DRA plugin registered",
                    driver=self.plugin_info.name,
                    endpoint=str(self.plugin_info.endpoint),
                    versions=list(self.plugin_info.versions),
                    service=self.plugin_info.service,
                )
            return self.plugin_info

    async def _register_at_start(self) -> None:
        """Register as soon as the plugin's socket answers (kubelet's plugin watcher would)."""
        backoff = Backoff(initial=0.2, cap=self.settings.retry_cap_s)
        while True:
            try:
                await self.plugin_endpoint()
                return
            except plugin.RegistrationRejected as exc:
                self.log.error("DRA plugin registration rejected", error=str(exc))
            except plugin.CALL_ERRORS as exc:
                self.log.debug("DRA plugin not answering yet", error=plugin.describe_call_error(exc))
            await asyncio.sleep(backoff.next_delay())

    def _not_registered(self, exc: BaseException) -> str:
        if isinstance(exc, plugin.RegistrationRejected):
            return f"DRA driver {self.settings.driver} failed registration: {exc}"
        return (
            f"DRA driver {self.settings.driver} is not registered on this node "
            f"({plugin.describe_call_error(exc)})"
        )

    async def prepare(self, refs: list[ClaimRef]) -> dict[str, plugin.PrepareAnswer]:
        """Per claim uid the plugin's answer; a failed call is every claim's error."""
        try:
            info = await self.plugin_endpoint()
        except _REGISTRATION_ERRORS as exc:
            return {r.uid: plugin.PrepareAnswer(self._not_registered(exc)) for r in refs}
        try:
            return await plugin.prepare(info.endpoint, refs, self.settings.call_timeout_s, info.service)
        except plugin.CALL_ERRORS as exc:
            self.plugin_info = None  # the plugin may have restarted: register again next time
            message = f"NodePrepareResources call failed: {plugin.describe_call_error(exc)}"
            return {r.uid: plugin.PrepareAnswer(message) for r in refs}

    async def unprepare(self, refs: list[ClaimRef]) -> dict[str, str]:
        try:
            info = await self.plugin_endpoint()
        except _REGISTRATION_ERRORS as exc:
            return {r.uid: self._not_registered(exc) for r in refs}
        try:
            return await plugin.unprepare(info.endpoint, refs, self.settings.call_timeout_s, info.service)
        except plugin.CALL_ERRORS as exc:
            self.plugin_info = None
            message = f"NodeUnprepareResources call failed: {plugin.describe_call_error(exc)}"
            return {r.uid: message for r in refs}

    # ---- pods ------------------------------------------------------------------------------

    async def _follow_pods(self, tasks: asyncio.TaskGroup) -> None:
        selector = f"spec.nodeName={self.node.name}"
        backoff = Backoff(initial=self.settings.retry_initial_s, cap=self.settings.retry_cap_s)
        resource_version = ""
        while True:
            try:
                if not resource_version:
                    resource_version = await self._list_pods(selector, tasks)
                stream = watch_events(
                    self.core.list_pod_for_all_namespaces(
                        field_selector=selector,
                        watch=True,
                        resource_version=resource_version,
                        allow_watch_bookmarks=True,
                        timeout_seconds=self.settings.watch_timeout_s,
                        _preload_content=False,
                        _request_timeout=self.settings.watch_timeout_s + 30,
                    )
                )
                async for event in stream:
                    obj = event.get("object") or {}
                    resource_version = str(
                        (obj.get("metadata") or {}).get("resourceVersion") or resource_version
                    )
                    if event.get("type") != "BOOKMARK":
                        self._observe(str(event.get("type")), obj, tasks)
                backoff.reset()
            except ApiException as exc:
                if exc.status == 410:
                    self.log.info("pod watch expired; listing again")
                    resource_version = ""
                    continue
                delay = backoff.next_delay()
                self.log.warning("pod watch failed", error=_describe(exc), retry_in_s=round(delay, 2))
                await asyncio.sleep(delay)
            except TRANSPORT_ERRORS as exc:
                delay = backoff.next_delay()
                self.log.warning("pod watch broke", error=_describe(exc), retry_in_s=round(delay, 2))
                await asyncio.sleep(delay)

    async def _list_pods(self, selector: str, tasks: asyncio.TaskGroup) -> str:
        listing = await read_json(
            self.core.list_pod_for_all_namespaces(
                field_selector=selector, _preload_content=False, _request_timeout=self.timeout
            )
        )
        seen = set()
        for pod in listing.get("items") or []:
            seen.add(pod_key(pod).uid)
            self._observe("ADDED", pod, tasks)
        for uid, worker in list(self.workers.items()):
            if uid not in seen:
                worker.gone()  # deleted while the watch was down
        return str(listing["metadata"]["resourceVersion"])

    def _observe(self, kind: str, pod: dict[str, Any], tasks: asyncio.TaskGroup) -> None:
        key = pod_key(pod)
        worker = self.workers.get(key.uid)
        if kind == "DELETED":
            if worker is not None:
                worker.gone()
            return
        if worker is None:
            worker = self.workers[key.uid] = PodWorker(self, pod)
            tasks.create_task(worker.run(), name=f"pod-{key}")
        else:
            worker.update(pod)

    async def record_event(
        self, pod: dict[str, Any], reason: str, message: str, counts: dict[str, int]
    ) -> None:
        """A Warning Event on the pod; the same reason and message again bumps its count."""
        body = pod_event(pod, self.node.name, reason, message, _now())
        name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
        count = counts.get(name, 0) + 1
        try:
            if count == 1:
                try:
                    await read_json(
                        self.core.create_namespaced_event(
                            namespace, body, _preload_content=False, _request_timeout=self.timeout
                        )
                    )
                    counts[name] = 1
                    return
                except ApiException as exc:
                    if exc.status != 409:
                        raise
                    count = 2
            await read_json(
                self.core.patch_namespaced_event(
                    name,
                    namespace,
                    {"count": count, "lastTimestamp": timestamp(_now())},
                    _preload_content=False,
                    _request_timeout=self.timeout,
                )
            )
            counts[name] = count
        except API_ERRORS as exc:
            # Events are best effort, as kubelet's are.
            self.log.warning(
                "recording pod event failed",
                pod=f"{namespace}/{body['involvedObject']['name']}",
                error=_describe(exc),
            )


class PodWorker:
    """Brings one pod bound to the node to Running, and away again when it is deleted."""

    def __init__(self, kubelet: NodeKubelet, pod: dict[str, Any]) -> None:
        self.kubelet = kubelet
        self.pod = pod
        self.key: PodKey = pod_key(pod)
        self.changed = asyncio.Event()
        self.stopping = asyncio.Event()  # terminating or gone: cut retry waits short
        self.deleted = False
        self.started = False
        # Every claim handed to the plugin, so that termination unprepares exactly those.
        self.attempted: dict[str, ClaimRef] = {}
        self.event_counts: dict[str, int] = {}
        self.log = kubelet.log.bind(pod=str(self.key), namespace=self.key.namespace)

    def update(self, pod: dict[str, Any]) -> None:
        self.pod = pod
        if is_terminating(pod):
            self.stopping.set()
        self.changed.set()

    def gone(self) -> None:
        self.deleted = True
        self.stopping.set()
        self.changed.set()

    async def run(self) -> None:
        backoff = Backoff(
            initial=self.kubelet.settings.retry_initial_s, cap=self.kubelet.settings.retry_cap_s
        )
        try:
            while True:
                try:
                    await self._run()
                    return
                except Exception:
                    # A bug must cost this pod a retry, not the node's other pods.
                    delay = backoff.next_delay()
                    self.log.exception("pod sync crashed; retrying", retry_in_s=round(delay, 2))
                    await asyncio.sleep(delay)
        finally:
            if self.kubelet.workers.get(self.key.uid) is self:
                del self.kubelet.workers[self.key.uid]

    async def _run(self) -> None:
        settings = self.kubelet.settings
        backoff = Backoff(initial=settings.retry_initial_s, cap=settings.retry_cap_s)
        if is_terminating(self.pod):
            self.stopping.set()
        while True:
            self.changed.clear()
            if self.stopping.is_set():
                await self._terminate()
                return
            if not self.started and not is_finished(self.pod):
                try:
                    await self._start(self.pod)
                    backoff.reset()
                except NotReadyYet as exc:
                    await self._pause(backoff.next_delay(), "pod not ready to start", str(exc), debug=True)
                    continue
                except PrepareFailed as exc:
                    await self._pause(backoff.next_delay(), "preparing claims failed", str(exc))
                    continue
                except API_ERRORS as exc:
                    await self._pause(backoff.next_delay(), "pod sync failed", _describe(exc))
                    continue
            await self.changed.wait()

    async def _pause(self, delay: float, what: str, error: str, debug: bool = False) -> None:
        emit = self.log.debug if debug else self.log.warning
        emit(f"{what}; retrying", error=error, retry_in_s=round(delay, 2))
        try:
            await asyncio.wait_for(self.stopping.wait(), timeout=delay)
        except TimeoutError:
            pass

    async def _claims_for_driver(self, pod: dict[str, Any]) -> list[ClaimRef]:
        k = self.kubelet
        refs = []
        for name in claim_names(pod):
            try:
                claim = await read_json(
                    k.resource.read_namespaced_resource_claim(
                        name, self.key.namespace, _preload_content=False, _request_timeout=k.timeout
                    )
                )
            except ApiException as exc:
                if exc.status == 404:
                    raise NotReadyYet(f"ResourceClaim {self.key.namespace}/{name} does not exist") from None
                raise
            ref = claim_for_driver(claim, self.key.uid, k.settings.driver)
            if ref is not None:
                refs.append(ref)
        return refs

    async def _start(self, pod: dict[str, Any]) -> None:
        k = self.kubelet
        refs = await self._claims_for_driver(pod)
        if refs:
            self.attempted.update({r.uid: r for r in refs})
            answers = await k.prepare(refs)
            no_answer = plugin.PrepareAnswer("no answer")
            failed = [
                (r, answers.get(r.uid, no_answer).error) for r in refs if answers.get(r.uid, no_answer).error
            ]
            if failed:
                detail = "; ".join(
                    f"NodePrepareResources failed for claim {r.namespace}/{r.name}: {error}"
                    for r, error in failed
                )
                message = f"Failed to prepare dynamic resources: {detail}"
                await k.record_event(pod, FAILED_PREPARE_REASON, message, self.event_counts)
                raise PrepareFailed(detail)
            # The CDI devices kubelet would hand the runtime (the differential test compares them).
            self.log.info(
                "claims prepared",
                claims=[r.name for r in refs],
                claim_uids=[r.uid for r in refs],
                cdi_device_ids=[i for r in refs for i in answers[r.uid].cdi_device_ids],
            )
        if not is_running(pod):
            try:
                await read_json(
                    k.core.patch_namespaced_pod_status(
                        self.key.name,
                        self.key.namespace,
                        {"status": running_pod_status(pod, k.node.address, _now())},
                        _preload_content=False,
                        _request_timeout=k.timeout,
                    )
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise
                self.gone()
                return
            self.log.info("pod running")
        self.started = True

    async def _claims_to_release(self) -> list[ClaimRef]:
        """Claims of our driver in a pod this process never prepared (the shim restarted while the
        pod ran): kubelet finds them in its checkpoint, we in the API. Unprepare is idempotent."""
        try:
            names = claim_names(self.pod)
        except NotReadyYet:
            return []
        refs = []
        for name in names:
            try:
                claim = await read_json(
                    self.kubelet.resource.read_namespaced_resource_claim(
                        name,
                        self.key.namespace,
                        _preload_content=False,
                        _request_timeout=self.kubelet.timeout,
                    )
                )
            except ApiException as exc:
                if exc.status == 404:
                    continue
                raise
            ref = allocated_to_driver(claim, self.kubelet.settings.driver)
            if ref is not None:
                refs.append(ref)
        return refs

    async def _terminate(self) -> None:
        k = self.kubelet
        refs = list(self.attempted.values())
        if not refs and not self.deleted:
            found: list[ClaimRef] = []

            async def find() -> None:
                found[:] = await self._claims_to_release()

            await k._until_done("reading the claims of a terminating pod", find)
            refs = found
        backoff = Backoff(initial=k.settings.retry_initial_s, cap=k.settings.retry_cap_s)
        while refs:
            errors = await k.unprepare(refs)
            left = [r for r in refs if errors.get(r.uid, "no answer")]
            if left:
                delay = backoff.next_delay()
                self.log.warning(
                    "unpreparing claims failed; retrying",
                    errors={r.name: errors.get(r.uid, "no answer") for r in left},
                    retry_in_s=round(delay, 2),
                )
                await asyncio.sleep(delay)
            else:
                self.log.info("claims unprepared", claims=[r.name for r in refs])
            refs = left
        if not self.deleted:
            await k._until_done("removing pod", self._remove)
        self.log.info("pod removed")

    async def _remove(self) -> None:
        try:
            await read_json(
                self.kubelet.core.delete_namespaced_pod(
                    self.key.name,
                    self.key.namespace,
                    body={"gracePeriodSeconds": 0, "preconditions": {"uid": self.key.uid}},
                    grace_period_seconds=0,
                    _preload_content=False,
                    _request_timeout=self.kubelet.timeout,
                )
            )
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone already, or the name is another pod's now
                raise
