"""The scheduler extender's reservation ids: fixed per domain and sequence, and unguessable.

An extender reservation's id is ``cd-<domain uid>-<n>-<tag>``, the tag an HMAC of domain and
sequence under a key every advisor replica shares (``advisorkey`` in the store, made by the first
replica to start). The id is fixed, so two replicas placing the same domain's first pods cannot
both reserve (the second finds the id taken); the tag makes it unguessable, so no client can name
it in a Release or plant a reservation the reaper would take for the extender's. Ids without a
valid tag (``cd-<uid>-<n>`` of older advisors) still count for the next sequence, but are never
taken for the extender's: they expire with their TTL.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store, with_retries

KEY_BYTES = 32
# 128 bits of the HMAC: as hard to guess as a random UUID.
TAG_HEX = 32


class ExtenderIds:
    """Makes and recognises the extender's reservation ids under one key."""

    def __init__(self, key: bytes | None = None) -> None:
        # Without a shared key (one advisor, tests) a key of this process's own.
        self.key = key if key is not None else secrets.token_bytes(KEY_BYTES)
        if len(self.key) < 16:
            raise ValueError(f"reservation id key too short ({len(self.key)} bytes): at least 16")

    def _tag(self, domain_uid: str, sequence: int) -> str:
        digest = hmac.new(self.key, f"{domain_uid}/{sequence}".encode(), hashlib.sha256).hexdigest()
        return digest[:TAG_HEX]

    def make(self, domain_uid: str, sequence: int) -> str:
        return f"cd-{domain_uid}-{sequence}-{self._tag(domain_uid, sequence)}"

    def sequence_of(self, domain_uid: str, reservation_id: str) -> int | None:
        """The sequence of one of our ids for this domain; None for any other id."""
        found = _pattern(domain_uid).fullmatch(reservation_id)
        if found is None or found.group(2) is None:
            return None
        sequence = int(found.group(1))
        return sequence if hmac.compare_digest(found.group(2), self._tag(domain_uid, sequence)) else None

    @staticmethod
    def next_sequence(domain_uid: str, existing_ids: Iterable[str]) -> int:
        """One past the highest sequence of the domain's extender ids (tagged or not)."""
        pattern = _pattern(domain_uid)
        numbers = [int(m.group(1)) for rid in existing_ids if (m := pattern.fullmatch(rid))]
        return max(numbers, default=-1) + 1


def _pattern(domain_uid: str) -> re.Pattern[str]:
    return re.compile(rf"cd-{re.escape(domain_uid)}-(\d+)(?:-([0-9a-f]{{{TAG_HEX}}}))?")


async def shared_key(store: Store, deadline_s: float = 30.0) -> bytes:
    """The replicas' key: created by the first replica (if absent), read by every other."""
    key = store.keys.advisor_id_key()

    async def create_or_read() -> bytes:
        await store.create(key, pb.AdvisorIdKey(key=secrets.token_bytes(KEY_BYTES)))
        current = await store.get(key, pb.AdvisorIdKey, strict=True)
        if current is None or len(current.value.key) < 16:
            raise ValueError(f"{key} holds no usable reservation id key")
        return current.value.key

    result: bytes = await with_retries(
        create_or_read, what="read the reservation id key", deadline_s=deadline_s
    )
    return result
