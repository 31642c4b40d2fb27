"""The simulated kubelet: calls a node agent's DRA socket the way kubelet does.

Kubelet prepares a pod's claims with NodePrepareResources (v1 DRAPlugin, over the plugin's unix
socket) and retries a failed claim until it succeeds, whatever the error: per-claim errors, an
absent socket while the plugin restarts, a call that times out. Here the retries use capped
exponential backoff within an overall deadline, and every distinct error is remembered so a
stuck claim can be explained.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpclib.client
import grpclib.exceptions

from libs.gen.k8s.io.kubelet.pkg.apis.dra import v1 as dra
from libs.runtime.backoff import Backoff
from tools.sim.kubeletshim.plugin import connection_errors

# One call may legitimately take the agent's whole prepare budget (waiting for IMEX READY, 45 s).
CALL_TIMEOUT_S = 60.0
_CALL_ERRORS: tuple[type[BaseException], ...] = (
    grpclib.exceptions.GRPCError,
    grpclib.exceptions.StreamTerminatedError,
    ConnectionError,
    OSError,
    TimeoutError,
)


@dataclass(frozen=True)
class ClaimCall:
    namespace: str
    name: str
    uid: str
    node: str
    socket: Path


@dataclass
class CallOutcome:
    claim: ClaimCall
    ok: bool = False
    attempts: int = 0
    errors: list[str] = field(default_factory=list)
    cdi_device_ids: list[str] = field(default_factory=list)
    finished_unix_ms: int = 0

    @property
    def last_error(self) -> str:
        return self.errors[-1] if self.errors else ""


class DeadlineExceeded(RuntimeError):
    pass


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpclib.exceptions.GRPCError):
        return f"gRPC {exc.status.name}: {exc.message or ''}".strip()
    if isinstance(exc, FileNotFoundError | ConnectionRefusedError):
        return "DRA socket not available (plugin not running)"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _prepare_once(call: ClaimCall) -> tuple[list[str], str]:
    channel = grpclib.client.Channel(path=str(call.socket))
    try:
        stub = dra.DraPluginStub(channel)
        request = dra.NodePrepareResourcesRequest(
            claims=[dra.Claim(namespace=call.namespace, uid=call.uid, name=call.name)]
        )
        with connection_errors():
            response = await stub.node_prepare_resources(request, timeout=CALL_TIMEOUT_S)
    finally:
        channel.close()
    result = response.claims.get(call.uid)
    if result is None:
        return [], f"response has no entry for claim {call.uid}"
    if result.error:
        return [], result.error
    ids = [cdi for device in result.devices for cdi in device.cdi_device_ids]
    return ids, ""


async def _unprepare_once(call: ClaimCall) -> str:
    channel = grpclib.client.Channel(path=str(call.socket))
    try:
        stub = dra.DraPluginStub(channel)
        request = dra.NodeUnprepareResourcesRequest(
            claims=[dra.Claim(namespace=call.namespace, uid=call.uid, name=call.name)]
        )
        with connection_errors():
            response = await stub.node_unprepare_resources(request, timeout=CALL_TIMEOUT_S)
    finally:
        channel.close()
    result = response.claims.get(call.uid)
    if result is None:
        return f"response has no entry for claim {call.uid}"
    return result.error


async def _with_retries(call: ClaimCall, once: str, deadline_s: float) -> CallOutcome:
    outcome = CallOutcome(call)
    backoff = Backoff(initial=0.1, cap=2.0)
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        outcome.attempts += 1
        try:
            if once == "prepare":
                ids, error = await _prepare_once(call)
                outcome.cdi_device_ids = ids
            else:
                error = await _unprepare_once(call)
        except _CALL_ERRORS as exc:
            error = _describe(exc)
        if not error:
            outcome.ok = True
            outcome.finished_unix_ms = int(time.time() * 1000)
            return outcome
        if not outcome.errors or outcome.errors[-1] != error:
            outcome.errors.append(error)
        delay = backoff.next_delay()
        if loop.time() + delay > end:
            outcome.finished_unix_ms = int(time.time() * 1000)
            return outcome
        await asyncio.sleep(delay)


async def prepare(call: ClaimCall, deadline_s: float) -> CallOutcome:
    """NodePrepareResources for one claim, retried like kubelet until it succeeds or the deadline."""
    return await _with_retries(call, "prepare", deadline_s)


async def unprepare(call: ClaimCall, deadline_s: float) -> CallOutcome:
    """NodeUnprepareResources for one claim, retried until it succeeds or the deadline."""
    return await _with_retries(call, "unprepare", deadline_s)
