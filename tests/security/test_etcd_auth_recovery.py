"""The store over etcd with TLS client certificates and password auth, across etcd trouble.

etcd's simple auth tokens live in etcd's memory: a restarted etcd refuses every token issued
before, and the client must authenticate again (libs/state/client.py) for calls, watches and
lease keep-alives alike. An unreachable etcd at connect is a transient error, a wrong password
a permanent one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import aetcd.exceptions
import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.state.config import EtcdConfig
from libs.state.lease import KeptLease
from libs.state.store import TRANSIENT_ERRORS, Store, Versioned, with_retries
from libs.state.watch import Resync, WatchEvent, watch_prefix
from tests import address_blocks
from tests.polling import eventually
from tests.security.secured_cluster import PREFIX, SecuredCluster, create, destroy, enable_etcd_auth

pytestmark = pytest.mark.slow


@pytest.fixture
def auth_etcd(etcd_bin: Path) -> Iterator[SecuredCluster]:
    """etcd with client-certificate TLS and a least-privilege password user; no services."""
    cluster = create(trays=1, address_block=address_blocks.ETCD_AUTH_RECOVERY, etcd_bin=etcd_bin)
    try:
        cluster.etcd.start()
        admin = cluster.clients["admin"]
        bootstrap = EtcdConfig(
            endpoint=cluster.etcd.endpoint,
            prefix=PREFIX,
            ca_file=str(cluster.ca.cert),
            cert_file=str(admin.cert),
            key_file=str(admin.key),
        )
        asyncio.run(enable_etcd_auth(bootstrap, cluster.password))
        yield cluster
    finally:
        destroy(cluster)


async def test_the_store_works_again_after_an_etcd_restart(auth_etcd: SecuredCluster) -> None:
    async with Store(auth_etcd.store_config("cd-node-agent")) as store:
        await store.put(store.keys.node("n1"), pb.Node(name="n1"))
        await asyncio.to_thread(auth_etcd.etcd.restart)
        errors: list[str] = []

        async def read_back() -> tuple[Versioned[pb.Node] | None] | None:
            try:
                return (await store.get(store.keys.node("n1"), pb.Node),)
            except Exception as exc:  # whatever it is: the store must come back
                errors.append(f"{type(exc).__name__}: {exc}")
                return None

        (found,) = await eventually(
            read_back,
            "the store to read again after the etcd restart",
            15.0,
            explain=lambda: f"last error: {errors[-1] if errors else None}",
            first_delay_s=0.5,
        )
        assert found is not None and found.value.name == "n1"


async def test_connecting_while_etcd_is_down_is_a_transient_error(auth_etcd: SecuredCluster) -> None:
    await asyncio.to_thread(auth_etcd.etcd.stop)
    config = auth_etcd.store_config("cd-node-agent")
    store = Store(dataclasses.replace(config, timeout_s=1.0))
    try:
        with pytest.raises(TRANSIENT_ERRORS):
            await store.connect()
    finally:
        await store.close()


async def test_watches_leases_and_concurrent_calls_recover_after_an_etcd_restart(
    auth_etcd: SecuredCluster,
) -> None:
    ttl_s = 4
    config = auth_etcd.store_config("cd-node-agent")
    # One client each, so that each path meets the forgotten token on its own: the writer's
    # calls, the watch's creates (its only calls after the first listing), the lease's keep-alives.
    async with Store(config) as store, Store(config) as watching, Store(config) as leasing:
        keys = store.keys
        lease_key = keys.node("leased")

        async def on_acquired(lease_id: int) -> None:
            await leasing.put(lease_key, pb.Node(name="leased"), lease=lease_id)

        kept = KeptLease(leasing, ttl_s, on_acquired=on_acquired)
        events: asyncio.Queue[WatchEvent[pb.Node] | Resync[pb.Node]] = asyncio.Queue()

        async def consume() -> None:
            async for item in watch_prefix(watching, keys.nodes(), pb.Node):
                await events.put(item)

        lease_task = asyncio.create_task(kept.run())
        watch_task = asyncio.create_task(consume())
        try:
            await asyncio.wait_for(kept.acquired.wait(), 10)
            first = await asyncio.wait_for(events.get(), 10)
            assert isinstance(first, Resync)

            await asyncio.to_thread(auth_etcd.etcd.restart)
            # Many calls at once, all with the token etcd forgot: each succeeds, and the
            # client authenticates again only once.
            names = [f"n{i}" for i in range(20)]
            await asyncio.gather(
                *(with_retries(lambda n=n: store.put(keys.node(n), pb.Node(name=n)), "put") for n in names)
            )
            assert store.client.reauthentications == 1

            # The watch came back (with a new token) and delivers what was written since.
            seen: set[str] = set()
            deadline = time.monotonic() + 15.0
            while not set(names) <= seen:
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"the watch did not recover; missing {sorted(set(names) - seen)}"
                item = await asyncio.wait_for(events.get(), remaining)
                if isinstance(item, WatchEvent) and item.kind == "put":
                    seen.add(item.key.rsplit("/", 1)[1])
                elif isinstance(item, Resync):
                    seen |= {v.value.name for v in item.items}
            assert watching.client.reauthentications == 1

            # The lease is kept alive: its key outlives more than a whole TTL after the restart.
            await asyncio.sleep(ttl_s + 1)
            assert kept.acquired.is_set() and not lease_task.done()
            assert await store.get(lease_key, pb.Node) is not None
            assert leasing.client.reauthentications == 1
        finally:
            for task in (lease_task, watch_task):
                task.cancel()
            await asyncio.gather(lease_task, watch_task, return_exceptions=True)


async def test_refusals_that_are_not_transient(auth_etcd: SecuredCluster) -> None:
    # A wrong password is a permanent error (no retry cures it), and it is not echoed.
    wrong = "wrong-" + auth_etcd.password[::-1]
    store = Store(dataclasses.replace(auth_etcd.store_config("cd-node-agent"), password=wrong))
    try:
        with pytest.raises(aetcd.exceptions.ClientError) as refused:
            await store.connect()
        assert not isinstance(refused.value, TRANSIENT_ERRORS)
        assert "authentication failed" in str(refused.value)
        assert wrong not in str(refused.value) and auth_etcd.password not in str(refused.value)
    finally:
        await store.close()

    # A watch etcd refuses (here: outside the user's permissions) fails at once instead of
    # being taken for a live watch that never delivers anything.
    async with Store(auth_etcd.store_config("cd-node-agent")) as store:
        with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
            await asyncio.wait_for(store.client.watch_prefix(b"/elsewhere/"), 10)
        # The refusal does not disturb the next watch on the same client.
        watch = await asyncio.wait_for(store.client.watch_prefix(store.keys.nodes().encode()), 10)
        await store.put(store.keys.node("n1"), pb.Node(name="n1"))
        async with asyncio.timeout(10):
            async for event in watch:
                assert event.kv.key == store.keys.node("n1").encode()
                break
        await watch.cancel()
