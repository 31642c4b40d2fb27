"""Kubelet's side of a DRA plugin: registration (GetInfo) and NodePrepare/UnprepareResources (v1).

Kubelet learns the plugin's DRA socket from ``GetInfo`` on the registration socket, checks the
plugin type, name and that it speaks ``v1.DRAPlugin``, reports the outcome with
``NotifyRegistrationStatus``, and from then on calls the DRA socket. A failed call (socket gone:
the plugin restarted) makes the shim register again before the next attempt.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpclib.client
import grpclib.exceptions
import structlog

from libs.gen import pluginregistration as reg
from libs.gen.k8s.io.kubelet.pkg.apis.dra import v1 as dra
from tools.kubeletshim.pods import ClaimRef

log = structlog.get_logger(__name__)

PLUGIN_TYPE = "DRAPlugin"
REQUIRED_VERSION = "v1.DRAPlugin"
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


def registration_socket(kubelet_dir: Path, driver: str) -> Path:
    return kubelet_dir / "plugins_registry" / f"{driver}-reg.sock"


def describe_call_error(exc: BaseException) -> str:
    if isinstance(exc, grpclib.exceptions.GRPCError):
        return f"rpc error: code = {exc.status.name}: {exc.message or ''}".strip()
    if isinstance(exc, FileNotFoundError | ConnectionRefusedError):
        return "DRA plugin socket not available (plugin not running)"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def check_info(info: reg.PluginInfo, driver: str) -> str:
    """Why kubelet would reject this registration ("" = accepted)."""
    if info.type != PLUGIN_TYPE:
        return f"plugin type {info.type!r} is not {PLUGIN_TYPE}"
    if info.name != driver:
        return f"plugin name {info.name!r} is not {driver!r}"
    if REQUIRED_VERSION not in info.supported_versions:
        return f"plugin supports {list(info.supported_versions)}, not {REQUIRED_VERSION}"
    if not info.endpoint:
        return "plugin gave no endpoint"
    return ""


async def register(kubelet_dir: Path, driver: str) -> PluginInfo:
    """GetInfo + NotifyRegistrationStatus; RegistrationRejected when the plugin is not acceptable."""
    channel = grpclib.client.Channel(path=str(registration_socket(kubelet_dir, driver)))
    try:
        stub = reg.RegistrationStub(channel)
        info = await stub.get_info(reg.InfoRequest(), timeout=REGISTRATION_TIMEOUT_S)
        problem = check_info(info, driver)
        await stub.notify_registration_status(
            reg.RegistrationStatus(plugin_registered=not problem, error=problem),
            timeout=REGISTRATION_TIMEOUT_S,
        )
    finally:
        channel.close()
    if problem:
        raise RegistrationRejected(problem)
    return PluginInfo(info.name, Path(info.endpoint), tuple(info.supported_versions))


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


def _claims(refs: Sequence[ClaimRef]) -> list[dra.Claim]:
    return [dra.Claim(namespace=r.namespace, uid=r.uid, name=r.name) for r in refs]


async def prepare(endpoint: Path, refs: Sequence[ClaimRef], timeout_s: float) -> dict[str, str]:
    """NodePrepareResources; per claim uid the error ("" = prepared). Raises CALL_ERRORS."""
    channel = grpclib.client.Channel(path=str(endpoint))
    try:
        with connection_errors():
            response = await dra.DraPluginStub(channel).node_prepare_resources(
                dra.NodePrepareResourcesRequest(claims=_claims(refs)), timeout=timeout_s
            )
    finally:
        channel.close()
    errors: dict[str, str] = {}
    for ref in refs:
        result = response.claims.get(ref.uid)
        if result is None:
            errors[ref.uid] = f"the plugin's response has no entry for claim {ref.uid}"
        elif result.error:
            errors[ref.uid] = result.error
        else:
            errors[ref.uid] = ""
    return errors


async def unprepare(endpoint: Path, refs: Sequence[ClaimRef], timeout_s: float) -> dict[str, str]:
    """NodeUnprepareResources; per claim uid the error ("" = unprepared). Raises CALL_ERRORS."""
    channel = grpclib.client.Channel(path=str(endpoint))
    try:
        with connection_errors():
            response = await dra.DraPluginStub(channel).node_unprepare_resources(
                dra.NodeUnprepareResourcesRequest(claims=_claims(refs)), timeout=timeout_s
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
