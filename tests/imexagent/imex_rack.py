"""Helpers of the IMEX agent tests: a rack of simulated nodes on free loopback addresses, member
records written as the controller and the node agent would, and polling without fixed sleeps."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from libs.gen.computedomain.state import v1 as pb
from libs.imex.config import DEFAULT_CMD_PORT, DEFAULT_SERVER_PORT
from libs.state.store import Delete, Put, Store
from services.imexagent.daemon_supervisor import ImexSupervisor
from services.imexagent.settings import ImexSettings
from tests.polling import eventually
from tools.sim.hardware.cluster import ClusterDescription, SimulatedNode
from tools.sim.hardware.simulated import SimulatedNodeHardware

FAST = ImexSettings(
    backend="simulated",
    stop_grace_s=2.0,
    restart_backoff_initial_s=0.3,
    restart_backoff_cap_s=1.0,
    poll_interval_ready_s=0.1,
    reload_min_interval_s=1.0,
    sim_sigusr1_min_interval_s=0.5,
    sim_reconnect_initial_s=0.05,
    sim_reconnect_max_s=0.2,
    sim_heartbeat_interval_s=0.5,
    stop_daemons_on_exit=True,
)


def _port_free(address: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def free_cluster(nodes: int) -> ClusterDescription:
    """A one-rack cluster on a random 127.<block>.0.x block whose IMEX ports are free."""
    for _ in range(100):
        block = random.randint(100, 250)
        cluster = ClusterDescription(racks=1, trays_per_rack=18, address_block=block, seed=uuid.uuid4().hex)
        addresses = [cluster.node_address(0, t) for t in range(nodes)]
        if all(_port_free(a, DEFAULT_SERVER_PORT) and _port_free(a, DEFAULT_CMD_PORT) for a in addresses):
            return cluster
    raise RuntimeError("no free loopback block")


def kill_daemons_under(directory: Path) -> None:
    """Safety net: no daemon of a test may outlive it."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
                if str(directory).encode() in cmdline:
                    os.kill(int(entry.name), signal.SIGKILL)


@dataclass
class Node:
    sim: SimulatedNode
    work_dir: Path
    supervisor: ImexSupervisor | None = None
    task: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.sim.name

    def dir(self, uid: str) -> Path:
        return self.work_dir / uid


class Rack:
    """Simulated nodes of one rack on one etcd; supervisors run in this process."""

    def __init__(
        self, store: Store, base: Path, cluster: ClusterDescription, settings: ImexSettings = FAST
    ) -> None:
        self.store = store
        self.base = base
        self.cluster = cluster
        self.settings = settings
        self.nodes: list[Node] = []

    def node(self, tray: int) -> Node:
        sim = self.cluster.node(f"rack0-tray{tray}")
        node = Node(sim, self.base / "imex" / sim.name)
        self.nodes.append(node)
        return node

    def start(self, node: Node) -> ImexSupervisor:
        hardware = SimulatedNodeHardware(self.cluster, node.name, self.base / "hw" / node.name)
        node.supervisor = ImexSupervisor(self.store, node.name, hardware, node.work_dir, self.settings)
        node.task = asyncio.create_task(node.supervisor.run())
        return node.supervisor

    async def stop(self, node: Node) -> None:
        if node.task is not None:
            node.task.cancel()
            await asyncio.wait([node.task])
            node.task = None

    # ---- the store, as the node agent and the controller write it ------------------------

    async def join(
        self,
        uid: str,
        node: Node,
        index: int,
        address: str | None = None,
        *,
        mesh_mode: pb.MeshMode = pb.MeshMode.UNDECIDED,
        with_domain: bool = True,
    ) -> None:
        """Make `node` a member; `mesh_mode` is what its join saw on the domain (UNDECIDED: the
        agent reads the domain record)."""
        keys = self.store.keys
        # The controller's mesh decision; these tests run plaintext domains (mutual TLS is
        # exercised with a real controller in tests/cdsim/test_mesh_tls.py).
        if with_domain and await self.store.get(keys.domain(uid), pb.ComputeDomain) is None:
            domain = pb.ComputeDomain(uid=uid, namespace="default", name=uid, mesh_mode=pb.MeshMode.PLAINTEXT)
            await self.store.put(keys.domain(uid), domain)
        member = pb.Member(
            domain_uid=uid,
            node_name=node.name,
            clique_id=node.sim.clique,
            index=index,
            state=pb.MemberState.ACTIVE,
            ip_address=address or node.sim.address,
            namespace="default",
            mesh_mode=mesh_mode,
        )
        # One transaction, as the node agent's join writes them: an agent never sees the binding
        # without its member record.
        binding = pb.NodeBinding(node_name=node.name, domain_uid=uid)
        await self.store.txn(
            [], [Put(keys.node_binding(node.name), binding), Put(keys.member(uid, node.name), member)]
        )

    async def set_state(self, uid: str, node: Node, state: pb.MemberState) -> None:
        key = self.store.keys.member(uid, node.name)
        item = await self.store.get(key, pb.Member)
        assert item is not None
        member = item.value
        member.state = state
        await self.store.put(key, member)

    async def release(self, uid: str, node: Node) -> None:
        """The member is released (its node holds no claim of the domain any more)."""
        keys = self.store.keys
        await self.store.txn([], [Delete(keys.member(uid, node.name)), Delete(keys.node_binding(node.name))])

    async def status(self, uid: str, node: Node) -> pb.DaemonStatus | None:
        item = await self.store.get(self.store.keys.daemon(uid, node.name), pb.DaemonStatus)
        return item.value if item else None

    async def ready_status(
        self, uid: str, node: Node, newer_than: pb.DaemonStatus | None = None, **expect: object
    ) -> pb.DaemonStatus:
        """Wait for a READY status of the node's daemon with the given field values (and written
        after `newer_than`)."""

        async def check() -> pb.DaemonStatus | None:
            status = await self.status(uid, node)
            if status is None or status.state != pb.DaemonState.READY:
                return None
            if newer_than is not None and status.updated_unix_ms <= newer_than.updated_unix_ms:
                return None
            if any(getattr(status, k) != v for k, v in expect.items()):
                return None
            return status

        return await eventually(check, f"READY status of {node.name} with {expect}")
