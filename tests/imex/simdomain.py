"""Test helper: simulated IMEX daemons as real processes on real loopback addresses.

Every node gets the layout the IMEX agent writes: ``config.cfg``, ``nodes_config.cfg`` (the 18
slot names of its domain and clique, or names a test chooses) and ``hosts`` (slot name ->
address; empty slots map to the placeholder address).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from libs.imex import slots
from libs.imex.config import (
    DEFAULT_CMD_PORT,
    DEFAULT_SERVER_PORT,
    QUORUM_RECOVERY,
    MeshTlsFiles,
    render_imex_config,
    render_nodes_config,
)
from tests.polling import eventually
from tools.sim.imex import client
from tools.sim.imex.launch import simulator_daemon_argv
from tools.sim.imex.recovery import PERSIST_FILE

REPO_ROOT = Path(__file__).resolve().parents[2]
CLIQUE = "clique-a.1"


def free_loopback_addresses(count: int) -> list[str]:
    """``count`` addresses 127.77.<r>.<1..count> whose SERVER_PORT and command port are free.

    A random third octet keeps concurrent test runs (and other simulations) apart.
    """
    for _ in range(100):
        block = random.randint(1, 254)
        addresses = [f"127.77.{block}.{i}" for i in range(1, count + 1)]
        if all(_port_free(a, DEFAULT_SERVER_PORT) and _port_free(a, DEFAULT_CMD_PORT) for a in addresses):
            return addresses
    raise RuntimeError("no free block of loopback addresses")


def _port_free(address: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((address, port))
        except OSError:
            return False
    return True


def slot_addresses(members: Sequence[str]) -> list[str]:
    """Slot i -> members[i]; the remaining slots -> the placeholder."""
    return list(members) + [slots.PLACEHOLDER_ADDRESS] * (slots.MAX_SLOTS - len(members))


@dataclass
class SimNode:
    address: str
    directory: Path
    domain_uid: str
    clique_id: str = CLIQUE
    heartbeat_s: float | None = None
    reconnect_initial_s: float | None = 0.05
    reconnect_max_s: float | None = 0.25
    sigusr1_min_interval_s: float | None = 0.0
    grace_s: int = -1  # IMEX_NODE_DISCONNECTED_GRACE_TIME
    mesh_tls: MeshTlsFiles | None = None
    wait_for_quorum: str = QUORUM_RECOVERY
    driver_version: str = ""  # "": no directive (the simulator assumes a current release)
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def config_path(self) -> Path:
        return self.directory / "config.cfg"

    @property
    def nodes_path(self) -> Path:
        return self.directory / "nodes_config.cfg"

    @property
    def hosts_path(self) -> Path:
        return self.directory / "hosts"

    @property
    def log_path(self) -> Path:
        return self.directory / "nvidia-imex.log"

    @property
    def persist_path(self) -> Path:
        return self.directory / PERSIST_FILE

    def slot_name(self, index: int) -> str:
        return slots.slot_name(self.domain_uid, self.clique_id, index)

    def write_config(self, members: Sequence[str], names: Sequence[str] | None = None) -> None:
        """config.cfg, nodes config (slot names unless ``names``) and hosts (slot i -> members[i])."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if names is None:
            self.nodes_path.write_text(slots.render_nodes_config_slots(self.domain_uid, self.clique_id))
        else:
            self.nodes_path.write_text(render_nodes_config(names))
        self.write_slots(members)
        self.config_path.write_text(
            render_imex_config(
                bind_interface_ip=self.address,
                nodes_config_file=str(self.nodes_path),
                cmd_bind_interface_ip=self.address,
                log_file_name=str(self.log_path),
                domain_id=self.domain_uid,
                node_name=f"node-{self.address}",
                hosts_file=str(self.hosts_path),
                heartbeat_interval_s=self.heartbeat_s,
                reconnect_initial_s=self.reconnect_initial_s,
                reconnect_max_s=self.reconnect_max_s,
                sigusr1_min_interval_s=self.sigusr1_min_interval_s,
                node_disconnected_grace_time_s=self.grace_s,
                mesh_tls=self.mesh_tls,
                wait_for_quorum=self.wait_for_quorum,
                driver_version=self.driver_version,
            )
        )

    def write_slots(self, members: Sequence[str]) -> None:
        self.write_hosts(slots.render_hosts(slot_addresses(members), self.domain_uid, self.clique_id))

    def write_hosts(self, text: str) -> None:
        # Atomically (temp + rename), as the IMEX agent does: the daemon may read it at any time.
        tmp = self.hosts_path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.hosts_path)

    def spawn(self, *, via_module: bool = False) -> subprocess.Popen[bytes]:
        if via_module:
            argv = [sys.executable, "-m", "tools.sim.imex.daemon", "-c", str(self.config_path)]
        else:
            argv = simulator_daemon_argv(str(self.config_path))
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return self.proc

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    async def status(self, timeout_s: float = 1.0) -> client.DaemonStatus:
        return await client.query_status(self.address, DEFAULT_CMD_PORT, timeout_s)

    async def wait_until(
        self, predicate: Callable[[client.DaemonStatus], bool], what: str, timeout_s: float = 5.0
    ) -> client.DaemonStatus:
        """Poll the daemon's status until ``predicate`` holds; fail with its log otherwise."""
        last: client.DaemonStatus | str = ""

        async def probe() -> client.DaemonStatus | None:
            nonlocal last
            try:
                last = await self.status(timeout_s=0.5)
            except client.DaemonUnavailable as exc:  # not up yet, or restarting: poll again
                last = str(exc)
                return None
            return last if predicate(last) else None

        return await eventually(
            probe,
            f"{what} from {self.address}",
            timeout_s,
            explain=lambda: f"last status: {last}\n{self.log_text()}",
            max_delay_s=0.05,
        )

    async def wait_connected(self, node_ids: Sequence[int], timeout_s: float = 5.0) -> client.DaemonStatus:
        return await self.wait_until(
            lambda st: all(st.connections.get(i) == "CONNECTED" for i in node_ids),
            f"connections to {list(node_ids)}",
            timeout_s,
        )

    async def wait_log(self, text: str, count: int = 1, timeout_s: float = 5.0) -> str:
        """Wait until ``text`` occurs ``count`` times in the log."""

        def counted() -> str | None:
            log = self.log_text()
            return log if log.count(text) >= count else None

        return await eventually(
            counted,
            f"{text!r} logged {count}x by {self.address}",
            timeout_s,
            explain=self.log_text,
            max_delay_s=0.05,
        )

    def signal(self, signum: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def wait_exit(self, timeout: float = 5.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


class SimCluster:
    """Creates nodes under one directory and kills whatever is left at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.nodes: list[SimNode] = []

    def domain(self, size: int, domain_uid: str = "cd-uid-1", **timing: float | None) -> list[SimNode]:
        """``size`` members holding slots 0..size-1 of one domain's 18-slot map."""
        addresses = free_loopback_addresses(size)
        nodes = [self.node(a, domain_uid, **timing) for a in addresses]
        for node in nodes:
            node.write_config(addresses)
        return nodes

    def node(self, address: str, domain_uid: str = "cd-uid-1", **timing: float | None) -> SimNode:
        node = SimNode(address, self.root / f"{domain_uid}-{address}", domain_uid, **timing)  # type: ignore[arg-type]
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.kill()
            if node.proc is not None and node.proc.stderr is not None:
                node.proc.stderr.close()


async def start(nodes: Sequence[SimNode], members: int | None = None) -> None:
    """Spawn ``nodes`` and wait until each is connected to the first ``members`` node IDs."""
    for node in nodes:
        node.spawn()
    for node in nodes:
        await node.wait_connected(range(len(nodes) if members is None else members))
