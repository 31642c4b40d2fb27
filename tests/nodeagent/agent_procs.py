"""A node's two programs as real processes on a simulated cluster, and a kubelet stand-in.

Per node: the IMEX agent (``cd-imex-agent``: node record on its lease, IMEX daemons, their
DaemonStatus records) and the kubelet plugin (``cd-node-agent``: DRA socket, checkpoint, CDI).
`AgentProcess` is the plugin; its `imex` is the node's IMEX agent.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from grpclib.client import Channel

from libs.gen.k8s.io.kubelet.pkg.apis.dra import v1 as dra
from libs.invariants.checker import NodeLocalPaths
from libs.runtime.backoff import Backoff
from libs.state.config import EtcdConfig
from services.nodeagent.core.checkpoint import checkpoint_path
from services.nodeagent.core.claim import ClaimRef
from services.nodeagent.wire.driver import dra_socket_path
from tests.polling import eventually
from tools import launch
from tools.net_ports import free_port
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.hardware.simulated import FaultInjector, prepare_node_dirs


@dataclass
class _Program:
    """One long-running program of a node: `service` of tools/launch.py with `settings()`."""

    name: str
    base: Path
    cluster_file: Path
    sim_state_dir: Path
    etcd: EtcdConfig
    health_port: int
    extra_args: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None

    service = ""
    log_name = ""

    @property
    def kubelet_dir(self) -> Path:
        return self.base / "kubelet"

    @property
    def cdi_root(self) -> Path:
        return self.base / "cdi"

    @property
    def imex_work_dir(self) -> Path:
        return self.base / "imex"

    @property
    def log_file(self) -> Path:
        return self.base / self.log_name

    def common_args(self) -> list[str]:
        return [
            "--node-name", self.name,
            "--hardware", "simulated",
            "--sim-cluster", str(self.cluster_file),
            "--sim-state-dir", str(self.sim_state_dir),
            "--kubelet-dir", str(self.kubelet_dir),
            "--cdi-root", str(self.cdi_root),
            "--etcd-endpoint", self.etcd.endpoint,
            "--etcd-prefix", self.etcd.prefix,
            "--health-host", "127.0.0.1",
            "--health-port", str(self.health_port),
            "--log-format", "json",
        ]  # fmt: skip

    def settings(self) -> list[str]:
        return [*self.common_args(), *self.extra_args]

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        self.process = launch.start_service(self.service, self.settings(), self.log_file, append=True).proc

    async def wait_ready(self, timeout_s: float = 20.0) -> None:
        """Until /readyz answers 200 (the program exiting first fails at once)."""
        url = f"http://127.0.0.1:{self.health_port}/readyz"
        async with aiohttp.ClientSession() as session:

            async def ready() -> bool:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise AssertionError(
                        f"{self.service} of {self.name} exited {self.process.returncode}:\n{self.log_tail()}"
                    )
                try:
                    async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as response:
                        return response.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    return False

            await eventually(
                ready,
                f"{self.service} of {self.name} to be ready",
                timeout_s,
                explain=self.log_tail,
                max_delay_s=0.1,
            )

    async def health(self) -> tuple[int, dict[str, object]]:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{self.health_port}/healthz") as response:
                return response.status, await response.json()

    async def metrics(self) -> str:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{self.health_port}/metrics") as response:
                return await response.text()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.process is None:
            return None
        launch.stop_process(self.process, timeout_s)
        return self.process.returncode

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"


@dataclass
class ImexAgentProcess(_Program):
    """``cd-imex-agent`` of one node. Simulated daemons are stopped with it (test hygiene)."""

    service = "imex-agent"
    log_name = "imex-agent.log"

    def settings(self) -> list[str]:
        return [
            *self.common_args(),
            "--imex-work-dir", str(self.imex_work_dir),
            "--lease-ttl-s", "3",
            "--stop-daemons-on-exit", "true",
            *self.extra_args,
        ]  # fmt: skip


@dataclass
class AgentProcess(_Program):
    """``cd-node-agent`` (the kubelet plugin) of one node; `imex` is the node's IMEX agent."""

    imex: ImexAgentProcess | None = None

    service = "node-agent"
    log_name = "agent.log"

    @property
    def checkpoint_file(self) -> Path:
        return checkpoint_path(self.kubelet_dir)

    @property
    def local_paths(self) -> NodeLocalPaths:
        return NodeLocalPaths(self.name, self.cdi_root, self.imex_work_dir, self.checkpoint_file)

    def cdi_spec(self, claim_uid: str) -> Path:
        return self.cdi_root / f"k8s.compute-domain.nvidia.com-claim_{claim_uid}.json"

    def settings(self) -> list[str]:
        boot_id = self.base / "boot_id"
        if not boot_id.exists():
            boot_id.write_text(f"boot-{self.name}\n")
        return [
            *self.common_args(),
            "--boot-id-file", str(boot_id),
            *self.extra_args,
        ]  # fmt: skip

    def start_node(self) -> None:
        """Both programs: the IMEX agent (if not running) and the plugin."""
        if self.imex is not None and not self.imex.running:
            self.imex.start()
        self.start()

    async def wait_serving(self, timeout_s: float = 20.0) -> None:
        """The plugin serves kubelet (it does so only once the IMEX agent registered the node)."""
        await self.wait_ready(timeout_s)

    def stop_node(self) -> int | None:
        """Plugin first, then the IMEX agent (which stops its simulated daemons)."""
        code = self.stop()
        if self.imex is not None:
            self.imex.stop()
        return code

    def log_tail(self, lines: int = 40) -> str:
        tail = super().log_tail(lines)
        if self.imex is None:
            return tail
        return f"{tail}\n--- IMEX agent:\n{_Program.log_tail(self.imex, lines)}"


class Kubelet:
    """Calls a node agent's DRA socket as kubelet does, retrying failed claims with backoff."""

    def __init__(self, agent: AgentProcess) -> None:
        self.agent = agent

    @contextmanager
    def _channel(self) -> Iterator[Channel]:
        channel = Channel(path=str(dra_socket_path(self.agent.kubelet_dir)))
        try:
            yield channel
        finally:
            channel.close()

    async def prepare_once(
        self, *refs: ClaimRef, timeout_s: float = 60.0
    ) -> dict[str, dra.NodePrepareResourceResponse]:
        with self._channel() as channel:
            reply = await dra.DraPluginStub(channel).node_prepare_resources(
                dra.NodePrepareResourcesRequest(
                    claims=[dra.Claim(namespace=r.namespace, uid=r.uid, name=r.name) for r in refs]
                ),
                timeout=timeout_s,
            )
        return dict(reply.claims)

    async def unprepare_once(self, *refs: ClaimRef, timeout_s: float = 60.0) -> dict[str, str]:
        with self._channel() as channel:
            reply = await dra.DraPluginStub(channel).node_unprepare_resources(
                dra.NodeUnprepareResourcesRequest(
                    claims=[dra.Claim(namespace=r.namespace, uid=r.uid, name=r.name) for r in refs]
                ),
                timeout=timeout_s,
            )
        return {uid: r.error for uid, r in reply.claims.items()}

    async def prepare(self, ref: ClaimRef, deadline_s: float = 60.0) -> dra.NodePrepareResourceResponse:
        """Retry until the claim is prepared (or the deadline passes: the last answer is returned)."""
        backoff = Backoff(initial=0.1, cap=1.0)
        end = time.monotonic() + deadline_s
        while True:
            try:
                answer = (await self.prepare_once(ref))[ref.uid]
            except (OSError, ConnectionError):
                answer = dra.NodePrepareResourceResponse(error="agent unreachable")
            if not answer.error or time.monotonic() >= end:
                return answer
            await asyncio.sleep(backoff.next_delay())


@dataclass
class SimCluster:
    base: Path
    cluster: ClusterDescription
    cluster_file: Path
    sim_state_dir: Path
    etcd: EtcdConfig
    agents: dict[str, AgentProcess] = field(default_factory=dict)

    def agent(
        self, name: str, extra_args: list[str] | None = None, imex_args: list[str] | None = None
    ) -> AgentProcess:
        """The node's plugin, with its IMEX agent as ``.imex`` (neither started)."""
        if name not in self.agents:
            prepare_node_dirs(self.cluster, name, self.sim_state_dir)
            common = {
                "name": name,
                "base": self.base / name,
                "cluster_file": self.cluster_file,
                "sim_state_dir": self.sim_state_dir,
                "etcd": self.etcd,
            }
            self.agents[name] = AgentProcess(
                **common,  # type: ignore[arg-type]
                health_port=free_port(),
                extra_args=extra_args or [],
                imex=ImexAgentProcess(**common, health_port=free_port(), extra_args=imex_args or []),  # type: ignore[arg-type]
            )
        return self.agents[name]

    def faults(self, name: str) -> FaultInjector:
        prepare_node_dirs(self.cluster, name, self.sim_state_dir)
        return FaultInjector(self.sim_state_dir / name / "hardware-faults.json", self.cluster.gpus_per_tray)

    def shutdown(self) -> None:
        for agent in self.agents.values():
            agent.stop()
        for agent in self.agents.values():
            if agent.imex is not None:
                agent.imex.stop()


@contextmanager
def sim_cluster(etcd: EtcdConfig, trays: int = 4) -> Iterator[SimCluster]:
    """A one-rack simulated cluster in a short temporary directory (unix socket paths must fit
    in 108 bytes), on a loopback block of its own so leftovers of other tests cannot collide."""
    base = Path(tempfile.mkdtemp(prefix="na-"))
    cluster = ClusterDescription(
        racks=1, trays_per_rack=trays, seed=f"na-{base.name}", address_block=random.randint(100, 250)
    )
    cluster_file = base / "cluster.json"
    cluster.save(cluster_file)
    sim = SimCluster(base, cluster, cluster_file, base / "nodes", etcd)
    try:
        yield sim
    finally:
        sim.shutdown()
        shutil.rmtree(base, ignore_errors=True)
