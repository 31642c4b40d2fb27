"""Batched single-key reads and writes of concurrent claims, against a real etcd."""

from __future__ import annotations

import asyncio

import pytest

from libs.contract.names import DRIVER_NAME
from libs.gen.computedomain.state import v1 as pb
from libs.state.config import EtcdConfig
from libs.state.store import Store
from services.nodeagent.core.claim import ClaimRef
from services.nodeagent.core.errors import ClaimGone
from services.nodeagent.shell.state import STORE_FAILURES
from services.nodeagent.shell.store_batch import BatchedReads, StoreBatch
from services.nodeagent.wire.claim_source import StoreClaimSource
from tests.nodeagent.agent_fakes import new_uid, put_claim, put_domain
from tools.etcd.server import EtcdServer


def _record(uid: str, state: pb.PreparedState = pb.PreparedState.PREPARE_COMPLETED) -> pb.PreparedClaim:
    return pb.PreparedClaim(
        claim_uid=uid, namespace="ns", name="c", node_name="n1", domain_uid="cd", state=state
    )


async def test_concurrent_writes_share_transactions_and_all_land(store: Store) -> None:
    batch = StoreBatch(store)
    keys = [store.keys.preparation("n1", f"claim-{i}") for i in range(40)]
    revisions = await asyncio.gather(*(batch.put(k, _record(k)) for k in keys))
    for key in keys:
        got = await store.get(key, pb.PreparedClaim)
        assert got is not None and got.value.claim_uid == key
    assert all(r > 0 for r in revisions)
    # The first write goes alone, the 39 others wait for it and go together.
    assert batch.transactions <= 3, f"{batch.transactions} transactions for 40 concurrent writes"

    await asyncio.gather(*(batch.delete(k) for k in keys))
    assert [await store.get(k, pb.PreparedClaim) for k in keys] == [None] * 40
    assert batch.transactions <= 6


async def test_writes_of_one_key_apply_in_call_order(store: Store) -> None:
    batch = StoreBatch(store)
    key = store.keys.preparation("n1", "claim-x")
    states = [pb.PreparedState.PREPARE_STARTED, pb.PreparedState.PREPARE_COMPLETED] * 3
    # etcd refuses one key twice in a transaction: each goes in its own, in order.
    await asyncio.gather(
        batch.put(key, _record("a", states[0])),
        batch.put(key, _record("b", states[1])),
        batch.delete(key),
        batch.put(key, _record("c", states[3])),
    )
    got = await store.get(key, pb.PreparedClaim)
    assert got is not None and got.value.claim_uid == "c"


async def test_reads_see_writes_made_before_they_were_asked(store: Store) -> None:
    batch = StoreBatch(store)
    key = store.keys.domain("cd-1")
    assert await batch.get(key) is None
    await store.put(key, pb.ComputeDomain(uid="cd-1", namespace="ns", name="d"))
    found = await asyncio.gather(*(batch.get(key) for _ in range(16)))
    assert all(f is not None and f.key == key for f in found)
    assert len({f.mod_revision for f in found if f is not None}) == 1
    assert await batch.get(store.keys.domain("cd-other")) is None


async def test_a_failed_transaction_fails_each_of_its_callers_and_the_next_succeeds(
    private_etcd: EtcdServer,
) -> None:
    async with Store(EtcdConfig(endpoint=private_etcd.endpoint, prefix="/t/", timeout_s=1.0)) as store:
        batch = StoreBatch(store)
        keys = [store.keys.preparation("n1", f"claim-{i}") for i in range(5)]
        await batch.put(keys[0], _record(keys[0]))
        private_etcd.stop()
        results = await asyncio.gather(*(batch.put(k, _record(k)) for k in keys), return_exceptions=True)
        assert all(isinstance(r, STORE_FAILURES) for r in results), results
        private_etcd.start()
        # As kubelet does: retry until the client has reconnected to the restarted etcd.
        for _ in range(50):
            try:
                await asyncio.gather(*(batch.put(k, _record(k)) for k in keys))
                break
            except STORE_FAILURES:
                await asyncio.sleep(0.2)
        assert all([await store.get(k, pb.PreparedClaim) for k in keys])


async def test_a_caller_that_gives_up_does_not_cancel_the_others(store: Store) -> None:
    batch = StoreBatch(store)
    first = asyncio.create_task(batch.put(store.keys.preparation("n1", "a"), _record("a")))
    second = asyncio.create_task(batch.put(store.keys.preparation("n1", "b"), _record("b")))
    third = asyncio.create_task(batch.put(store.keys.preparation("n1", "c"), _record("c")))
    await asyncio.sleep(0)
    third.cancel()
    await first
    await second
    with pytest.raises(asyncio.CancelledError):
        await third
    # The cancelled caller's write shared the second transaction and was still applied.
    assert await store.get(store.keys.preparation("n1", "c"), pb.PreparedClaim) is not None


async def test_a_store_claim_and_its_domain_are_read_in_one_transaction(store: Store) -> None:
    batch = StoreBatch(store)
    claims = StoreClaimSource(BatchedReads(batch))
    domain = await put_domain(store)
    ref = await put_claim(store, "rack0-tray0", domain.uid)
    claim, found = await asyncio.gather(claims.resolve(ref), batch.get(store.keys.domain(domain.uid)))
    assert claim.ref == ref and claim.results_for(DRIVER_NAME, "rack0-tray0")
    stored = await store.get(store.keys.claim(ref.uid), pb.Claim)
    assert stored is not None and claim.version == str(stored.mod_revision)
    assert found is not None and found.key == store.keys.domain(domain.uid)
    assert batch.transactions == 1
    with pytest.raises(ClaimGone):
        await claims.resolve(ClaimRef(ref.namespace, ref.name, new_uid()))
