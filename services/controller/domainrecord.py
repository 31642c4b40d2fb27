"""The controller's reading of a stored ComputeDomain: every field, the status kept as bytes.

The controller receives every write of every domain record (its own status
writes included) and decoding a status that lists a rack's worth of nodes
costs milliseconds. This message has the field numbers of
`computedomain.state.v1.ComputeDomain` and the same name, so the store's
codec reads and writes it under the same envelope kind; only field 5
(status) is declared as bytes, which protobuf skips over without building
it. The view decodes those bytes only when they change under it.
"""

from __future__ import annotations

from dataclasses import dataclass

import betterproto

from libs.gen.computedomain.state import v1 as pb


@dataclass(eq=False, repr=False)
class ComputeDomain(betterproto.Message):
    uid: str = betterproto.string_field(1)
    namespace: str = betterproto.string_field(2)
    name: str = betterproto.string_field(3)
    spec: pb.ComputeDomainSpec = betterproto.message_field(4)  # noqa: RUF009 - betterproto declares fields so
    # A serialised `computedomain.state.v1.ComputeDomainStatus`.
    status: bytes = betterproto.bytes_field(5)
    created_unix_ms: int = betterproto.int64_field(6)
    deleting: bool = betterproto.bool_field(7)
    deletion_requested_unix_ms: int = betterproto.int64_field(8)
    source: str = betterproto.string_field(9)
    mesh_mode: pb.MeshMode = betterproto.enum_field(10)  # noqa: RUF009


DomainRecord = ComputeDomain


def from_full(domain: pb.ComputeDomain) -> DomainRecord:
    """The record form of a full message (tests, and callers that built one)."""
    return DomainRecord().parse(bytes(domain))
