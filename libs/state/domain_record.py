"""The one reading of a stored ComputeDomain that services take: every field, the status kept as
bytes.

A status lists a rack's worth of nodes for a large domain, and decoding it costs milliseconds
(a 256-node domain's full record takes ~50 ms with betterproto); the controller receives every
write of every domain record (its own status writes included), the node and IMEX agents read
the record on every join and every mesh change, the advisor and the benchmarks watch it. This
message has the field numbers of `computedomain.state.v1.ComputeDomain` and the same name, so
the store's codec reads and writes it under the same envelope kind; field 5 (status) is declared
as bytes, which protobuf takes without building it. Those who need the status decode the bytes
(the controller's view, when they change under it); `ready` reads only its readiness.
"""

from __future__ import annotations

from dataclasses import dataclass

import betterproto

from libs.gen.computedomain.state import v1 as pb


@dataclass(eq=False, repr=False)
class StatusReadiness(betterproto.Message):
    """The readiness of a `computedomain.state.v1.ComputeDomainStatus`, its node list skipped."""

    status: pb.Readiness = betterproto.enum_field(1)  # noqa: RUF009 - betterproto declares fields so


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

    @property
    def ready(self) -> bool:
        """Whether the controller reports the domain Ready (its status's readiness only)."""
        return StatusReadiness().parse(self.status).status == pb.Readiness.READY


DomainRecord = ComputeDomain


def from_full(domain: pb.ComputeDomain) -> DomainRecord:
    """The record form of a full message (tests, and callers that built one)."""
    return DomainRecord().parse(bytes(domain))
