"""The Kubernetes adapter: ComputeDomain CRs in, store records and CR status out.

Runs only in the leader. An informer (list, then watch from the list's
resourceVersion; resumed after a stream ends, listed again on 410 Gone)
keeps the CRs of all namespaces; each CR uid, and each store domain whose
record changes, is queued, and a worker brings the pair in line:

- live CR: our finalizer on it, its spec mirrored into the store domain
  (uid = CR uid), its workload ResourceClaimTemplate present, the store's
  status written back through the status subresource when it differs, with
  an Event for each transition;
- CR being deleted: the store domain marked deleting; once the controller
  has torn it down (record gone), the RCT and then the CR finalizer removed;
- store domain of source "kubernetes" whose CR is gone: marked deleting;
- every pass, whatever the CR's state: the Nodes of the domain's members carry
  `resource.nvidia.com/computeDomain=<uid>` and no other Node carries this uid
  (`node_label.py`); before the finalizer of a deleted CR goes, every Node
  labelled with its uid loses the label.

Every few seconds the claims held by lost members are checked against the API
server, and the records of those gone there are dropped (`lost_claims.py`), so a
node lost for good gives its index back once Kubernetes has deleted its pods.

A periodic sweep removes RCTs and node labels of CDs that no longer exist, and
queues every CD again so that node labels edited behind our back are repaired.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio import watch as k8s_watch
from kubernetes_asyncio.client import ApiClient, CustomObjectsApi
from kubernetes_asyncio.client.exceptions import ApiException

from libs.gen.computedomain.state import v1 as pb
from libs.kube.client import without_env_lookups
from libs.kube.resource_api import ResourceApiUnavailable, ServedVersion
from libs.runtime.backoff import Backoff
from libs.runtime.errors import RetryableError
from libs.state.election import Leadership
from libs.state.store import TRANSIENT_ERRORS, Store
from services.controller.kube import mirror
from services.controller.kube.computedomain import (
    GROUP,
    PLURAL,
    SOURCE_KUBERNETES,
    VERSION,
    InvalidComputeDomain,
    StatusEcho,
    allocation_mode_name,
    cr_status,
    cr_status_differs,
    domain_from_cr,
    finalizers_patch,
    has_finalizer,
    is_deleting,
    seen_status,
    status_patch,
    status_transition,
)
from services.controller.kube.events import EventRecorder, EventSpec, transition_events
from services.controller.kube.fence import fence_writes
from services.controller.kube.lost_claims import CHECK_INTERVAL_S, drop_vanished_claims
from services.controller.kube.node_health import (
    NODE_HEALTH_INTERVAL_S,
    NodeHealth,
    node_events,
    with_nodes_condition,
)
from services.controller.kube.node_label import NodeLabeler, desired_nodes
from services.controller.kube.resourceclaimtemplate import ensure_template, remove_template
from services.controller.kube.sweep import list_labelled, sweep_once
from services.controller.reconciler import DomainReconciler, FenceLost
from services.controller.workqueue import QueueShutDown, WorkQueue

log = structlog.get_logger(__name__)

_CALL_TIMEOUT_S = 30.0
# A CR's status is rewritten at most this often while only its node list changes (a 256-node
# formation changed it ~100 times in 30 s, each write a 256-entry status through the API server);
# a transition (Ready, a condition's status) is written at once.
STATUS_MIN_INTERVAL_S = 1.0
# Server-side end of each watch request; the informer resumes from the last resourceVersion.
_WATCH_TIMEOUT_S = 300
# ResourceApiUnavailable: the API server serves no resource.k8s.io version we speak (yet).
_KUBE_ERRORS: tuple[type[BaseException], ...] = (
    ApiException,
    aiohttp.ClientError,
    OSError,
    TimeoutError,
    ResourceApiUnavailable,
)


def _newer_or_same(candidate: dict[str, Any], current: dict[str, Any] | None) -> bool:
    """Whether `candidate` is not older than `current` (resourceVersions of one etcd are revisions)."""
    if current is None:
        return True
    a = str(candidate.get("metadata", {}).get("resourceVersion", ""))
    b = str(current.get("metadata", {}).get("resourceVersion", ""))
    if a.isdigit() and b.isdigit():
        return int(a) >= int(b)
    return True


async def load_api_client(kubeconfig: str) -> ApiClient:
    if kubeconfig:
        api = await k8s_config.new_client_from_config(config_file=kubeconfig)
    else:
        configuration = k8s_client.Configuration()
        k8s_config.load_incluster_config(client_configuration=configuration)
        api = ApiClient(configuration)
    return await without_env_lookups(api)


class KubeAdapter:
    def __init__(
        self,
        store: Store,
        reconciler: DomainReconciler,
        api: ApiClient,
        sweep_interval_s: float = 300.0,
        instance: str = "",
        workers: int = 2,
        lost_claims_interval_s: float = CHECK_INTERVAL_S,
    ) -> None:
        self.store = store
        self.reconciler = reconciler
        self.api = api
        # The resource.k8s.io version of the workload templates (discovered on first use).
        self.served = ServedVersion(api)
        self.custom = CustomObjectsApi(api)
        self.events = EventRecorder(api, instance)
        self.labeler = NodeLabeler(api)
        self.node_health = NodeHealth(api)
        self.node_health_interval_s = NODE_HEALTH_INTERVAL_S
        self.sweep_interval_s = sweep_interval_s
        self.lost_claims_interval_s = lost_claims_interval_s
        self.workers = workers
        self.crs: dict[str, dict[str, Any]] = {}
        self.listed = asyncio.Event()
        self.queue: WorkQueue[str] = WorkQueue()
        # CD uids whose RCT is known to exist, so a reconcile does not ask the API every time.
        self._templates_ok: set[str] = set()
        # When each CD's status was last written (loop time), to pace node-list-only rewrites.
        self._status_written: dict[str, float] = {}
        # Each CD's last status write and what the API server kept of it (see seen_status).
        self._status_echo: dict[str, StatusEcho] = {}
        self.resource_version = ""
        self.relists = 0

    @classmethod
    async def create(
        cls,
        store: Store,
        reconciler: DomainReconciler,
        kubeconfig: str,
        sweep_interval_s: float,
        identity: str = "",
    ) -> KubeAdapter:
        api = await load_api_client(kubeconfig)
        # The apiserver's audit log then says which replica made a request.
        api.user_agent = f"cd-controller/{identity}" if identity else "cd-controller"
        return cls(store, reconciler, api, sweep_interval_s, instance=identity)

    # ---- running ---------------------------------------------------------------------------

    def _on_domain_change(self, uid: str) -> None:
        entry = self.reconciler.view.domains.get(uid)
        if uid in self.crs or (entry is not None and entry.value.source == SOURCE_KUBERNETES):
            self.queue.add(uid)

    async def run(self, leadership: Leadership) -> None:
        fence_writes(self.api, leadership)
        self.labeler.invalidate()  # a former leader may have labelled nodes: list them again
        self.reconciler.listeners.append(self._on_domain_change)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._informer())
                for _ in range(self.workers):
                    tg.create_task(self._worker(leadership))
                tg.create_task(self._sweeper())
                tg.create_task(self._lost_claims_checker(leadership))
                tg.create_task(self._node_health_watcher())
        finally:
            with contextlib.suppress(ValueError):
                self.reconciler.listeners.remove(self._on_domain_change)
            self.queue.shutdown()
            with contextlib.suppress(Exception):
                await self.api.close()

    async def _list(self) -> None:
        listing = await self.custom.list_cluster_custom_object(
            GROUP, VERSION, PLURAL, _request_timeout=_CALL_TIMEOUT_S
        )
        items = {item["metadata"]["uid"]: item for item in listing.get("items", [])}
        previous = set(self.crs)
        self.crs = items
        self.resource_version = listing["metadata"]["resourceVersion"]
        self.relists += 1
        # CRs that vanished while we were not watching, and store domains whose CR is gone.
        orphaned = {
            uid
            for uid, entry in self.reconciler.view.domains.items()
            if entry.value.source == SOURCE_KUBERNETES and uid not in items
        }
        for uid in set(items) | previous | orphaned:
            self.queue.add(uid)
        self.listed.set()
        log.info("computedomains listed", count=len(items), resource_version=self.resource_version)

    async def _informer(self) -> None:
        """List when there is no resume point (start, 410 Gone), otherwise watch from it."""
        backoff = Backoff(initial=0.2, cap=10.0)
        while True:
            try:
                if not self.resource_version:
                    await self._list()
                await self._watch_once()
                backoff.reset()
            except ApiException as exc:
                if exc.status == 410:
                    log.info("computedomain watch expired (410 Gone); listing again")
                    self.resource_version = ""
                    continue
                delay = backoff.next_delay()
                log.warning(
                    "computedomain watch failed", status=exc.status, error=exc.reason, retry_in_s=delay
                )
                if exc.status in (401, 403, 404):
                    self.resource_version = ""
                await asyncio.sleep(delay)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                delay = backoff.next_delay()
                log.warning(
                    "computedomain watch broke", error=str(exc) or type(exc).__name__, retry_in_s=delay
                )
                await asyncio.sleep(delay)

    async def _watch_once(self) -> None:
        """One watch request from the last resourceVersion until the server ends it."""
        async with k8s_watch.Watch() as w:
            stream = w.stream(
                self.custom.list_cluster_custom_object,
                GROUP,
                VERSION,
                PLURAL,
                resource_version=self.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=_WATCH_TIMEOUT_S,
                _request_timeout=_WATCH_TIMEOUT_S + 30,
            )
            async for event in stream:
                raw = event["raw_object"]
                rv = raw.get("metadata", {}).get("resourceVersion")
                if rv:
                    self.resource_version = rv
                if event["type"] == "BOOKMARK":
                    continue
                uid = raw["metadata"]["uid"]
                if event["type"] == "DELETED":
                    self.crs.pop(uid, None)
                    self._status_written.pop(uid, None)
                    self._status_echo.pop(uid, None)
                elif _newer_or_same(raw, self.crs.get(uid)):
                    self.crs[uid] = raw
                self.queue.add(uid)

    async def _worker(self, leadership: Leadership) -> None:
        await self.listed.wait()
        while True:
            try:
                uid = await self.queue.get()
            except QueueShutDown:
                return
            try:
                async with asyncio.timeout(_CALL_TIMEOUT_S * 2):  # not wait_for: see DomainReconciler._worker
                    await self.reconcile(uid, leadership)
            except (FenceLost, asyncio.CancelledError):
                self.queue.done(uid)
                raise
            except _RETRYABLE as exc:
                delay = self.queue.backoff.when(uid)
                log.warning(
                    "computedomain sync failed; requeued", cd_uid=uid, error=str(exc) or type(exc).__name__
                )
                self.queue.done(uid)
                self.queue.add_after(uid, delay)
            else:
                self.queue.forget(uid)
                self.queue.done(uid)

    async def _sweeper(self) -> None:
        await self.listed.wait()
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                await self.sweep()
            except _KUBE_ERRORS as exc:
                log.warning("sweep failed", error=str(exc) or type(exc).__name__)
            self._resync_node_labels()

    async def _lost_claims_checker(self, leadership: Leadership) -> None:
        await self.listed.wait()
        backoff = Backoff(initial=self.lost_claims_interval_s, cap=self.lost_claims_interval_s * 10)
        while True:
            try:
                await drop_vanished_claims(
                    self.store, self.reconciler.view, self.api, self.served, leadership
                )
            except (*_KUBE_ERRORS, *TRANSIENT_ERRORS) as exc:
                delay = backoff.next_delay()
                log.warning(
                    "checking lost nodes' claims failed",
                    error=str(exc) or type(exc).__name__,
                    retry_in_s=delay,
                )
                await asyncio.sleep(delay)
                continue
            backoff.reset()
            await asyncio.sleep(self.lost_claims_interval_s)

    async def _node_health_watcher(self) -> None:
        """List the Nodes now and then; requeue the domains of nodes whose readiness changed."""
        await self.listed.wait()
        backoff = Backoff(initial=self.node_health_interval_s, cap=self.node_health_interval_s * 10)
        while True:
            try:
                changed = await self.node_health.refresh()
            except _KUBE_ERRORS as exc:
                delay = backoff.next_delay()
                log.warning("listing nodes failed", error=str(exc) or type(exc).__name__, retry_in_s=delay)
                await asyncio.sleep(delay)
                continue
            backoff.reset()
            if changed:
                log.info("node readiness changed", nodes=sorted(changed))
            view = self.reconciler.view
            for node in changed:
                for uid in view.node_domains.get(node, ()):
                    self.queue.add(uid)
            await asyncio.sleep(self.node_health_interval_s)

    def _resync_node_labels(self) -> None:
        """List the labelled Nodes again on the next sync and bring every CD's labels in line."""
        self.labeler.invalidate()
        mirrored = {u for u, e in self.reconciler.view.domains.items() if e.value.source == SOURCE_KUBERNETES}
        for uid in set(self.crs) | mirrored:
            self.queue.add(uid)

    async def sweep(self) -> None:
        version = await self.served.get()
        objects = await list_labelled(self.api, version)
        # Liveness is read after the objects, from the API itself (the informer may lag).
        listing = await self.custom.list_cluster_custom_object(
            GROUP, VERSION, PLURAL, _request_timeout=_CALL_TIMEOUT_S
        )
        live = {item["metadata"]["uid"] for item in listing.get("items", [])}
        live |= set(self.reconciler.view.domains)
        result = await sweep_once(self.api, objects, live, version)
        if result.templates_removed or result.node_labels_removed:
            log.info(
                "sweep removed leftovers",
                templates=result.templates_removed,
                node_labels=result.node_labels_removed,
            )

    # ---- one CD ------------------------------------------------------------------------------

    async def reconcile(self, uid: str, leadership: Leadership) -> None:
        await self._reconcile_cr(uid, leadership)
        await self._sync_node_labels(uid)

    def _names(self, uid: str) -> tuple[str, str]:
        """(CD name, namespace) for logs, from the CR or else the store record."""
        cr = self.crs.get(uid)
        if cr is not None:
            return cr["metadata"].get("name", ""), cr["metadata"].get("namespace", "")
        entry = self.reconciler.view.domains.get(uid)
        return (entry.value.name, entry.value.namespace) if entry is not None else ("", "")

    async def _sync_node_labels(self, uid: str) -> None:
        view = self.reconciler.view
        desired = desired_nodes(uid in view.domains, view.members.get(uid, {}))

        def member_of(node: str) -> set[str]:
            return {u for u in view.node_domains.get(node, ()) if u in view.domains}

        cd, namespace = self._names(uid)
        await self.labeler.sync(uid, desired, member_of, cd, namespace)

    async def _reconcile_cr(self, uid: str, leadership: Leadership) -> None:
        cr = self.crs.get(uid)
        entry = self.reconciler.view.domains.get(uid)
        if cr is None:
            if entry is not None and entry.value.source == SOURCE_KUBERNETES and not entry.value.deleting:
                # The CR went away without our finalizer's consent (or while we were down).
                if not await mirror.mark_deleting(self.store, entry.value, entry.mod_revision, leadership):
                    raise _Retry(f"domain {uid} changed while marking it deleting")
            return
        if is_deleting(cr):
            await self._finish_deletion(uid, cr, leadership)
            return
        if not has_finalizer(cr):
            cr = await self._patch_cr(cr, finalizers_patch(cr, present=True))
        try:
            desired = domain_from_cr(cr)
        except InvalidComputeDomain as exc:
            await self.events.emit(cr, EventSpec("Warning", "InvalidSpec", str(exc)))
            log.warning("invalid computedomain", cd_uid=uid, error=str(exc))
            return
        if entry is None:
            # Refused only if the record exists already and the view has not seen it yet; its
            # watch event queues this CD again.
            await mirror.create_domain(self.store, desired, leadership)
        elif (
            bytes(entry.value.spec) != bytes(desired.spec)
            or entry.value.name != desired.name
            or entry.value.namespace != desired.namespace
        ):
            if not await mirror.update_spec(self.store, entry.value, entry.mod_revision, desired, leadership):
                raise _Retry(f"domain {uid} changed while mirroring its spec")
        await self._ensure_template(uid, cr, desired.spec.channel.resource_claim_template_name, desired)
        if entry is not None and entry.status.conditions:
            desired_status = with_nodes_condition(
                cr_status(entry.status),
                # What we last wrote, where an older CRD pruned the conditions: else NodesReady's
                # transition time would be new on every pass, and every pass would write it.
                seen_status(cr.get("status"), self._status_echo.get(uid)),
                self.reconciler.view.members.get(uid, {}),
                self.node_health.not_ready,
                int(time.time() * 1000),
            )
            await self._write_status(uid, cr, desired_status)

    async def _ensure_template(
        self, uid: str, cr: dict[str, Any], name: str, desired: pb.ComputeDomain
    ) -> None:
        if uid in self._templates_ok:
            return
        namespace = cr["metadata"]["namespace"]
        mode = allocation_mode_name(desired.spec.channel.allocation_mode)
        version = await self.served.get()
        result = await ensure_template(self.api, uid, namespace, name, mode, version)
        if result.outcome == "conflict":
            owner = result.other_owner
            owner_live = owner is not None and (owner in self.crs or owner in self.reconciler.view.domains)
            if owner is not None and not owner_live:
                # Left by a deleted CD of the same name (its teardown is over): replace it.
                await remove_template(self.api, namespace, name, owner, version)
                result = await ensure_template(self.api, uid, namespace, name, mode, version)
            if result.outcome == "conflict":
                await self.events.emit(
                    cr,
                    EventSpec(
                        "Warning",
                        "ResourceClaimTemplateConflict",
                        f"ResourceClaimTemplate {namespace}/{name} exists and belongs to "
                        f"{'ComputeDomain ' + owner if owner else 'something else'}",
                    ),
                )
                raise _Retry(f"resource claim template {namespace}/{name} is taken")
        self._templates_ok.add(uid)

    async def _write_status(self, uid: str, cr: dict[str, Any], desired: dict[str, Any]) -> None:
        current = seen_status(cr.get("status"), self._status_echo.get(uid))
        if not cr_status_differs(current, desired):
            return
        now = asyncio.get_running_loop().time()
        last = self._status_written.get(uid)
        if (
            last is not None
            and now - last < STATUS_MIN_INTERVAL_S
            and not status_transition(current, desired)
        ):
            # The later pass writes the status of its moment.
            self.queue.add_after(uid, last + STATUS_MIN_INTERVAL_S - now)
            return
        self._status_written[uid] = now
        meta = cr["metadata"]
        updated = await self._on_conflict_reread(
            cr,
            self.custom.patch_namespaced_custom_object_status(
                GROUP,
                VERSION,
                meta["namespace"],
                PLURAL,
                meta["name"],
                _at_version(cr, status_patch(desired)),
                _request_timeout=_CALL_TIMEOUT_S,
            ),
        )
        if isinstance(updated, dict):
            self._status_echo[uid] = StatusEcho(sent=desired, kept=updated.get("status") or {})
            if _newer_or_same(updated, self.crs.get(uid)):
                self.crs[uid] = updated
        log.info(
            "computedomain status written",
            cd_uid=uid,
            cd=meta["name"],
            namespace=meta["namespace"],
            status=desired["status"],
        )
        for event in [*transition_events(current, desired), *node_events(current, desired)]:
            await self.events.emit(cr, event)

    async def _patch_cr(self, cr: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
        meta = cr["metadata"]
        updated = await self._on_conflict_reread(
            cr,
            self.custom.patch_namespaced_custom_object(
                GROUP,
                VERSION,
                meta["namespace"],
                PLURAL,
                meta["name"],
                _at_version(cr, patch),
                _request_timeout=_CALL_TIMEOUT_S,
            ),
        )
        if not isinstance(updated, dict):
            raise _Retry(f"unexpected patch response for {meta['namespace']}/{meta['name']}")
        if _newer_or_same(updated, self.crs.get(meta["uid"])):
            self.crs[meta["uid"]] = updated
        return updated

    async def _on_conflict_reread(self, cr: dict[str, Any], write: Awaitable[Any]) -> Any:
        """Await a write made at `cr`'s resourceVersion; if the CR moved on meanwhile (409), read
        it again for the retry instead of waiting for the watch to bring it."""
        try:
            return await write
        except ApiException as exc:
            if exc.status != 409:
                raise
        meta = cr["metadata"]
        fresh = await self.custom.get_namespaced_custom_object(
            GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], _request_timeout=_CALL_TIMEOUT_S
        )
        if isinstance(fresh, dict) and _newer_or_same(fresh, self.crs.get(meta["uid"])):
            self.crs[meta["uid"]] = fresh
        raise _Retry(f"computedomain {meta['namespace']}/{meta['name']} changed meanwhile; deciding again")

    async def _finish_deletion(self, uid: str, cr: dict[str, Any], leadership: Leadership) -> None:
        if not has_finalizer(cr):
            return
        entry = self.reconciler.view.domains.get(uid)
        meta = cr["metadata"]
        if entry is not None:
            if not entry.value.deleting and not await mirror.mark_deleting(
                self.store, entry.value, entry.mod_revision, leadership
            ):
                raise _Retry(f"domain {uid} changed while marking it deleting")
            if entry.status.conditions:
                # Shows Terminating (and who is still in the domain) while the teardown runs.
                await self._write_status(uid, cr, cr_status(entry.status))
            # The teardown's last step deletes the record; its watch event queues this CD again.
            return
        # The view may not show a record written a moment ago: only the store can say it is gone.
        if await self.store.get(self.store.keys.domain(uid), pb.ComputeDomain) is not None:
            raise _Retry(f"domain {uid} is in the store but not in the view yet")
        # The domain's record is gone, so it has no member left: no Node may keep its label once
        # the finalizer goes (asked of the API, not the cache, which may miss a former leader's).
        await self.labeler.remove_all(uid, meta["name"], meta["namespace"])
        name = ((cr.get("spec") or {}).get("channel") or {}).get("resourceClaimTemplate", {}).get("name")
        if name:
            await remove_template(self.api, meta["namespace"], name, uid, await self.served.get())
        self._templates_ok.discard(uid)
        self._status_written.pop(uid, None)
        self._status_echo.pop(uid, None)
        try:
            await self._patch_cr(cr, finalizers_patch(cr, present=False))
        except ApiException as exc:
            if exc.status != 404:
                raise
        log.info("computedomain released", cd_uid=uid, cd=meta["name"], namespace=meta["namespace"])


def _at_version(cr: dict[str, Any], patch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`patch` applied only to the version of the CR this controller decided on: a JSON patch's
    test of the resourceVersion fails it (409) if anyone wrote the CR since."""
    version = cr["metadata"].get("resourceVersion")
    guard = [{"op": "test", "path": "/metadata/resourceVersion", "value": version}] if version else []
    return [*guard, *patch]


class _Retry(RetryableError, RuntimeError):
    """The CD's sync must be retried (a concurrent change or a conflict)."""


_RETRYABLE: tuple[type[BaseException], ...] = (*_KUBE_ERRORS, *TRANSIENT_ERRORS, RetryableError)
