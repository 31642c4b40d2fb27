"""Settings of `cd-controller` (flags `--name`, environment `CD_NAME`)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from libs.runtime.settings import fraction, non_negative, positive, setting
from libs.state.config import EtcdSettings


def _default_identity() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class ControllerSettings(EtcdSettings):
    leader_lease_ttl_s: int = setting(
        5, "leader lease TTL, seconds: a standby takes over within it", validate=positive
    )
    leader_election_name: str = setting("cd-controller", "name of the leader election key")
    identity: str = setting("", "this replica's name in the leader record (default host-pid)")
    workers: int = setting(4, "concurrent reconcile workers", validate=positive)
    orphan_grace_s: float = setting(
        30.0, "age after which records of a missing domain are released", validate=non_negative
    )
    resync_period_s: float = setting(300.0, "every domain is reconciled again this often", validate=positive)
    reconcile_busy_share: float = setting(
        0.25,
        "share of the time one domain may keep a worker busy: after a reconcile of d s its events "
        "are coalesced for d*(1/share-1) s, at most 1 s (1 = reconcile on every event)",
        validate=fraction,
    )
    imex_mesh_tls: bool = setting(
        True,
        "new domains get mutual TLS between their IMEX daemons, with certificates of a CA of their own "
        "(false: plaintext, for IMEX versions or sites without TLS); a domain keeps the mode it got",
    )
    imex_mesh_certificate_validity_s: float = setting(
        24 * 3600.0, "lifetime of a node's IMEX mesh certificate (renewed at two thirds)", validate=positive
    )
    health_host: str = setting("0.0.0.0", "address of the /healthz, /readyz, /metrics server")
    health_port: int = setting(8081, "port of the health server (0 = any free port)", validate=non_negative)
    log_format: str = setting("auto", "log format", choices=("json", "console", "auto"))
    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error"))
    mode: str = setting("simulation", "where ComputeDomains come from", choices=("simulation", "kubernetes"))
    kubeconfig: str = setting("", "kubeconfig file (kubernetes mode; empty = in-cluster config)")
    sweep_interval_s: float = setting(
        300.0, "kubernetes mode: period of the sweep of objects whose CD is gone", validate=positive
    )

    @property
    def holder(self) -> str:
        return self.identity or _default_identity()
