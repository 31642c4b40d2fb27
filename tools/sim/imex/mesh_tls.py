"""Mutual TLS between simulated daemons (``IMEX_ENABLE_AUTH_ENCRYPTION=1``, ``SSL_TLS``, files).

The links stay non-blocking on one epoll thread, so TLS runs over memory BIOs: ``TlsChannel``
feeds the bytes read from the socket in and hands back the bytes to send. A dialler verifies the
server's certificate against the name it dialled (the nodes config's entry, or
``IMEX_SECURITY_TARGET_OVERRIDE``); the acceptor requires a client certificate from its CA and,
at HELLO, checks that it names the slot of the node ID the dialler claims. Credentials are read at
start (an unusable file stops the daemon, as nvidia-imex refuses to initialise) and again at
SIGUSR1; a failed reload keeps the previous ones.
"""

from __future__ import annotations

import ssl

from tools.sim.imex.settings import ConfigError, MeshTlsPaths


class MeshTls:
    def __init__(self, paths: MeshTlsPaths, target_override: str) -> None:
        self.paths = paths
        self.target_override = target_override
        self.server, self.client = self._contexts()

    def _contexts(self) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        p = self.paths
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        for context, key, cert, ca, side in (
            (server, p.server_key, p.server_cert, p.server_ca, "IMEX_SERVER"),
            (client, p.client_key, p.client_cert, p.client_ca, "IMEX_CLIENT"),
        ):
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                context.load_cert_chain(cert, key)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"cannot load {side}_CERT {cert} with {side}_KEY {key}: {_why(exc)}"
                ) from None
            try:
                context.load_verify_locations(cafile=ca)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"cannot load {side}_CERT_AUTH {ca}: {_why(exc)}") from None
            context.verify_mode = ssl.CERT_REQUIRED
        client.check_hostname = True
        return server, client

    def reload(self) -> str:
        """Re-read every file; "" on success, else why the previous credentials stay."""
        try:
            self.server, self.client = self._contexts()
        except ConfigError as exc:
            return str(exc)
        return ""

    def accept(self) -> TlsChannel:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        return TlsChannel(self.server.wrap_bio(incoming, outgoing, server_side=True), incoming, outgoing)

    def dial(self, name: str) -> TlsChannel:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        target = self.target_override or name
        return TlsChannel(
            self.client.wrap_bio(incoming, outgoing, server_hostname=target), incoming, outgoing
        )


class TlsError(Exception):
    """The TLS session failed; the message says why in the daemon log's words."""


class TlsChannel:
    """One connection's TLS state over memory BIOs."""

    __slots__ = ("established", "incoming", "obj", "outgoing")

    def __init__(self, obj: ssl.SSLObject, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO) -> None:
        self.obj = obj
        self.incoming = incoming
        self.outgoing = outgoing
        self.established = False

    def receive(self, data: bytes) -> bytes:
        """Feed raw bytes from the socket; return the plaintext now readable (TlsError on failure)."""
        self.incoming.write(data)
        if not self.established and not self._handshake():
            return b""
        out = bytearray()
        while True:
            try:
                chunk = self.obj.read(65536)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:
                raise TlsError("the peer closed the TLS session") from None
            except ssl.SSLError as exc:
                raise TlsError(f"TLS error: {_why(exc)}") from None
            if not chunk:
                break
            out += chunk
        return bytes(out)

    def start(self) -> None:
        """The dialler's first flight."""
        self._handshake()

    def _handshake(self) -> bool:
        try:
            self.obj.do_handshake()
        except ssl.SSLWantReadError:
            return False
        except ssl.SSLCertVerificationError as exc:
            raise TlsError(f"certificate verification failed: {exc.verify_message or _why(exc)}") from None
        except ssl.SSLError as exc:
            raise TlsError(f"TLS handshake failed: {_why(exc)}") from None
        self.established = True
        return True

    def encrypt(self, data: bytes) -> None:
        self.obj.write(data)

    def pending(self) -> bytes:
        """Bytes TLS wants sent (handshake flights and records)."""
        return self.outgoing.read()

    def peer_dns_names(self) -> list[str]:
        cert = self.obj.getpeercert() or {}
        names = cert.get("subjectAltName", ())
        return [str(entry[1]) for entry in names if isinstance(entry, tuple) and entry[0] == "DNS"]


def _why(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason).replace("_", " ").lower() if reason else str(exc)
