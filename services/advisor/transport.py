"""The advisor's grpclib server: write coalescing and a codec that lets hot handlers take raw bytes
(on `libs.runtime.grpc_limits.LimitedServer`, for the limits grpclib lacks).

grpclib writes each HTTP/2 frame group of a response (headers, data, trailers)
with its own transport.write, i.e. its own send() system call. On small VMs a
send that wakes the peer costs far more than the bytes, so a unary reply costs
three wake-ups. Buffering the writes made during one event-loop iteration and
sending them together keeps the HTTP/2 stream identical and cuts that to one.
"""

from __future__ import annotations

import asyncio
from typing import Any

from grpclib.encoding.base import CodecBase

from libs.runtime.grpc_limits import LimitedH2Protocol, LimitedServer


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


class CorkedH2Protocol(LimitedH2Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(CorkedTransport(transport))  # type: ignore[arg-type]


class CorkedServer(LimitedServer):
    """`LimitedServer` with write coalescing; same API, the advisor's `WireCodec` by default."""

    protocol_class = CorkedH2Protocol

    def __init__(self, handlers: Any, **kwargs: Any) -> None:
        kwargs.setdefault("codec", WireCodec())
        super().__init__(handlers, **kwargs)
