"""Store writes of the Kubernetes adapter: the domain record mirroring a CR.

Each write is one transaction carrying the leader fence and comparing the
revision it read, so it neither lands after a failover nor overwrites a
status or deletion mark written meanwhile.
"""

from __future__ import annotations

import dataclasses
import time

import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.state.domain_record import DomainRecord
from libs.state.election import Leadership
from libs.state.store import Absent, Put, Store, Unchanged

log = structlog.get_logger(__name__)


async def create_domain(store: Store, domain: pb.ComputeDomain, leadership: Leadership) -> bool:
    key = store.keys.domain(domain.uid)
    result = await store.txn([leadership.fence, Absent(key)], [Put(key, domain)])
    if result.succeeded:
        log.info("domain mirrored", cd_uid=domain.uid, cd=domain.name, namespace=domain.namespace)
    return result.succeeded


async def update_spec(
    store: Store, current: DomainRecord, revision: int, desired: pb.ComputeDomain, leadership: Leadership
) -> bool:
    """Carry the CR's spec (and names) over, keeping status and deletion state."""
    updated = dataclasses.replace(current, spec=desired.spec, name=desired.name, namespace=desired.namespace)
    key = store.keys.domain(current.uid)
    result = await store.txn([leadership.fence, Unchanged(key, revision)], [Put(key, updated)])
    return result.succeeded


async def mark_deleting(store: Store, current: DomainRecord, revision: int, leadership: Leadership) -> bool:
    if current.deleting:
        return True
    updated = dataclasses.replace(current, deleting=True, deletion_requested_unix_ms=int(time.time() * 1000))
    key = store.keys.domain(current.uid)
    result = await store.txn([leadership.fence, Unchanged(key, revision)], [Put(key, updated)])
    if result.succeeded:
        log.info(
            "domain deletion requested", cd_uid=current.uid, cd=current.name, namespace=current.namespace
        )
    return result.succeeded
