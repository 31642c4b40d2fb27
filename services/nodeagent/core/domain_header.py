"""The identity of a ComputeDomain record without its spec and status (the prepare hot path).

A prepare needs to know that the domain exists, its namespace and whether it is being deleted.
Decoding the whole record costs milliseconds once the status lists a rack's worth of nodes;
this reads the same stored value (envelope kind and schema version checked as
``libs.state.codec`` does) into a message that declares only the identity fields, so protobuf
skips the spec and status bytes without building them.
"""

from __future__ import annotations

from dataclasses import dataclass

import betterproto
import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.state.codec import SCHEMA_VERSION, kind_of

log = structlog.get_logger(__name__)

_KIND = kind_of(pb.ComputeDomain)


@dataclass(eq=False, repr=False)
class DomainHeader(betterproto.Message):
    """Fields 1-3, 7 and 9 of ``computedomain.state.v1.ComputeDomain`` (same numbers)."""

    uid: str = betterproto.string_field(1)
    namespace: str = betterproto.string_field(2)
    name: str = betterproto.string_field(3)
    deleting: bool = betterproto.bool_field(7)
    source: str = betterproto.string_field(9)


def decode_domain_header(data: bytes, key: str) -> DomainHeader | None:
    """The header of a stored ComputeDomain value, or None (logged) when it is undecodable."""
    try:
        envelope = pb.Envelope().parse(data)
        if envelope.kind != _KIND:
            raise ValueError(f"kind {envelope.kind!r}, expected {_KIND!r}")
        if not 0 < envelope.schema_version <= SCHEMA_VERSION:
            raise ValueError(
                f"schema version {envelope.schema_version} (this build reads 1..{SCHEMA_VERSION})"
            )
        return DomainHeader().parse(envelope.payload)
    except Exception as exc:  # betterproto raises several types on bad input
        log.error("skipping undecodable value", key=key, reason=f"{type(exc).__name__}: {exc}")
        return None
