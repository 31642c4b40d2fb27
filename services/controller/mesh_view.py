"""What the controller's view holds of the IMEX mesh credentials, fed by three watches.

Only what decisions need: which domains have a CA (never the key: the reconciler reads it from
the store when it signs), each node's pending request by its digest, and which request each
stored certificate answers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import betterproto

from libs.gen.computedomain.state import v1 as pb
from libs.state.keys import Keys
from libs.state.watch import Resync, WatchEvent

M = TypeVar("M", bound=betterproto.Message)
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class MeshRequestRecord:
    sha256: str  # of csr_pem: a certificate answers exactly one request
    requested_unix_ms: int
    mod_revision: int
    csr_pem: bytes = b""  # kept (a few hundred bytes): signing then needs no store read


def request_digest(csr_pem: bytes) -> str:
    return hashlib.sha256(csr_pem).hexdigest()


def _split(key: str, prefix: str, parts: int) -> list[str] | None:
    if not key.startswith(prefix):
        return None
    segments = key[len(prefix) :].split("/")
    return segments if len(segments) == parts and all(segments) else None


class MeshView:
    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self.authorities: set[str] = set()
        self.requests: dict[str, dict[str, MeshRequestRecord]] = {}
        # domain uid -> node -> digest of the request its certificate answers
        self.certificates: dict[str, dict[str, str]] = {}

    def uids(self) -> set[str]:
        return self.authorities | set(self.requests) | set(self.certificates)

    def apply_authorities(self, event: WatchEvent[pb.MeshAuthority] | Resync[pb.MeshAuthority]) -> set[str]:
        prefix = self.keys.mesh_authorities()
        if isinstance(event, Resync):
            before = self.authorities
            self.authorities = {t[0] for i in event.items if (t := _split(i.key, prefix, 1))}
            return before ^ self.authorities
        tail = _split(event.key, prefix, 1)
        if tail is None:
            return set()
        (self.authorities.discard if event.value is None else self.authorities.add)(tail[0])
        return {tail[0]}

    def apply_requests(
        self, event: WatchEvent[pb.MeshCertificateRequest] | Resync[pb.MeshCertificateRequest]
    ) -> set[str]:
        def record(value: pb.MeshCertificateRequest, revision: int) -> MeshRequestRecord:
            return MeshRequestRecord(
                request_digest(value.csr_pem), value.requested_unix_ms, revision, value.csr_pem
            )

        return _apply(self.requests, self.keys.all_mesh_requests(), event, record)

    def apply_certificates(
        self, event: WatchEvent[pb.MeshCertificate] | Resync[pb.MeshCertificate]
    ) -> set[str]:
        return _apply(
            self.certificates, self.keys.all_mesh_certificates(), event, lambda v, _: v.request_sha256
        )


def _apply(
    table: dict[str, dict[str, R]],
    prefix: str,
    event: WatchEvent[M] | Resync[M],
    record: Callable[[M, int], R],
) -> set[str]:
    if isinstance(event, Resync):
        before = set(table)
        table.clear()
        for item in event.items:
            tail = _split(item.key, prefix, 2)
            if tail is not None:
                table.setdefault(tail[0], {})[tail[1]] = record(item.value, item.mod_revision)
        return before | set(table)
    tail = _split(event.key, prefix, 2)
    if tail is None:
        return set()
    uid, node = tail
    if event.value is None:  # deleted, or undecodable: absent, as in a listing
        by_node = table.get(uid)
        if by_node is not None:
            by_node.pop(node, None)
            if not by_node:
                del table[uid]
    else:
        table.setdefault(uid, {})[node] = record(event.value, event.revision)
    return {uid}
