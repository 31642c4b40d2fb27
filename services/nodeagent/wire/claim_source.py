"""Where a claim's allocation comes from: the two adapters of the port (``ClaimSource`` in core/claim.py).

Kubelet names a claim by namespace, name and UID; the node agent needs what the scheduler
allocated (``status.allocation.devices.results``) and the opaque driver configuration
(``status.allocation.devices.config``). In Kubernetes mode that is the ResourceClaim object
(``resource.k8s.io`` v1, v1beta2 or v1beta1, whichever the API server prefers: the allocation has
the same shape in all three); in simulation it is the ``Claim`` record in the store, which has the
same shape. Both adapters return a :class:`ResolvedClaim` (services/nodeagent/core/claim.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import structlog

from libs.contract.channel_config import ConfigError, parse_parameters_json
from libs.contract.names import DRIVER_NAME
from libs.gen.computedomain.state import v1 as pb
from libs.kube.resource_api import ResourceApiUnavailable, ServedVersion, resource_path
from libs.state.store import TRANSIENT_ERRORS, Store
from services.nodeagent.core.claim import ClaimRef, DeviceResult, OpaqueParameters, ResolvedClaim
from services.nodeagent.core.errors import ClaimGone, PermanentClaimError, RetryableClaimError

log = structlog.get_logger(__name__)


def _check_identity(ref: ClaimRef, namespace: str, name: str, uid: str, where: str) -> None:
    if uid != ref.uid:
        raise ClaimGone(
            f"claim {ref.namespace}/{ref.name} in {where} has UID {uid or '<none>'}, not {ref.uid} "
            "(deleted and re-created?)"
        )
    if (namespace, name) != (ref.namespace, ref.name):
        raise PermanentClaimError(
            f"claim {ref.uid} is {namespace}/{name} in {where}, but kubelet named it {ref.namespace}/{ref.name}"
        )


# ---- simulation: the store ---------------------------------------------------------------


class StoreClaimSource:
    """Claims written into the store by ``cdsim`` (key ``claims/<uid>``)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def resolve(self, ref: ClaimRef) -> ResolvedClaim:
        try:
            got = await self.store.get(self.store.keys.claim(ref.uid), pb.Claim)
        except ValueError as exc:  # a UID that cannot be a key segment
            raise PermanentClaimError(f"claim UID {ref.uid!r} is invalid: {exc}") from None
        except TRANSIENT_ERRORS as exc:
            raise RetryableClaimError(f"store unavailable while reading claim {ref.uid}: {exc}") from exc
        if got is None:
            raise ClaimGone(f"claim {ref.namespace}/{ref.name} ({ref.uid}) does not exist")
        claim = got.value
        _check_identity(ref, claim.namespace, claim.name, claim.uid, "the store")
        try:
            return _resolved_from_store(ref, got.mod_revision, claim)
        except ConfigError as exc:
            raise PermanentClaimError(str(exc)) from None


def _resolved_from_store(ref: ClaimRef, revision: int, claim: pb.Claim) -> ResolvedClaim:
    """A store claim record as the agent reads claims; `ConfigError` for bad opaque parameters."""
    return ResolvedClaim(
        ref=ref,
        version=str(revision),
        results=tuple(DeviceResult(r.request, r.driver, r.pool, r.device) for r in claim.results),
        configs=tuple(
            OpaqueParameters(
                driver=c.driver,
                requests=tuple(c.requests),
                parameters=(
                    parse_parameters_json(c.parameters_json) if c.driver == DRIVER_NAME else c.parameters_json
                ),
                source=c.source,
            )
            for c in claim.config
        ),
    )


# ---- Kubernetes: the ResourceClaim -------------------------------------------------------


def _field(obj: Any, *path: str) -> Any:
    for name in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(name)
    return obj


def _strings(value: Any) -> tuple[str, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        return ()
    return tuple(v for v in value if isinstance(v, str))


def parse_resource_claim(obj: Any, ref: ClaimRef) -> ResolvedClaim:
    """A ``resource.k8s.io`` ResourceClaim (decoded JSON, any version) as a :class:`ResolvedClaim`."""
    if not isinstance(obj, Mapping) or obj.get("kind", "ResourceClaim") != "ResourceClaim":
        raise PermanentClaimError(
            f"claim {ref.namespace}/{ref.name}: the API server returned no ResourceClaim"
        )
    meta = _field(obj, "metadata") or {}
    _check_identity(
        ref,
        str(meta.get("namespace", "")),
        str(meta.get("name", "")),
        str(meta.get("uid", "")),
        "the API server",
    )
    allocation = _field(obj, "status", "allocation")
    if not isinstance(allocation, Mapping):
        raise RetryableClaimError(f"claim {ref.namespace}/{ref.name} is not allocated")
    results = []
    for r in _field(allocation, "devices", "results") or ():
        if isinstance(r, Mapping):
            results.append(
                DeviceResult(
                    request=str(r.get("request", "")),
                    driver=str(r.get("driver", "")),
                    pool=str(r.get("pool", "")),
                    device=str(r.get("device", "")),
                )
            )
    configs = []
    for c in _field(allocation, "devices", "config") or ():
        opaque = _field(c, "opaque")
        if not isinstance(opaque, Mapping):
            continue  # not an opaque configuration: not ours to read
        configs.append(
            OpaqueParameters(
                driver=str(opaque.get("driver", "")),
                requests=_strings(_field(c, "requests")),
                parameters=opaque.get("parameters"),
                source=str(_field(c, "source") or ""),
            )
        )
    return ResolvedClaim(
        ref=ref,
        version=str(meta.get("resourceVersion", "")),
        results=tuple(results),
        configs=tuple(configs),
    )


class KubeClaimSource:
    """ResourceClaims read from the API server with kubernetes-asyncio (raw JSON, so one parser
    reads every version)."""

    def __init__(self, api_client: Any, timeout_s: float = 10.0, version: str = "") -> None:
        self._api_client = api_client
        self._timeout_s = timeout_s
        self.served = ServedVersion(api_client, version, timeout_s)

    async def resolve(self, ref: ClaimRef) -> ResolvedClaim:
        from kubernetes_asyncio.client.exceptions import ApiException

        what = f"claim {ref.namespace}/{ref.name}"
        try:
            async with asyncio.timeout(self._timeout_s):
                version = await self.served.get()
                response: Any = await self._api_client.call_api(
                    resource_path(version, "resourceclaims", ref.namespace, ref.name),
                    "GET",
                    header_params={"Accept": "application/json"},
                    auth_settings=["BearerToken"],
                    _preload_content=False,
                    _request_timeout=self._timeout_s,
                )
                response = response[0] if isinstance(response, tuple) else response
                try:
                    status = response.status
                    body = await response.read()
                finally:
                    response.release()
        except ApiException as exc:
            status, body = int(exc.status or 0), b""
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise RetryableClaimError(f"{what}: API server unreachable: {exc or type(exc).__name__}") from exc
        except ResourceApiUnavailable as exc:
            raise RetryableClaimError(f"{what}: {exc}") from exc
        if status == 404:
            raise ClaimGone(f"{what} ({ref.uid}) does not exist")
        if not 200 <= status <= 299:
            # 403 is a deployment problem (RBAC), but fixing it needs no new claim: retryable.
            raise RetryableClaimError(f"{what}: API server answered HTTP {status}")
        try:
            obj = json.loads(body)
        except ValueError as exc:
            raise RetryableClaimError(f"{what}: undecodable API response: {exc}") from exc
        return parse_resource_claim(obj, ref)
