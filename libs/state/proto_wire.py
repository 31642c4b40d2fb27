"""Protobuf's wire encoding for the few hot paths that write messages by hand (pure).

betterproto is slow on large or frequent messages; the store's envelope, the controller's status
and the join's pre-serialised records write bytes directly. Each such writer is tested to give
exactly betterproto's bytes.
"""

from __future__ import annotations


def varint(value: int) -> bytes:
    """A varint; a negative value as protobuf writes int32/int64 (ten bytes, two's complement)."""
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def varint_field(number: int, value: int) -> bytes:
    """An integer or enum field (proto3 omits 0)."""
    return varint(number << 3) + varint(value) if value else b""


def bytes_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes or message), written even when empty."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload
