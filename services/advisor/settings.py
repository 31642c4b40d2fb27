"""Settings of `cd-placement-advisor` (flags `--name`, environment `CD_ADVISOR_NAME`)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from libs.runtime.settings import non_negative, positive, setting
from libs.state.config import EtcdConfig, EtcdSettings


def _default_identity() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class AdvisorSettings(EtcdSettings):
    grpc_host: str = setting("0.0.0.0", "address of the PlacementAdvisor gRPC server ('' = no TCP listener)")
    grpc_port: int = setting(50061, "port of the gRPC server (0 = any free port)", validate=non_negative)
    grpc_unix_socket: str = setting("", "also serve gRPC on this unix socket path")
    grpc_max_message_bytes: int = setting(
        4 * 1024 * 1024,
        "largest gRPC request message taken (larger: RESOURCE_EXHAUSTED naming the limit)",
        validate=positive,
    )
    max_connections: int = setting(
        1024,
        "connections the gRPC server, and the extender, each keep open at a time (more are closed at once)",
        validate=positive,
    )
    idle_timeout_s: float = setting(
        60.0,
        "a gRPC or extender connection with no call in progress for this long is closed; also the time "
        "an extender request has to arrive whole, headers and body (slow senders are cut off)",
        validate=positive,
    )
    max_field_bytes: int = setting(
        253,
        "longest holder, domain_uid, reservation_id or node name taken (a Kubernetes name's limit); "
        "checked before any store write",
        validate=positive,
    )
    extender_enabled: bool = setting(True, "serve the kube-scheduler extender")
    extender_host: str = setting("0.0.0.0", "address of the kube-scheduler extender HTTP server")
    extender_port: int = setting(8888, "port of the extender (0 = any free port)", validate=non_negative)
    extender_prefix: str = setting("/", "URL prefix of the extender (kube-scheduler's urlPrefix path)")
    extender_filter_verb: str = setting("filter", "filterVerb of the extender")
    extender_prioritize_verb: str = setting("prioritize", "prioritizeVerb of the extender")
    extender_max_body_bytes: int = setting(
        32 * 1024 * 1024,
        "largest extender request body taken (larger: HTTP 413); 32 MiB holds ~8,000 whole Nodes",
        validate=positive,
    )
    extender_reservation_ttl_s: int = setting(
        300,
        "longest time nodes reserved for a domain's pods are held (released sooner once all are bound "
        "to the domain, or when the domain is deleted)",
        validate=positive,
    )
    template_source: str = setting(
        "store",
        "where the extender learns a claim template's domain: the mirrored domains in the store, "
        "or a GET of the ResourceClaimTemplate from Kubernetes",
        choices=("store", "kubernetes"),
    )
    kubeconfig: str = setting("", "kubeconfig file (template-source=kubernetes; empty = in-cluster config)")
    resource_api_version: str = setting(
        "",
        "version of resource.k8s.io to read templates from: v1, v1beta2 or v1beta1 (empty = the one the API "
        "server prefers)",
    )
    default_reservation_ttl_s: int = setting(60, "TTL of a reservation that names none", validate=positive)
    max_reservation_ttl_s: int = setting(600, "largest TTL a client may ask for", validate=positive)
    max_reserved_nodes_per_holder: int = setting(
        1024,
        "nodes one gRPC client may hold reserved at a time (the extender's own reservations for "
        "scheduled pods are not capped; 0 = no cap)",
        validate=non_negative,
    )
    tls_cert_file: str = setting(
        "", "server certificate: with the key and client CA, mutual TLS on gRPC and extender"
    )
    tls_key_file: str = setting("", "server key (with --tls-cert-file)")
    tls_client_ca_file: str = setting(
        "", "CA of the client certificates the gRPC API and the extender require (mutual TLS)"
    )
    healthy_only: bool = setting(True, "offer only healthy nodes (false: DEGRADED nodes too)")
    health_host: str = setting("0.0.0.0", "address of the /healthz, /readyz, /metrics server")
    health_port: int = setting(8082, "port of the health server (0 = any free port)", validate=non_negative)
    identity: str = setting("", "this replica's name as reservation holder (default host-pid)")
    event_loop: str = setting(
        "auto",
        "asyncio event loop: uvloop if installed (auto), or the standard one",
        choices=("auto", "uvloop", "asyncio"),
    )
    log_format: str = setting("auto", "log format", choices=("json", "console", "auto"))
    log_level: str = setting("info", "log level", choices=("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        tls = (self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
        if any(tls) and not all(tls):
            raise ValueError(
                "mutual TLS needs all of --tls-cert-file, --tls-key-file and --tls-client-ca-file"
            )

    @property
    def holder(self) -> str:
        return self.identity or _default_identity()

    def etcd_config(self) -> EtcdConfig:
        return EtcdConfig.from_settings(self)
