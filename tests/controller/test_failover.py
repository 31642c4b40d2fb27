"""Two controller processes, one leader: SIGKILL and SIGTERM hand-over while domains form."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import check_store_invariants
from libs.state.config import EtcdConfig
from libs.state.membership import join_domain
from libs.state.store import Store
from tests.controller.harness import create_domain
from tests.polling import eventually
from tools import launch

TTL_S = 2
DOMAINS = 24
PER_DOMAIN = 4


@dataclass
class ControllerProcess:
    identity: str
    proc: subprocess.Popen[bytes]
    log: Path

    def health_port(self) -> int | None:
        return launch.announced_ports(self.log).get("health")

    def metrics(self) -> str:
        port = self.health_port()
        assert port is not None, f"{self.identity} did not start its health server"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return resp.read().decode()


def start_controller(config: EtcdConfig, identity: str, tmp: Path) -> ControllerProcess:
    settings = [
        f"--etcd-endpoint={config.endpoint}",
        f"--etcd-prefix={config.prefix}",
        f"--leader-lease-ttl-s={TTL_S}",
        f"--identity={identity}",
        "--health-host=127.0.0.1",
        "--health-port=0",
        "--log-format=json",
    ]
    started = launch.start_service("controller", settings, tmp / f"{identity}.log", name=identity)
    return ControllerProcess(identity, started.proc, started.log)


@pytest.fixture
def controllers(etcd_config: EtcdConfig, tmp_path: Path) -> Iterator[list[ControllerProcess]]:
    procs = [start_controller(etcd_config, name, tmp_path) for name in ("ctl-a", "ctl-b")]
    yield procs
    for p in procs:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(10)


async def leader_of(store: Store) -> str | None:
    record = await store.get(store.keys.election("cd-controller"), pb.LeaderRecord)
    return record.value.holder if record else None


def node(d: int, i: int) -> pb.Node:
    return pb.Node(
        name=f"d{d}-n{i}",
        ip_address=f"127.2.{d}.{i + 1}",
        clique_id=f"00000000-0000-4000-8000-{d:012d}.1",
        health=pb.Health.HEALTHY,
    )


async def form(store: Store, d: int) -> None:
    """What node agents do for one 4-node job: join, then their daemons report READY and connected."""
    uid = f"fo-{d}"
    members = [node(d, i) for i in range(PER_DOMAIN)]
    for n in members:
        await store.put(store.keys.node(n.name), n)
        await join_domain(store, uid, "ns", n)
    for n in members:
        peers = [p.name for p in members if p.name != n.name]
        daemon = pb.DaemonStatus(
            domain_uid=uid, node_name=n.name, state=pb.DaemonState.READY, connected_nodes=peers
        )
        await store.put(store.keys.daemon(uid, n.name), daemon)


async def statuses(store: Store) -> dict[str, pb.ComputeDomainStatus]:
    items, _ = await store.list(store.keys.domains(), pb.ComputeDomain)
    return {i.value.uid: i.value.status for i in items}


async def test_standby_takes_over_after_sigkill_and_finishes_formation(
    store: Store, controllers: list[ControllerProcess]
) -> None:
    holder = await eventually(lambda: leader_of(store), "a leader", timeout_s=20)
    active = next(c for c in controllers if c.identity == holder)
    standby = next(c for c in controllers if c.identity != holder)
    for d in range(DOMAINS):
        await create_domain(store, f"fo-{d}", num_nodes=PER_DOMAIN)

    async def drive() -> None:
        for d in range(DOMAINS):
            await form(store, d)
            await asyncio.sleep(0.05)

    driver = asyncio.create_task(drive())

    async def some_ready() -> bool:
        return sum(s.status == pb.Readiness.READY for s in (await statuses(store)).values()) >= 3

    await eventually(some_ready, "the first domains to be Ready", timeout_s=20)
    active.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()

    async def standby_leads() -> bool:
        return await leader_of(store) == standby.identity

    await eventually(standby_leads, "the standby to take over", timeout_s=TTL_S + 5)
    takeover = time.monotonic() - killed
    ready_at_kill = sum(s.status == pb.Readiness.READY for s in (await statuses(store)).values())
    await driver

    async def all_ready() -> bool:
        return all(s.status == pb.Readiness.READY for s in (await statuses(store)).values())

    await eventually(all_ready, "every domain to be Ready", timeout_s=20)
    finished = time.monotonic() - killed
    print(
        f"\nfailover: standby took over {takeover:.2f} s after SIGKILL (lease TTL {TTL_S} s); "
        f"{ready_at_kill}/{DOMAINS} domains were Ready then, all {DOMAINS} Ready {finished:.2f} s after the kill"
    )
    # The lease outlives the kill by up to one TTL (it was refreshed at most TTL/3 before), and
    # etcd revokes expired leases on a 500 ms tick: allow that tick and scheduling on a busy box.
    assert takeover <= TTL_S + 1.0
    assert await check_store_invariants(store, quiescent=False) == []
    metrics = standby.metrics()
    assert "cd_controller_leader 1.0" in metrics
    assert f'cd_controller_domains{{status="Ready"}} {float(DOMAINS)}' in metrics


async def test_sigterm_resigns_at_once(store: Store, controllers: list[ControllerProcess]) -> None:
    holder = await eventually(lambda: leader_of(store), "a leader", timeout_s=20)
    active = next(c for c in controllers if c.identity == holder)
    standby = next(c for c in controllers if c.identity != holder)
    await eventually(lambda: _serving(standby), "the standby's health server", timeout_s=10)
    assert "cd_controller_leader 0.0" in standby.metrics()
    active.proc.send_signal(signal.SIGTERM)
    stopped = time.monotonic()

    async def standby_leads() -> bool:
        return await leader_of(store) == standby.identity

    await eventually(standby_leads, "the standby to take over", timeout_s=TTL_S + 5)
    takeover = time.monotonic() - stopped
    assert active.proc.wait(10) == 0
    print(f"\ngraceful hand-over: standby leads {takeover:.2f} s after SIGTERM (lease TTL {TTL_S} s)")
    assert takeover < TTL_S / 2, "leadership was not resigned: the standby waited for the lease to expire"


async def _serving(c: ControllerProcess) -> bool:
    return c.health_port() is not None
