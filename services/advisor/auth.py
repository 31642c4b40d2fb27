"""Who may talk to the advisor, and who a reservation is charged to.

With ``--tls-cert-file``, ``--tls-key-file`` and ``--tls-client-ca-file`` the gRPC TCP listener and
the scheduler extender speak TLS and require a client certificate of that CA (mutual TLS): a pod
without one cannot even complete a handshake. kube-scheduler presents its certificate through the
extender's ``tlsConfig``. The client's identity is its certificate's common name; reservations
made over gRPC are charged to it, whatever ``holder`` the request names, so the per-holder cap
(``--max-reserved-nodes-per-holder``) cannot be dodged by renaming, and a Release is allowed only
to the reservation's holder. The unix socket listener is for local clients (its file mode admits
the advisor's group only); their declared holder stands, as it does without TLS.
"""

from __future__ import annotations

import contextvars
import ssl
from typing import Any

from grpclib.events import RecvRequest, listen
from grpclib.server import Server

# The authenticated client of the gRPC call being handled ("" = none: unix socket or no TLS).
CLIENT_IDENTITY: contextvars.ContextVar[str] = contextvars.ContextVar("advisor_client_identity", default="")


def server_tls_context(cert_file: str, key_file: str, client_ca_file: str, *, http2: bool) -> ssl.SSLContext:
    """A server context that requires a client certificate of `client_ca_file` (TLS 1.2+)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=client_ca_file)
    context.load_cert_chain(cert_file, key_file)
    context.verify_mode = ssl.CERT_REQUIRED
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if http2:
        context.set_alpn_protocols(["h2"])
    return context


def common_name(cert: dict[str, Any] | None) -> str:
    """The subject CN of a peer certificate as ``ssl`` reports it ("" if none)."""
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


def track_client_identity(server: Server) -> None:
    """Set `CLIENT_IDENTITY` for each request from the peer's verified certificate."""

    async def on_request(event: RecvRequest) -> None:
        peer = event.peer
        cert = peer.cert() if peer is not None else None
        CLIENT_IDENTITY.set(common_name(cert))

    listen(server, RecvRequest, on_request)


def charged_holder(declared: str) -> str:
    """Whom a reservation is charged to, and who releases: the authenticated client if there is one."""
    return CLIENT_IDENTITY.get() or declared
