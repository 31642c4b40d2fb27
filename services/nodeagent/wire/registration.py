"""Kubelet plugin registration: ``pluginregistration.Registration`` on the registry socket.

Kubelet watches ``<kubelet dir>/plugins_registry/``, calls ``GetInfo`` on each socket that
appears, and reports the outcome with ``NotifyRegistrationStatus``. A rejection is kept as a
health problem (``/healthz`` shows it) until a later registration succeeds.
"""

from __future__ import annotations

from pathlib import Path

import structlog
from grpclib.server import Server

from libs.contract.names import DRIVER_NAME
from libs.gen import pluginregistration as reg
from libs.runtime.health import Health
from services.nodeagent.wire.unix_socket import start_unix_server, stop_unix_server

log = structlog.get_logger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
HEALTH_PROBLEM = "kubelet-registration"


def registration_socket_path(kubelet_dir: Path) -> Path:
    return kubelet_dir / "plugins_registry" / f"{DRIVER_NAME}-reg.sock"


class RegistrationService(reg.RegistrationBase):
    def __init__(self, endpoint: Path, health: Health) -> None:
        self.endpoint = endpoint
        self.health = health
        self.registered = False

    async def get_info(self, info_request: reg.InfoRequest) -> reg.PluginInfo:
        log.info("kubelet asked for plugin info", endpoint=str(self.endpoint))
        return reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=DRIVER_NAME,
            endpoint=str(self.endpoint),
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    async def notify_registration_status(
        self, registration_status: reg.RegistrationStatus
    ) -> reg.RegistrationStatusResponse:
        self.registered = registration_status.plugin_registered
        if registration_status.plugin_registered:
            log.info("registered with kubelet")
            self.health.clear_problem(HEALTH_PROBLEM)
        else:
            error = registration_status.error or "no reason given"
            log.error("kubelet rejected plugin registration", error=error)
            self.health.set_problem(HEALTH_PROBLEM, f"kubelet rejected the plugin registration: {error}")
        return reg.RegistrationStatusResponse()


class RegistrationServer:
    def __init__(self, service: RegistrationService, socket_path: Path) -> None:
        self.service = service
        self.socket_path = socket_path
        self._server: Server | None = None

    async def start(self) -> None:
        self._server = await start_unix_server([self.service], self.socket_path)

    async def stop(self) -> None:
        if self._server is not None:
            await stop_unix_server(self._server, self.socket_path)
            self._server = None
