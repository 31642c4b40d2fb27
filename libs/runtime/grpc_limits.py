"""Limits grpclib's server lacks: request message size, idle connections and a connection count.

grpclib reads any message whole: a request's length prefix is checked here before its body is
read, so a 20 MB message costs the server no more than the HTTP/2 flow-control window and gets
RESOURCE_EXHAUSTED naming the limit. A connection with no call in progress for `idle_timeout_s`
(one that only sent the HTTP/2 preface, or dribbles a request's headers) is sent GOAWAY and
closed; connections past `max_connections` are closed as they arrive. A None limit is no limit.
A request that does not decode is INVALID_ARGUMENT (grpclib would answer UNKNOWN and log a
traceback).
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

from libs.runtime.text_limits import clip

log = structlog.get_logger(__name__)

_PREFIX_BYTES = 5  # gRPC message prefix: compressed flag, 4-byte big-endian length
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # gRPC's usual receive limit


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    idle_timeout_s: float | None = 60.0
    max_connections: int | None = 1024
    # The setting that sets max_message_bytes, named in the refusal.
    message_limit_setting: str = "--grpc-max-message-bytes"


def _bounded_reader(
    recv: Callable[[int], Awaitable[bytes]], limit: int, setting: str
) -> Callable[[int], Awaitable[bytes]]:
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
                    f"request message is {length} bytes; the limit is {limit} bytes ({setting})",
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
        limits = self.limits
        bounded = _bounded_reader(stream.recv_data, limits.max_message_bytes, limits.message_limit_setting)
        stream.recv_data = bounded  # type: ignore[method-assign,assignment]
        super().accept(stream, headers, release_stream)
        self.calls += 1
        self.last_activity = time.monotonic()
        self._tasks[stream].add_done_callback(self._call_done)

    def _call_done(self, _: asyncio.Task[None]) -> None:
        self.calls -= 1
        self.last_activity = time.monotonic()


class LimitedH2Protocol(H2Protocol):
    handler: LimitedHandler
    open_connections: set[LimitedH2Protocol]
    _idle_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        limits = self.handler.limits
        if limits.max_connections is not None and len(self.open_connections) >= limits.max_connections:
            log.warning("gRPC connection refused: too many open", limit=limits.max_connections)
            self._goaway()
            return
        self.open_connections.add(self)
        self.handler.last_activity = time.monotonic()
        if limits.idle_timeout_s is not None:
            self._idle_timer = asyncio.get_running_loop().call_later(limits.idle_timeout_s, self._check_idle)

    def _check_idle(self) -> None:
        timeout = self.handler.limits.idle_timeout_s
        assert timeout is not None
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


class CheckedCodec(CodecBase):
    """Another codec, whose decode failures are the caller's fault: INVALID_ARGUMENT."""

    def __init__(self, inner: CodecBase) -> None:
        self.inner = inner

    @property
    def __content_subtype__(self) -> str:
        return self.inner.__content_subtype__

    def encode(self, message: Any, message_type: Any) -> bytes:
        return self.inner.encode(message, message_type)

    def decode(self, data: bytes, message_type: Any) -> Any:
        try:
            return self.inner.decode(data, message_type)
        except Exception as exc:
            name = getattr(message_type, "__name__", "message")
            raise GRPCError(
                Status.INVALID_ARGUMENT, f"request: not a valid {name}: {clip(str(exc))}"
            ) from None


class LimitedServer(Server):
    """grpclib `Server` with `ServerLimits`; same API. Subclasses may set `protocol_class` to a
    `LimitedH2Protocol` of their own."""

    protocol_class: type[LimitedH2Protocol] = LimitedH2Protocol

    def __init__(self, handlers: Any, *, limits: ServerLimits | None = None, **kwargs: Any) -> None:
        super().__init__(handlers, **kwargs)
        self._codec = CheckedCodec(self._codec)
        self._limits = limits or ServerLimits()
        self._open_connections: set[LimitedH2Protocol] = set()

    def _protocol_factory(self) -> H2Protocol:
        protocol = super()._protocol_factory()
        protocol.__class__ = self.protocol_class
        assert isinstance(protocol, LimitedH2Protocol)
        protocol.handler.__class__ = LimitedHandler
        protocol.handler.limits = self._limits
        protocol.open_connections = self._open_connections
        return protocol
