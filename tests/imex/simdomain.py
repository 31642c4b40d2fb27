"""Test helper: simulated IMEX daemons as real processes on real loopback addresses."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from libs.imex.config import DEFAULT_CMD_PORT, DEFAULT_SERVER_PORT, render_imex_config, render_nodes_config
from libs.imex.simulator import client
from libs.imex.simulator.launch import simulator_daemon_argv

REPO_ROOT = Path(__file__).resolve().parents[2]


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


@dataclass
class SimNode:
    address: str
    directory: Path
    domain_id: str
    heartbeat_s: float | None = None
    wait_for_quorum: str = "RECOVERY"
    sigusr1_min_interval_s: float | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def config_path(self) -> Path:
        return self.directory / "config.cfg"

    @property
    def nodes_path(self) -> Path:
        return self.directory / "nodes_config.cfg"

    @property
    def log_path(self) -> Path:
        return self.directory / "nvidia-imex.log"

    def write_config(self, members: list[str]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.write_nodes(members)
        self.config_path.write_text(
            render_imex_config(
                bind_interface_ip=self.address,
                nodes_config_file=str(self.nodes_path),
                cmd_bind_interface_ip=self.address,
                log_file_name=str(self.log_path),
                domain_id=self.domain_id,
                node_name=f"node-{self.address}",
                wait_for_quorum=self.wait_for_quorum,
                heartbeat_interval_s=self.heartbeat_s,
                reconnect_max_s=0.25,
                sigusr1_min_interval_s=self.sigusr1_min_interval_s,
            )
        )

    def write_nodes(self, members: list[str]) -> None:
        # Written atomically, as the supervisor must: the daemon may re-read it at any time.
        tmp = self.nodes_path.with_suffix(".tmp")
        tmp.write_text(render_nodes_config(members))
        os.replace(tmp, self.nodes_path)

    def spawn(self, *, via_module: bool = False) -> subprocess.Popen[bytes]:
        if via_module:
            argv = [sys.executable, "-m", "libs.imex.simulator.daemon", "-c", str(self.config_path)]
        else:
            argv = simulator_daemon_argv(str(self.config_path))
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return self.proc

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    async def state(self, timeout_s: float = 1.0) -> str:
        return await client.query_state(self.address, DEFAULT_CMD_PORT, timeout_s)

    async def status(self, timeout_s: float = 1.0) -> client.DaemonStatus:
        return await client.query_status(self.address, DEFAULT_CMD_PORT, timeout_s)

    async def wait_state(self, wanted: str, timeout_s: float = 5.0) -> None:
        await self.wait_until(lambda status: status.state == wanted, f"state {wanted}", timeout_s)

    async def wait_until(
        self, predicate: Callable[[client.DaemonStatus], bool], what: str, timeout_s: float = 5.0
    ) -> client.DaemonStatus:
        """Poll the daemon's status until ``predicate`` holds; fail with its log otherwise."""
        deadline = time.monotonic() + timeout_s
        last: client.DaemonStatus | str = ""
        while time.monotonic() < deadline:
            try:
                last = await self.status(timeout_s=0.5)
                if predicate(last):
                    return last
            except client.DaemonUnavailable as exc:
                last = str(exc)
            await asyncio.sleep(0.01)
        raise AssertionError(f"{self.address}: no {what} after {timeout_s} s: {last}\n{self.log_text()}")

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

    def domain(
        self,
        size: int,
        domain_id: str = "cd-uid-1",
        *,
        heartbeat_s: float | None = None,
        wait_for_quorum: str = "RECOVERY",
    ) -> list[SimNode]:
        addresses = free_loopback_addresses(size)
        nodes = [
            SimNode(a, self.root / a, domain_id, heartbeat_s=heartbeat_s, wait_for_quorum=wait_for_quorum)
            for a in addresses
        ]
        for node in nodes:
            node.write_config(addresses)
        self.nodes.extend(nodes)
        return nodes

    def add(self, node: SimNode) -> SimNode:
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:
            node.kill()
            if node.proc is not None and node.proc.stderr is not None:
                node.proc.stderr.close()
