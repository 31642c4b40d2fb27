"""Kubelet's side of a DRA plugin: registration (GetInfo) and NodePrepare/UnprepareResources.

Kubelet learns the plugin's DRA socket from ``GetInfo`` on the registration socket, checks the
plugin type, name and that it speaks a DRA gRPC service this kubelet knows (``v1.DRAPlugin`` or
``v1beta1.DRAPlugin`` from 1.34, only the latter on 1.32/1.33; the first of the kubelet's list
that the plugin offers is used), reports the outcome with ``NotifyRegistrationStatus``, and from
then on calls the DRA socket with that service. A failed call (socket gone:
the plugin restarted) makes the shim register again before the next attempt.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpclib.client
import grpclib.exceptions
import structlog

from libs.gen import pluginregistration as reg
from libs.gen.k8s.io.kubelet.pkg.apis.dra import v1 as dra_v1
from libs.gen.k8s.io.kubelet.pkg.apis.dra import v1beta1 as dra_v1beta1
from tools.sim.kubeletshim.pods import ClaimRef
from tools.sim.kubeletshim.release import DRA_V1, DRA_V1BETA1

log = structlog.get_logger(__name__)

PLUGIN_TYPE = "DRAPlugin"
# The two services have the same messages (the gRPC package differs).
_SERVICES: dict[str, Any] = {DRA_V1: dra_v1, DRA_V1BETA1: dra_v1beta1}
NEWEST_KUBELET_SERVICES = (DRA_V1, DRA_V1BETA1)
REGISTRATION_TIMEOUT_S = 10.0

CALL_ERRORS: tuple[type[BaseException], ...] = (
    grpclib.exceptions.GRPCError,
    grpclib.exceptions.StreamTerminatedError,
    ConnectionError,
    OSError,
    TimeoutError,
)


class RegistrationRejected(RuntimeError):
    """The plugin behind the registration socket is not the DRA driver we expect."""


@dataclass(frozen=True)
class PluginInfo:
    name: str
    endpoint: Path
    versions: tuple[str, ...]
    service: str = DRA_V1  # the one the kubelet chose


def registration_socket(kubelet_dir: Path, driver: str) -> Path:
    return kubelet_dir / "plugins_registry" / f"{driver}-reg.sock"


def describe_call_error(exc: BaseException) -> str:
    if isinstance(exc, grpclib.exceptions.GRPCError):
        return f"rpc error: code = {exc.status.name}: {exc.message or ''}".strip()
    if isinstance(exc, FileNotFoundError | ConnectionRefusedError):
        return "DRA plugin socket not available (plugin not running)"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def chosen_service(offered: Sequence[str], services: Sequence[str]) -> str:
    """The first of the kubelet's `services` that the plugin offers ("" = none)."""
    return next((s for s in services if s in offered), "")


def check_info(info: reg.PluginInfo, driver: str, services: Sequence[str] = NEWEST_KUBELET_SERVICES) -> str:
    """Why kubelet would reject this registration ("" = accepted)."""
    if info.type != PLUGIN_TYPE:
        return f"plugin type {info.type!r} is not {PLUGIN_TYPE}"
    if info.name != driver:
        return f"plugin name {info.name!r} is not {driver!r}"
    if not chosen_service(info.supported_versions, services):
        return f"plugin supports {list(info.supported_versions)}, none of {list(services)}"
    if not info.endpoint:
        return "plugin gave no endpoint"
    return ""


async def register(
    kubelet_dir: Path, driver: str, services: Sequence[str] = NEWEST_KUBELET_SERVICES
) -> PluginInfo:
    """GetInfo + NotifyRegistrationStatus; RegistrationRejected when the plugin is not acceptable."""
    channel = grpclib.client.Channel(path=str(registration_socket(kubelet_dir, driver)))
    try:
        stub = reg.RegistrationStub(channel)
        info = await stub.get_info(reg.InfoRequest(), timeout=REGISTRATION_TIMEOUT_S)
        problem = check_info(info, driver, services)
        await stub.notify_registration_status(
            reg.RegistrationStatus(plugin_registered=not problem, error=problem),
            timeout=REGISTRATION_TIMEOUT_S,
        )
    finally:
        channel.close()
    if problem:
        raise RegistrationRejected(problem)
    return PluginInfo(
        info.name,
        Path(info.endpoint),
        tuple(info.supported_versions),
        chosen_service(info.supported_versions, services),
    )


@contextlib.contextmanager
def connection_errors() -> Iterator[None]:
    """grpclib raises ``AttributeError: 'Connection' object has no attribute '_transport'`` when the
    peer goes away mid-call (vmagamedov/grpclib#110, #185): to a caller, as to kubelet, that is a
    lost connection, retried like any other."""
    try:
        yield
    except AttributeError as exc:
        if "_transport" not in str(exc):
            raise
        raise ConnectionResetError("the connection to the plugin was lost during the call") from exc


def _claims(dra: Any, refs: Sequence[ClaimRef]) -> list[Any]:
    return [dra.Claim(namespace=r.namespace, uid=r.uid, name=r.name) for r in refs]


@dataclass(frozen=True)
class PrepareAnswer:
    """The plugin's answer for one claim: its error ("" = prepared) and the CDI devices that kubelet
    would hand the container runtime for it."""

    error: str
    cdi_device_ids: tuple[str, ...] = ()


async def prepare(
    endpoint: Path, refs: Sequence[ClaimRef], timeout_s: float, service: str = DRA_V1
) -> dict[str, PrepareAnswer]:
    """NodePrepareResources; per claim uid the plugin's answer. Raises CALL_ERRORS."""
    dra = _SERVICES[service]
    channel = grpclib.client.Channel(path=str(endpoint))
    try:
        with connection_errors():
            response = await dra.DraPluginStub(channel).node_prepare_resources(
                dra.NodePrepareResourcesRequest(claims=_claims(dra, refs)), timeout=timeout_s
            )
    finally:
        channel.close()
    answers: dict[str, PrepareAnswer] = {}
    for ref in refs:
        result = response.claims.get(ref.uid)
        if result is None:
            answers[ref.uid] = PrepareAnswer(f"the plugin's response has no entry for claim {ref.uid}")
        elif result.error:
            answers[ref.uid] = PrepareAnswer(result.error)
        else:
            answers[ref.uid] = PrepareAnswer("", tuple(i for d in result.devices for i in d.cdi_device_ids))
    return answers


async def unprepare(
    endpoint: Path, refs: Sequence[ClaimRef], timeout_s: float, service: str = DRA_V1
) -> dict[str, str]:
    """NodeUnprepareResources; per claim uid the error ("" = unprepared). Raises CALL_ERRORS."""
    dra = _SERVICES[service]
    channel = grpclib.client.Channel(path=str(endpoint))
    try:
        with connection_errors():
            response = await dra.DraPluginStub(channel).node_unprepare_resources(
                dra.NodeUnprepareResourcesRequest(claims=_claims(dra, refs)), timeout=timeout_s
            )
    finally:
        channel.close()
    errors: dict[str, str] = {}
    for ref in refs:
        result = response.claims.get(ref.uid)
        errors[ref.uid] = (
            f"the plugin's response has no entry for claim {ref.uid}" if result is None else result.error
        )
    return errors
