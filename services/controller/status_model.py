"""A domain's status as plain values (status.status, status.nodes, status.conditions).

The controller computes and compares statuses on every reconcile; plain
frozen dataclasses make that cheap, where building and comparing protobuf
objects costs milliseconds for a large domain. They are converted to the
stored protobuf only when a changed status is written.
"""

from __future__ import annotations

from dataclasses import dataclass

from libs.gen.computedomain.state import v1 as pb
from libs.state.proto_wire import bytes_field, varint_field


@dataclass(frozen=True, slots=True)
class NodeEntry:
    """One entry of status.nodes."""

    name: str
    ip_address: str
    clique_id: str
    index: int
    ready: bool


@dataclass(frozen=True, slots=True)
class ConditionEntry:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str
    last_transition_unix_ms: int


@dataclass(frozen=True, slots=True)
class StatusValue:
    """A domain's status as plain values: cheap to build and compare (protobuf objects are not)."""

    ready: bool = False
    nodes: tuple[NodeEntry, ...] = ()
    conditions: tuple[ConditionEntry, ...] = ()
    # "MutualTLS" | "Plaintext" | "" (not decided yet): how the domain's IMEX daemons talk.
    imex_mesh: str = ""

    def to_pb(self) -> pb.ComputeDomainStatus:
        return pb.ComputeDomainStatus(
            status=pb.Readiness.READY if self.ready else pb.Readiness.NOT_READY,
            nodes=[
                pb.NodeStatus(
                    name=n.name,
                    ip_address=n.ip_address,
                    clique_id=n.clique_id,
                    index=n.index,
                    status=pb.Readiness.READY if n.ready else pb.Readiness.NOT_READY,
                )
                for n in self.nodes
            ],
            conditions=[
                pb.Condition(
                    type=c.type,
                    status=c.status,
                    reason=c.reason,
                    message=c.message,
                    last_transition_unix_ms=c.last_transition_unix_ms,
                )
                for c in self.conditions
            ],
            imex_mesh=self.imex_mesh,
        )

    @classmethod
    def from_pb(cls, status: pb.ComputeDomainStatus) -> StatusValue:
        return cls(
            ready=status.status == pb.Readiness.READY,
            nodes=tuple(
                NodeEntry(n.name, n.ip_address, n.clique_id, n.index, n.status == pb.Readiness.READY)
                for n in status.nodes
            ),
            conditions=tuple(
                ConditionEntry(c.type, c.status, c.reason, c.message, c.last_transition_unix_ms)
                for c in status.conditions
            ),
            imex_mesh=status.imex_mesh,
        )

    def condition(self, type_: str) -> ConditionEntry | None:
        for cond in self.conditions:
            if cond.type == type_:
                return cond
        return None


# ---- wire encoding ------------------------------------------------------------------------
# The controller serialises a status on every status write; betterproto takes tens of
# milliseconds for a rack-sized node list, this direct encoder a fraction of one. It writes
# exactly what betterproto writes for computedomain.state.v1.ComputeDomainStatus (proto3:
# fields in number order, defaults omitted; tested byte for byte).


def _string(field: int, value: str) -> bytes:
    return bytes_field(field, value.encode()) if value else b""


_integer = varint_field
_message = bytes_field


def encode_status(status: StatusValue) -> bytes:
    """The serialised `ComputeDomainStatus` of `status`."""
    parts = [_integer(1, int(status.ready))]
    for n in status.nodes:
        node = (
            _string(1, n.name)
            + _string(2, n.ip_address)
            + _string(3, n.clique_id)
            + _integer(4, n.index)
            + _integer(5, int(n.ready))
        )
        parts.append(_message(2, node))
    for c in status.conditions:
        cond = (
            _string(1, c.type)
            + _string(2, c.status)
            + _string(3, c.reason)
            + _string(4, c.message)
            + _integer(5, c.last_transition_unix_ms)
        )
        parts.append(_message(3, cond))
    parts.append(_string(4, status.imex_mesh))
    return b"".join(parts)
