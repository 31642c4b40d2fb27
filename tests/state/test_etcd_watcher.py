"""A watch creation that timed out does not cross-wire the next watch (real etcd).

aetcd pairs a "created" answer with whatever creation is pending: the late answer to a creation
that gave up would hand the next watch the abandoned one's keys. PairedWatcher asks etcd for a
watch id per creation and pairs by it.
"""

from __future__ import annotations

import asyncio

import aetcd.exceptions
import pytest

from libs.state.config import EtcdConfig
from libs.state.etcd_watcher import PairedWatcher
from libs.state.store import Store


async def first_key(watch: object, within_s: float) -> bytes:
    async with asyncio.timeout(within_s):
        async for event in watch:  # type: ignore[attr-defined]
            return bytes(event.kv.key)
    raise AssertionError("watch ended")


async def test_a_timed_out_creation_does_not_hand_its_keys_to_the_next_watch(etcd_config: EtcdConfig) -> None:
    async with Store(etcd_config) as store:
        client = store.client
        await client.connect()
        watcher = client._watcher
        assert isinstance(watcher, PairedWatcher)
        prefix = etcd_config.prefix.encode()

        # A creation that gives up before etcd can answer: its answer arrives late.
        watcher._timeout = 1e-6
        with pytest.raises(aetcd.exceptions.WatchTimeoutError):
            await client.watch_prefix(prefix + b"abandoned/")
        watcher._timeout = 5.0

        mine = await client.watch_prefix(prefix + b"mine/")
        await client.put(prefix + b"abandoned/x", b"1")
        await client.put(prefix + b"mine/y", b"2")
        assert await first_key(mine, 5.0) == prefix + b"mine/y"
        assert watcher.stale_answers == 1  # the late answer was recognised, and its watch cancelled
        await mine.cancel()


async def test_many_concurrent_watches_each_get_their_own_keys(etcd_config: EtcdConfig) -> None:
    async with Store(etcd_config) as store:
        client = store.client
        prefix = etcd_config.prefix.encode()
        watches = await asyncio.gather(*(client.watch_prefix(prefix + f"w{i}/".encode()) for i in range(40)))
        for i in reversed(range(40)):
            await client.put(prefix + f"w{i}/k".encode(), b"v")
        keys = await asyncio.gather(*(first_key(w, 10.0) for w in watches))
        assert keys == [prefix + f"w{i}/k".encode() for i in range(40)]
        for w in watches:
            await w.cancel()
