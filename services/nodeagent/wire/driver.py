"""The kubelet DRA service: ``NodePrepareResources`` / ``NodeUnprepareResources``.

One grpclib server on ``<kubelet dir>/plugins/compute-domain.nvidia.com/dra.sock`` serves both
``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` and ``...v1beta1.DRAPlugin``; both translate to
:class:`ClaimDispatcher`, which runs the claims of a request concurrently, serializes calls for
the same claim, and answers for every claim of the request (a failure is the claim's ``error``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import structlog
from grpclib.server import Server

from libs.contract.names import DRIVER_NAME
from libs.gen.k8s.io.kubelet.pkg.apis.dra import v1 as dra_v1
from libs.gen.k8s.io.kubelet.pkg.apis.dra import v1beta1 as dra_v1beta1
from libs.runtime.grpc_limits import ServerLimits
from libs.runtime.text_limits import clip, too_long
from services.nodeagent.core.claim import ClaimRef
from services.nodeagent.core.errors import ClaimError, PermanentClaimError
from services.nodeagent.core.prepare_plan import PreparedDevice
from services.nodeagent.shell.keyed_locks import KeyedLocks
from services.nodeagent.shell.metrics import AgentMetrics
from services.nodeagent.wire.unix_socket import start_unix_server, stop_unix_server

log = structlog.get_logger(__name__)

DRA_SOCKET_NAME = "dra.sock"
# Kubernetes' own limits: a namespace is a DNS-1123 label, a claim's name a DNS-1123 subdomain.
MAX_NAMESPACE_BYTES = 63
MAX_NAME_BYTES = 253
DEFAULT_MAX_UID_BYTES = 128


def plugin_dir(kubelet_dir: Path) -> Path:
    return kubelet_dir / "plugins" / DRIVER_NAME


def dra_socket_path(kubelet_dir: Path) -> Path:
    return plugin_dir(kubelet_dir) / DRA_SOCKET_NAME


class ClaimPreparer(Protocol):
    async def prepare(self, ref: ClaimRef) -> list[PreparedDevice]: ...

    async def unprepare(self, ref: ClaimRef) -> None: ...


PrepareOutcome = tuple[list[PreparedDevice], str]


class ClaimDispatcher:
    """Version-independent request handling around the node's claim state."""

    def __init__(
        self, state: ClaimPreparer, metrics: AgentMetrics, max_uid_bytes: int = DEFAULT_MAX_UID_BYTES
    ) -> None:
        self.state = state
        self.metrics = metrics
        self.max_uid_bytes = max_uid_bytes
        self._claim_locks = KeyedLocks()

    def _check(self, ref: ClaimRef) -> None:
        """The claim's fields fit Kubernetes' limits; PermanentClaimError naming the field otherwise
        (before anything is looked up or written)."""
        if not ref.uid:
            raise PermanentClaimError(f"claim {clip(ref.namespace)}/{clip(ref.name)}: uid is empty")
        for field_name, value, limit, setting in (
            ("uid", ref.uid, self.max_uid_bytes, " (--max-claim-uid-bytes)"),
            ("namespace", ref.namespace, MAX_NAMESPACE_BYTES, ""),
            ("name", ref.name, MAX_NAME_BYTES, ""),
        ):
            problem = too_long(value, limit)
            if problem:
                raise PermanentClaimError(f"claim {field_name}: {problem}{setting}")

    async def prepare_claims(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareOutcome]:
        unique = list({c.uid: c for c in claims}.values())
        if len(unique) == 1:  # kubelet's usual request (one pod, one claim): no task to spawn
            return {unique[0].uid: await self._prepare_one(unique[0])}
        outcomes = await asyncio.gather(*(self._prepare_one(c) for c in unique))
        return {c.uid: o for c, o in zip(unique, outcomes, strict=True)}

    async def unprepare_claims(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        unique = list({c.uid: c for c in claims}.values())
        if len(unique) == 1:
            return {unique[0].uid: await self._unprepare_one(unique[0])}
        errors = await asyncio.gather(*(self._unprepare_one(c) for c in unique))
        return {c.uid: e for c, e in zip(unique, errors, strict=True)}

    async def _prepare_one(self, ref: ClaimRef) -> PrepareOutcome:
        start = time.perf_counter()
        devices: list[PreparedDevice] = []
        error = ""
        outcome = "ok"
        try:
            self._check(ref)
            async with self._claim_locks.hold(ref.uid):
                devices = await self.state.prepare(ref)
        except ClaimError as exc:
            error, outcome = str(exc), exc.kind
        except Exception as exc:  # a bug must cost one claim, not the whole request
            log.exception(
                "prepare failed unexpectedly", claim_uid=clip(ref.uid), namespace=clip(ref.namespace)
            )
            error, outcome = f"internal error: {type(exc).__name__}: {exc}", "retryable"
        self._record("prepare", ref, outcome, error, time.perf_counter() - start)
        return devices, error

    async def _unprepare_one(self, ref: ClaimRef) -> str:
        start = time.perf_counter()
        error = ""
        outcome = "ok"
        try:
            self._check(ref)
            async with self._claim_locks.hold(ref.uid):
                await self.state.unprepare(ref)
        except ClaimError as exc:
            error, outcome = str(exc), exc.kind
        except Exception as exc:
            log.exception(
                "unprepare failed unexpectedly", claim_uid=clip(ref.uid), namespace=clip(ref.namespace)
            )
            error, outcome = f"internal error: {type(exc).__name__}: {exc}", "retryable"
        self._record("unprepare", ref, outcome, error, time.perf_counter() - start)
        return error

    def _record(self, what: str, ref: ClaimRef, outcome: str, error: str, seconds: float) -> None:
        if what == "prepare":
            self.metrics.prepares.labels(outcome=outcome).inc()
            self.metrics.prepare_seconds.observe(seconds)
        else:
            self.metrics.unprepares.labels(outcome=outcome).inc()
            self.metrics.unprepare_seconds.observe(seconds)
        claim_uid, namespace = clip(ref.uid), clip(ref.namespace)
        if outcome == "permanent":
            log.error(f"{what} refused", claim_uid=claim_uid, namespace=namespace, error=error)
        elif outcome == "retryable":
            log.warning(
                f"{what} failed; kubelet will retry", claim_uid=claim_uid, namespace=namespace, error=error
            )


def _dra_service(api: Any) -> type:
    """The kubelet DRA service of one API version (``v1`` or ``v1beta1``: the same messages in
    two packages), answering from the one dispatcher."""

    class DraService(api.DraPluginBase):
        def __init__(self, dispatcher: ClaimDispatcher) -> None:
            self.dispatcher = dispatcher

        async def node_prepare_resources(self, node_prepare_resources_request: Any) -> Any:
            refs = [ClaimRef(c.namespace, c.name, c.uid) for c in node_prepare_resources_request.claims]
            outcomes = await self.dispatcher.prepare_claims(refs)
            return api.NodePrepareResourcesResponse(
                claims={
                    uid: api.NodePrepareResourceResponse(
                        devices=[
                            api.Device(
                                request_names=list(d.request_names),
                                pool_name=d.pool_name,
                                device_name=d.device_name,
                                cdi_device_ids=list(d.cdi_device_ids),
                            )
                            for d in devices
                        ],
                        error=error,
                    )
                    for uid, (devices, error) in outcomes.items()
                }
            )

        async def node_unprepare_resources(self, node_unprepare_resources_request: Any) -> Any:
            refs = [ClaimRef(c.namespace, c.name, c.uid) for c in node_unprepare_resources_request.claims]
            errors = await self.dispatcher.unprepare_claims(refs)
            return api.NodeUnprepareResourcesResponse(
                claims={uid: api.NodeUnprepareResourceResponse(error=e) for uid, e in errors.items()}
            )

    DraService.__name__ = DraService.__qualname__ = f"Dra{api.__name__.rpartition('.')[2].capitalize()}"
    return DraService


DraV1 = _dra_service(dra_v1)
DraV1Beta1 = _dra_service(dra_v1beta1)


class DraServer:
    """Both DRA API versions on one unix socket."""

    def __init__(
        self, dispatcher: ClaimDispatcher, socket_path: Path, max_message_bytes: int = 4 * 1024 * 1024
    ) -> None:
        self.dispatcher = dispatcher
        self.socket_path = socket_path
        self.limits = ServerLimits(
            max_message_bytes=max_message_bytes,
            idle_timeout_s=None,
            max_connections=None,
            message_limit_setting="--dra-max-message-bytes",
        )
        self._server: Server | None = None

    async def start(self) -> None:
        self._server = await start_unix_server(
            [DraV1(self.dispatcher), DraV1Beta1(self.dispatcher)], self.socket_path, limits=self.limits
        )

    async def stop(self) -> None:
        if self._server is not None:
            await stop_unix_server(self._server, self.socket_path)
            self._server = None
