"""Where the extender learns which ComputeDomain a pod belongs to, and how many nodes it wants.

Ports:
- `TemplateDomainSource`: the domain uid of a workload ResourceClaimTemplate.
  Adapters: Kubernetes (GET the template; the controller labels it
  `resource.nvidia.com/computeDomain=<uid>`, and its opaque config carries
  `domainID` too), the store (the mirrored ComputeDomain names its template),
  and a static map for tests. `CachedTemplateSource` wraps any of them.
- `DomainSizeSource`: spec.numNodes of a domain (store adapter, static map).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import structlog

from libs.contract.names import DRIVER_NAME
from libs.gen.computedomain.state import v1 as state_pb
from libs.state.store import Store
from services.advisor.domain_presence import DomainPresence

log = structlog.get_logger(__name__)

DOMAIN_LABEL = "resource.nvidia.com/computeDomain"


class TemplateDomainSource(Protocol):
    async def domain_of_template(self, namespace: str, name: str) -> str | None:
        """The uid of the ComputeDomain whose workload template this is; None if it is not one."""
        ...


class DomainSizeSource(Protocol):
    async def num_nodes(self, domain_uid: str) -> int | None:
        """spec.numNodes when > 0, else None (unknown)."""
        ...


def domain_of_template_object(obj: Mapping[str, Any]) -> str | None:
    """The domain uid of a ResourceClaimTemplate object (pure): its label, else its opaque config."""
    metadata = obj.get("metadata") or {}
    labels = metadata.get("labels") or {}
    uid = labels.get(DOMAIN_LABEL)
    if isinstance(uid, str) and uid:
        return uid
    spec = (obj.get("spec") or {}).get("spec") or {}
    for config in (spec.get("devices") or {}).get("config") or []:
        opaque = (config or {}).get("opaque") or {}
        if opaque.get("driver") != DRIVER_NAME:
            continue
        parameters = opaque.get("parameters") or {}
        domain_id = parameters.get("domainID") if isinstance(parameters, dict) else None
        if isinstance(domain_id, str) and domain_id:
            return domain_id
    return None


class StaticTemplateSource:
    def __init__(self, mapping: Mapping[tuple[str, str], str]) -> None:
        self.mapping = dict(mapping)
        self.lookups = 0

    async def domain_of_template(self, namespace: str, name: str) -> str | None:
        self.lookups += 1
        return self.mapping.get((namespace, name))


class StaticDomainSizes:
    def __init__(self, mapping: Mapping[str, int]) -> None:
        self.mapping = dict(mapping)

    async def num_nodes(self, domain_uid: str) -> int | None:
        size = self.mapping.get(domain_uid, 0)
        return size if size > 0 else None


class StoreTemplateSource:
    """Finds the domain by the template name in the mirrored ComputeDomain records (one list, cached)."""

    def __init__(
        self,
        store: Store,
        refresh_s: float = 2.0,
        min_reload_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.refresh_s = refresh_s
        # A miss reloads (a domain may be new), but not more often than this.
        self.min_reload_s = min_reload_s
        self.clock = clock
        self._by_template: dict[tuple[str, str], str] = {}
        self._loaded_at: float | None = None
        self._lock = asyncio.Lock()

    async def _load(self) -> None:
        items, _ = await self.store.list(self.store.keys.domains(), state_pb.ComputeDomain)
        table: dict[tuple[str, str], str] = {}
        for item in items:
            domain = item.value
            if domain.deleting or not domain.spec.channel.resource_claim_template_name:
                continue
            table[(domain.namespace, domain.spec.channel.resource_claim_template_name)] = domain.uid
        self._by_template = table
        self._loaded_at = self.clock()

    async def domain_of_template(self, namespace: str, name: str) -> str | None:
        async with self._lock:
            age = None if self._loaded_at is None else self.clock() - self._loaded_at
            missing = (namespace, name) not in self._by_template
            if age is None or age > self.refresh_s or (missing and age > self.min_reload_s):
                await self._load()
        return self._by_template.get((namespace, name))


class StoreDomainSizes:
    """A domain's spec.numNodes from the domain view the advisor follows (`DomainPresence`); read
    from the store only for a domain that view has not seen yet (just created). The read cost a
    store round trip on every Filter and Prioritize call: about a tenth of the extender's CPU."""

    def __init__(self, store: Store, presence: DomainPresence) -> None:
        self.store = store
        self.presence = presence

    async def num_nodes(self, domain_uid: str) -> int | None:
        known = self.presence.num_nodes(domain_uid)
        if known is not None:
            return known or None
        found = await self.store.get(self.store.keys.domain(domain_uid), state_pb.ComputeDomain)
        if found is None or found.value.spec.num_nodes <= 0:
            return None
        return int(found.value.spec.num_nodes)


class KubeTemplateSource:
    """GETs the ResourceClaimTemplate from the API server (resource.k8s.io/<version>; "" = the
    version the API server prefers, discovered on first use)."""

    def __init__(self, api_client: Any, version: str = "", timeout_s: float = 5.0) -> None:
        from libs.kube.resource_api import ServedVersion

        self.api_client = api_client
        self.served = ServedVersion(api_client, version, timeout_s)
        self.timeout_s = timeout_s

    async def domain_of_template(self, namespace: str, name: str) -> str | None:
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        api = client.CustomObjectsApi(self.api_client)
        try:
            obj = await api.get_namespaced_custom_object(
                "resource.k8s.io",
                await self.served.get(),
                namespace,
                "resourceclaimtemplates",
                name,
                _request_timeout=self.timeout_s,
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return domain_of_template_object(obj) if isinstance(obj, dict) else None


class CachedTemplateSource:
    """Remembers answers: positive ones for `ttl_s`, "not a domain template" for `negative_ttl_s`."""

    def __init__(
        self,
        inner: TemplateDomainSource,
        ttl_s: float = 60.0,
        negative_ttl_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = 10_000,
    ) -> None:
        self.inner = inner
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.clock = clock
        self.max_entries = max_entries
        self._cache: dict[tuple[str, str], tuple[str | None, float]] = {}

    async def domain_of_template(self, namespace: str, name: str) -> str | None:
        key = (namespace, name)
        now = self.clock()
        hit = self._cache.get(key)
        if hit is not None and hit[1] > now:
            return hit[0]
        uid = await self.inner.domain_of_template(namespace, name)
        if len(self._cache) >= self.max_entries:
            self._cache = {k: v for k, v in self._cache.items() if v[1] > now}
            if len(self._cache) >= self.max_entries:
                self._cache.clear()
        self._cache[key] = (uid, now + (self.ttl_s if uid else self.negative_ttl_s))
        return uid
