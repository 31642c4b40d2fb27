"""An aetcd client that also speaks TLS.

aetcd opens an insecure channel only; etcd deployments with client
certificates need a secure one, so `connect` is specialised here. Channel
options keep gRPC's reconnect backoff short, so a restarted etcd is found again
within a second or two rather than gRPC's default of up to two minutes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aetcd
import grpc
from aetcd import rpc, watcher

from libs.state.config import EtcdConfig

CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    # Pings only while calls are open: etcd answers pings on idle connections with
    # GOAWAY "too_many_pings" (its enforcement policy forbids them).
    "grpc.keepalive_time_ms": 30_000,
    "grpc.keepalive_timeout_ms": 10_000,
    "grpc.keepalive_permit_without_calls": 0,
    "grpc.max_receive_message_length": 64 * 1024 * 1024,
}


class TlsCapableClient(aetcd.Client):
    def __init__(self, config: EtcdConfig) -> None:
        super().__init__(
            host=config.host,
            port=config.port,
            username=config.username,
            password=config.password,
            timeout=config.timeout_s,  # aetcd hands it to gRPC, which takes a float
            options=dict(CHANNEL_OPTIONS),
        )
        self._config = config

    def _credentials(self) -> grpc.ChannelCredentials:
        cfg = self._config
        assert cfg.ca_file is not None
        cert = Path(cfg.cert_file).read_bytes() if cfg.cert_file else None
        key = Path(cfg.key_file).read_bytes() if cfg.key_file else None
        return grpc.ssl_channel_credentials(
            root_certificates=Path(cfg.ca_file).read_bytes(), private_key=key, certificate_chain=cert
        )

    async def connect(self) -> None:
        if not self._config.tls:
            await super().connect()
            return
        if self._connected.is_set():
            return
        target = f"{self._host}:{self._port}"
        self.channel = rpc.secure_channel(target, self._credentials(), options=list(self._options.items()))
        if self._username is not None and self._password is not None:
            self.auth_stub = rpc.AuthStub(self.channel)
            resp = await self.auth_stub.Authenticate(
                rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout
            )
            self.metadata = (("token", resp.token),)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(
            rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
        )
        self._connected.set()
