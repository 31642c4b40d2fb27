"""A light reading of a stored ComputeDomain: the fields that gate joins and the IMEX mesh, and
its (small) spec.

The record carries the status, a rack's worth of nodes for a large domain; callers that only ask
"does it exist, is it deleting, which mesh mode, how many nodes" should not parse it. The message has the field
numbers and the name of `computedomain.state.v1.ComputeDomain`, so the store's codec reads the
same stored kind; protobuf skips the fields it does not declare.
"""

from __future__ import annotations

from dataclasses import dataclass

import betterproto

from libs.gen.computedomain.state import v1 as pb


@dataclass(eq=False, repr=False)
class ComputeDomain(betterproto.Message):
    uid: str = betterproto.string_field(1)
    spec: pb.ComputeDomainSpec = betterproto.message_field(4)  # noqa: RUF009
    deleting: bool = betterproto.bool_field(7)
    mesh_mode: pb.MeshMode = betterproto.enum_field(10)  # noqa: RUF009 - betterproto declares fields so


DomainGate = ComputeDomain
