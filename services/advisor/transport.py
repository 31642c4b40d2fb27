"""The advisor's grpclib server: write coalescing, a codec that lets hot handlers take raw bytes,
and the limits grpclib lacks (message size, idle connections, connection count).

grpclib writes each HTTP/2 frame group of a response (headers, data, trailers)
with its own transport.write, i.e. its own send() system call. On small VMs a
send that wakes the peer costs far more than the bytes, so a unary reply costs
three wake-ups. Buffering the writes made during one event-loop iteration and
sending them together keeps the HTTP/2 stream identical and cuts that to one.

grpclib has no receive limit: a request's length prefix is checked here before its body is read,
so a 20 MB message costs the server nothing beyond the HTTP/2 flow-control window. A connection
with no call in progress for `idle_timeout_s` (one that only sent the preface, or dribbles a
request's headers) is sent GOAWAY and closed; connections past `max_connections` are closed as
they arrive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from grpclib import GRPCError
from grpclib.const import Status
from grpclib.encoding.base import CodecBase
from grpclib.protocol import H2Protocol
from grpclib.protocol import Stream as H2Stream
from grpclib.server import Handler, Server

log = structlog.get_logger(__name__)

_PREFIX_BYTES = 5  # gRPC message prefix: compressed flag, 4-byte big-endian length


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_message_bytes: int = 4 * 1024 * 1024
    idle_timeout_s: float = 60.0
    max_connections: int = 1024


class WireCodec(CodecBase):
    """The server's codec: raw bytes for handlers typed `bytes`, protobuf messages otherwise
    (betterproto's, and google.protobuf's for the standard health and reflection services)."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        if message_type is bytes:
            return bytes(message)
        if not isinstance(message, message_type):
            raise TypeError(f"message must be of type {message_type!r}, not {type(message)!r}")
        return bytes(message.SerializeToString())

    def decode(self, data: bytes, message_type: Any) -> Any:
        if message_type is bytes:
            return data
        return message_type.FromString(data)


class CorkedTransport:
    """Wraps an asyncio transport; `write` buffers until the end of the current loop iteration."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._buffer: list[bytes] = []
        self._scheduled = False
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        self._buffer.append(bytes(data))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if not self._buffer:
            return
        data = b"".join(self._buffer)
        self._buffer.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._buffer.clear()
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _bounded_reader(recv: Callable[[int], Awaitable[bytes]], limit: int) -> Callable[[int], Awaitable[bytes]]:
    """grpclib reads each message as a 5-byte prefix, then its body: refuse a body over `limit`
    from its prefix, before reading it."""
    expect_prefix = True

    async def recv_data(size: int) -> bytes:
        nonlocal expect_prefix
        data = await recv(size)
        if not expect_prefix:
            expect_prefix = True
        elif len(data) == _PREFIX_BYTES:
            length = int.from_bytes(data[1:], "big")
            if length > limit:
                raise GRPCError(
                    Status.RESOURCE_EXHAUSTED,
                    f"request message is {length} bytes; the limit is {limit} bytes (--grpc-max-message-bytes)",
                )
            expect_prefix = False
        return data

    return recv_data


class LimitedHandler(Handler):
    """One connection's calls: bounded messages, and a count of calls in progress for the idle timer."""

    limits: ServerLimits
    calls = 0
    last_activity = 0.0

    def accept(self, stream: H2Stream, headers: Any, release_stream: Callable[[], Any]) -> None:
        stream.recv_data = _bounded_reader(stream.recv_data, self.limits.max_message_bytes)  # type: ignore[method-assign,assignment]
        super().accept(stream, headers, release_stream)
        self.calls += 1
        self.last_activity = time.monotonic()
        self._tasks[stream].add_done_callback(self._call_done)

    def _call_done(self, _: asyncio.Task[None]) -> None:
        self.calls -= 1
        self.last_activity = time.monotonic()


class CorkedH2Protocol(H2Protocol):
    handler: LimitedHandler
    open_connections: set[CorkedH2Protocol]
    _idle_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(CorkedTransport(transport))  # type: ignore[arg-type]
        limits = self.handler.limits
        if len(self.open_connections) >= limits.max_connections:
            log.warning("gRPC connection refused: too many open", limit=limits.max_connections)
            self._goaway()
            return
        self.open_connections.add(self)
        self.handler.last_activity = time.monotonic()
        self._idle_timer = asyncio.get_running_loop().call_later(limits.idle_timeout_s, self._check_idle)

    def _check_idle(self) -> None:
        timeout = self.handler.limits.idle_timeout_s
        idle_for = time.monotonic() - self.handler.last_activity
        if self.handler.calls == 0 and idle_for >= timeout:
            log.info("gRPC connection closed: idle", idle_timeout_s=timeout)
            self._idle_timer = None
            self._goaway()
            return
        wait = timeout if self.handler.calls else timeout - idle_for
        self._idle_timer = asyncio.get_running_loop().call_later(wait, self._check_idle)

    def _goaway(self) -> None:
        try:
            self.connection._connection.close_connection()
            self.connection.flush()
        finally:
            self.connection._transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.open_connections.discard(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        super().connection_lost(exc)


class CorkedServer(Server):
    """grpclib `Server` with write coalescing and `ServerLimits`; same API, the advisor's
    `WireCodec` by default."""

    def __init__(self, handlers: Any, *, limits: ServerLimits | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("codec", WireCodec())
        super().__init__(handlers, **kwargs)
        self._limits = limits or ServerLimits()
        self._open_connections: set[CorkedH2Protocol] = set()

    def _protocol_factory(self) -> H2Protocol:
        protocol = super()._protocol_factory()
        protocol.__class__ = CorkedH2Protocol
        assert isinstance(protocol, CorkedH2Protocol)
        protocol.handler.__class__ = LimitedHandler
        protocol.handler.limits = self._limits
        protocol.open_connections = self._open_connections
        return protocol
