"""A light reading of a stored ComputeDomain: whether it is Ready, without its node list.

Waiting for a large domain to turn Ready means reading every status write of the controller; the
full record of a 256-node domain takes ~50 ms to decode with betterproto, this ~4 ms. Same field
numbers and message name as `computedomain.state.v1.ComputeDomain` (the store's codec checks the
kind by name); protobuf skips the fields it does not declare, the node list included.
"""

from __future__ import annotations

from dataclasses import dataclass

import betterproto

from libs.gen.computedomain.state import v1 as pb


@dataclass(eq=False, repr=False)
class StatusReadiness(betterproto.Message):
    status: pb.Readiness = betterproto.enum_field(1)  # noqa: RUF009 - betterproto declares fields so


@dataclass(eq=False, repr=False)
class ComputeDomain(betterproto.Message):
    uid: str = betterproto.string_field(1)
    status: StatusReadiness = betterproto.message_field(5)  # noqa: RUF009

    @property
    def ready(self) -> bool:
        return self.status.status == pb.Readiness.READY


DomainReadiness = ComputeDomain
