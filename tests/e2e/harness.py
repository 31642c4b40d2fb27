"""The end-to-end environment: a real control plane plus our services as real processes.

`E2EEnvironment.start()` brings up, in order:

1. the loopback Kubernetes control plane (tools.controlplane) with our CRD and DeviceClass applied
   from the rendered kustomize base (with manifests/components/resource-v1beta1 on Kubernetes
   older than 1.34, which serves no resource.k8s.io/v1);
2. our etcd (tools.etcd);
3. the nodes' kubelets: per node the upstream kubelet on crisim, the simulated container runtime
   (tools.sim.kubelet), each on its own node IP, with the node lifecycle controller on; or, with
   kubelets="containerd", the upstream kubelet on containerd and runc, running real containers
   (tools.containerd; tests/e2e_containers); or, with kubelets="shim", the kubelet shim (tools.sim.kubeletshim, one process for every node: Node objects,
   leases), kept for the differential test and the 256-node benchmark, where kubelets do not fit;
4. per node its IMEX agent (node record on its lease, IMEX daemons) and then its kubelet plugin
   (Kubernetes claim source, simulated hardware), forked from the cdsim fork server so that 72
   of them start in seconds on two cores;
5. the placement advisor with its extender, and kube-scheduler restarted with that extender;
6. the controller in Kubernetes mode.

All state lives under one short temporary directory (unix socket paths stay under 108 bytes);
every process logs into `<root>/logs/`. `stop()` ends everything it started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from libs.invariants.checker import NodeLocalPaths
from tests import address_blocks
from tests.manifests.kustomize import build as kustomize_build
from tests.manifests.kustomize import build_kubectl
from tests.polling import wait_until
from tools import launch
from tools.cached_tool import cached_tool
from tools.cdsim.layout import StateLayout
from tools.containerd.images import NodeImages, prepare_images
from tools.containerd.network import PodNetworkNamespace
from tools.containerd.node import ContainerdKubeletNode
from tools.controlplane.binaries import Binaries, ensure_node_binaries
from tools.controlplane.cluster import DEFAULT_CONTROLLERS, ControlPlane
from tools.etcd.server import EtcdServer
from tools.launch import pid_alive
from tools.net_ports import free_port
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.hardware.simulated import prepare_node_dirs
from tools.sim.kubelet.addresses import NodeAddresses, node_ip
from tools.sim.kubelet.inotify import current_budget
from tools.sim.kubelet.node import NODE_MONITOR_GRACE_S, KubeletNode
from tools.sim.kubeletshim.nodes import nodes_document, nodes_of_cluster

REPO_ROOT = Path(__file__).resolve().parents[2]
MANIFESTS_BASE = REPO_ROOT / "manifests" / "base"
RESOURCE_V1BETA1 = REPO_ROOT / "manifests" / "components" / "resource-v1beta1"
EXAMPLES_DIR = REPO_ROOT / "tests" / "manifests" / "examples"

DRIVER = "compute-domain.nvidia.com"
DEVICE_CLASS = "compute-domain-default-channel.nvidia.com"
CRD_NAME = "computedomains.resource.nvidia.com"
DOMAIN_LABEL = "resource.nvidia.com/computeDomain"
CLIQUE_LABEL = "nvidia.com/gpu.clique"

AGENT_TARGET = launch.service_target("node-agent")  # the kubelet plugin
IMEX_AGENT_TARGET = launch.service_target("imex-agent")
CONTROLLER_TARGET = launch.service_target("controller")
ADVISOR_TARGET = launch.service_target("advisor")
SHIM_TARGET = "tools.sim.kubeletshim.main:main"
PRELOAD = (*launch.SERVICE_MODULES.values(), "tools.sim.kubeletshim.main")

AGENT_HEALTH_PORT = 9400
IMEX_AGENT_HEALTH_PORT = 9401
CONTROLLER_LEASE_TTL_S = 3
# Short, so a test sees leftovers swept within seconds (production default: 5 minutes).
CONTROLLER_SWEEP_S = 3
IMEX_AGENT_LEASE_TTL_S = 5
IMEX_PORT = 50000
EVICTION_TOLERATION_S = 10
_SPAWN_TIMEOUT_S = 30.0
_STOP_GRACE_S = 10.0


class EnvironmentError_(RuntimeError):
    """Something in the environment did not come up; the message carries the relevant log tail."""


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def http_ok(url: str) -> bool:
    return launch.http_ok(url, timeout_s=1.0)


def _address_block_free(cluster: ClusterDescription) -> bool:
    """Whether no other simulated cluster on this machine uses our racks' IMEX port or (another
    environment of this session, whose domains may be idle) the node agents' health port."""
    for rack in range(cluster.racks):
        for tray in (0, cluster.trays_per_rack - 1):
            address = cluster.node_address(rack, tray)
            for port in (IMEX_PORT, AGENT_HEALTH_PORT):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    try:
                        sock.bind((address, port))
                    except OSError:
                        return False
    return True


def candidate_blocks() -> list[int]:
    """The blocks an environment may take: not 1 (cdsim's default, `make demo`), not a test's fixed
    one, nor 100 and up (the node agent tests')."""
    return [b for b in range(2, 100) if b not in address_blocks.FIXED]


def pick_cluster(racks: int, trays: int) -> ClusterDescription:
    """A cluster on an address block no other simulated cluster here is using right now."""
    blocks = candidate_blocks()
    random.shuffle(blocks)
    for block in blocks:
        cluster = ClusterDescription(
            racks=racks, trays_per_rack=trays, seed=f"e2e-{os.getpid()}-{block}", address_block=block
        )
        if _address_block_free(cluster):
            return cluster
    raise EnvironmentError_("no free loopback address block for the simulated cluster")


class ForkServer:
    """Synchronous client of tools.cdsim.zygote: spawn pre-imported service processes."""

    def __init__(self, log_path: Path, cwd: Path) -> None:
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tools.cdsim.zygote", "--preload", ",".join(PRELOAD)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=str(REPO_ROOT),
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                start_new_session=True,
            )
        self._next_id = 0
        self.exits: dict[int, tuple[int | None, int]] = {}
        self._cwd = cwd

    def spawn(self, name: str, target: str, argv: list[str], log: Path) -> int:
        assert self.process.stdin is not None and self.process.stdout is not None
        self._next_id += 1
        request = {
            "id": self._next_id,
            "op": "spawn",
            "name": name,
            "target": target,
            "argv": argv,
            "log": str(log),
        }
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()
        deadline = time.monotonic() + _SPAWN_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                raise EnvironmentError_("the fork server exited")
            message = json.loads(line)
            if message.get("event") == "exit":
                self.exits[int(message["pid"])] = (message.get("code"), int(message.get("signal") or 0))
                continue
            if message.get("id") == self._next_id:
                if "pid" not in message:
                    raise EnvironmentError_(f"fork server refused {name}: {message.get('error')}")
                return int(message["pid"])
        raise EnvironmentError_(f"fork server did not answer for {name}")

    def close(self) -> None:
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()  # the fork server then terminates its children
        try:
            self.process.wait(timeout=_STOP_GRACE_S + 5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


def terminate(pid: int, grace_s: float = _STOP_GRACE_S) -> None:
    launch.terminate(pid, grace_s)


@dataclass
class E2EEnvironment:
    binaries: Binaries
    racks: int = 2
    trays: int = 18
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="cde2e-")))
    cp: ControlPlane = field(init=False)
    etcd: EtcdServer = field(init=False)
    cluster: ClusterDescription = field(init=False)
    layout: StateLayout = field(init=False)
    forks: ForkServer | None = None
    # "real": one upstream kubelet per node (tools.sim.kubelet) on crisim; "containerd": the same on
    # containerd (tools.containerd); "shim": tools.sim.kubeletshim plays them.
    kubelets: str = "real"
    kubelet_nodes: dict[str, KubeletNode] = field(default_factory=dict)
    pod_network: PodNetworkNamespace | None = None
    node_images: NodeImages | None = None
    node_addresses: NodeAddresses | None = None
    agents: dict[str, int] = field(default_factory=dict)  # node -> kubelet plugin pid
    imex_agents: dict[str, int] = field(default_factory=dict)  # node -> IMEX agent pid
    shim_pid: int = 0
    advisor_pid: int = 0
    controller_pid: int = 0
    controller_starts: int = 0
    ports: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # The ComputeDomain CRD to install in place of ours (e.g. NVIDIA's, left by its chart).
    crd: dict[str, Any] | None = None
    # More kube-apiserver flags (e.g. an audit log).
    apiserver_args: list[str] = field(default_factory=list)
    # With real kubelets: evict pods from an unreachable or not-ready Node after this long (the
    # lost-node test); None keeps the upstream 300 s, so that a kubelet slowed down by a loaded
    # machine does not cost a long-lived environment its pods.
    eviction_toleration_s: int | None = EVICTION_TOLERATION_S

    def __post_init__(self) -> None:
        self.layout = StateLayout.at(self.root)
        self.layout.logs_dir.mkdir(parents=True, exist_ok=True)
        if self.kubelets not in ("real", "containerd", "shim"):
            raise ValueError(f"kubelets must be 'real', 'containerd' or 'shim', not {self.kubelets!r}")
        # Real kubelets renew their leases, so the node lifecycle controller runs as in a cluster.
        controllers, kcm_args, apiserver_args = DEFAULT_CONTROLLERS, [], []
        if self.kubelets != "shim":
            controllers = "*"
            kcm_args = ["--node-monitor-period=2s", f"--node-monitor-grace-period={NODE_MONITOR_GRACE_S}s"]
            # Pods tolerate an unreachable or not-ready node this long before they are evicted
            # (upstream default: 300 s).
            if self.eviction_toleration_s is not None:
                apiserver_args = [
                    f"--default-unreachable-toleration-seconds={self.eviction_toleration_s}",
                    f"--default-not-ready-toleration-seconds={self.eviction_toleration_s}",
                ]
        self.cp = ControlPlane(
            self.binaries,
            self.root / "controlplane",
            controllers=controllers,
            apiserver_args=[*apiserver_args, *self.apiserver_args],
            controller_manager_args=kcm_args,
        )
        self.etcd = EtcdServer(data_dir=self.root / "etcd", log_path=self.layout.log_file("etcd"))
        self.cluster = pick_cluster(self.racks, self.trays)
        if self.kubelets == "containerd":
            # containerd's CDI injection makes the channels' device nodes in the containers: the
            # simulated hardware makes real (harmless) ones on the nodes.
            self.cluster = dataclasses.replace(self.cluster, imex_channel_device_nodes=True)

    # ---- paths -------------------------------------------------------------------------------

    @property
    def node_names(self) -> list[str]:
        return list(self.cluster.node_names())

    def node_paths(self, node: str) -> NodeLocalPaths:
        dirs = self.layout.node(node)
        return NodeLocalPaths(node, dirs.cdi_root, dirs.imex_dir, dirs.checkpoint_file)

    def all_node_paths(self) -> list[NodeLocalPaths]:
        return [self.node_paths(n) for n in self.node_names]

    def log(self, process: str) -> Path:
        return self.layout.log_file(process)

    def explain(self, *processes: str, lines: int = 25) -> str:
        names = processes or ("controller", "advisor", *(("kubeletshim",) if self.kubelets == "shim" else ()))
        parts = [f"--- {name} ---\n{log_tail(self.log(name), lines)}" for name in names]
        parts.append(f"--- kube-scheduler ---\n{log_tail(self.cp.log_path('kube-scheduler'), lines)}")
        return "\n".join(parts)

    def explain_kubelets(self, lines: int = 15) -> str:
        """The tails of every kubelet's log, then explain()'s."""
        parts = [
            f"--- kubelet-{k.name} ---\n{log_tail(k.kubelet_log, lines)}" for k in self.kubelet_nodes.values()
        ]
        return "\n".join([*parts, self.explain("controller", "advisor")])

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        try:
            self._timed("control plane", self.cp.start)
            self._timed("crd", self.apply_base_manifests)
            self._timed("etcd", self.etcd.start)
            self.forks = ForkServer(self.log("forkserver"), self.root)
            if self.kubelets != "shim":
                self._timed("kubelets", self.start_kubelets)
            else:
                self._timed("shim", self.start_shim)
            self._timed("agents", self.start_agents)
            self._timed("advisor", self.start_advisor)
            self._timed("scheduler with extender", self.configure_scheduler)
            self._timed("controller", self.start_controller)
            self._timed("resource slices", self.wait_resource_slices)
        except BaseException:
            self.stop()
            raise

    def _timed(self, what: str, step: Callable[[], None]) -> None:
        started = time.monotonic()
        step()
        self.timings[what] = round(time.monotonic() - started, 2)

    def stop(self, keep_root: bool = False) -> None:
        for pid in (self.controller_pid, self.advisor_pid, self.shim_pid):
            if pid:
                terminate(pid)
        self.stop_kubelets()
        if self.forks is not None:
            self.forks.close()  # SIGTERMs the agents; the IMEX agents stop their daemons
            self.forks = None
        self.etcd.stop()
        self.cp.stop()
        if not keep_root:
            shutil.rmtree(self.root, ignore_errors=True)

    # ---- steps -------------------------------------------------------------------------------

    def kubectl_apply(self, objects: list[dict[str, Any]]) -> None:
        self.cp.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(objects))

    def base_manifests(self) -> list[dict[str, Any]]:
        """The kustomize base as this control plane's release takes it."""
        if self.binaries.minor >= 34:
            return kustomize_build(MANIFESTS_BASE)
        # As an operator installs on 1.32/1.33: an overlay adding the component (relative paths).
        overlay = self.root / "manifests-v1beta1"
        overlay.mkdir(exist_ok=True)
        (overlay / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": [os.path.relpath(MANIFESTS_BASE, overlay)],
                    "components": [os.path.relpath(RESOURCE_V1BETA1, overlay)],
                }
            )
        )
        return build_kubectl(overlay, self.cp.bin_dir / "kubectl")

    def apply_base_manifests(self) -> None:
        wanted = {"CustomResourceDefinition", "DeviceClass"}
        objects = [o for o in self.base_manifests() if o.get("kind") in wanted]
        assert {o["kind"] for o in objects} == wanted, "the kustomize base lost the CRD or the DeviceClass"
        if self.crd is not None:
            objects = [self.crd if o["kind"] == "CustomResourceDefinition" else o for o in objects]
        self.kubectl_apply(objects)
        self.cp.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")

    def _spawn(self, name: str, target: str, argv: list[str]) -> int:
        assert self.forks is not None
        return self.forks.spawn(name, target, argv, self.log(name))

    def start_shim(self) -> None:
        nodes = nodes_of_cluster(self.cluster, self.layout.nodes_dir)
        nodes_file = self.root / "shim-nodes.json"
        nodes_file.write_text(json.dumps(nodes_document(nodes)))
        self.shim_pid = self._spawn(
            "kubeletshim",
            SHIM_TARGET,
            [
                "--kubeconfig", str(self.cp.kubeconfig),
                "--nodes-file", str(nodes_file),
                "--retry-initial-s", "0.25",
                "--retry-cap-s", "4",
                "--log-format", "json",
            ],
        )  # fmt: skip
        wait_until(
            lambda: self._ready_node_count() >= len(nodes),
            f"{len(nodes)} Ready Nodes registered by the kubelet shim",
            60.0,
            explain=lambda: log_tail(self.log("kubeletshim")),
        )

    def start_kubelets(self) -> None:
        """One kubelet and container runtime per node, each on a node IP of its own; refused up
        front, naming the inotify budget, when they cannot all start (tools.sim.kubelet.inotify)."""
        bin_dir = ensure_node_binaries(minor=f"1.{self.binaries.minor}")
        nodes = nodes_of_cluster(self.cluster, self.layout.nodes_dir)
        current_budget().require(len(nodes), headroom=0)
        ips = {n.name: node_ip(self.cluster.address_block, i) for i, n in enumerate(nodes)}
        containerd_bin = self._prepare_containerd()
        self.node_addresses = NodeAddresses(ips.values())
        self.node_addresses.add()
        for ordinal, n in enumerate(nodes):
            dirs = self.layout.node(n.name)
            state_dir = dirs.root / "host"
            kubelet = self._node_class()(
                name=n.name,
                ip=ips[n.name],
                kubelet_dir=dirs.kubelet_dir,
                state_dir=state_dir,
                bin_dir=bin_dir,
                kubeconfig=self.cp.node_kubeconfig(n.name, state_dir / "pki"),
                log_dir=self.layout.logs_dir,
                minor=self.binaries.minor,
                labels=n.labels,
                cdi_root=dirs.cdi_root,
                gpus=self.cluster.gpus_per_tray,
                **self._containerd_fields(ordinal, containerd_bin),
            )
            self.kubelet_nodes[n.name] = kubelet
            kubelet.start_runtime()
            if isinstance(kubelet, ContainerdKubeletNode):
                assert self.node_images is not None
                for archive in self.node_images.archives:
                    kubelet.import_image(archive)
            kubelet.start_kubelet()
        wait_until(
            lambda: self._ready_node_count() >= len(nodes),
            f"{len(nodes)} Ready Nodes registered by their kubelets",
            120.0,
            explain=lambda: "\n".join(
                f"--- kubelet-{k.name} ---\n{log_tail(k.kubelet_log, 10)}"
                for k in self.kubelet_nodes.values()
            ),
        )

    def _node_class(self) -> type[KubeletNode]:
        return ContainerdKubeletNode if self.kubelets == "containerd" else KubeletNode

    def _prepare_containerd(self) -> Path | None:
        """With kubelets="containerd": containerd (built once), the images, the pod network."""
        if self.kubelets != "containerd":
            return None
        containerd_bin = cached_tool("tools/containerd/build.sh")
        self.node_images = prepare_images(self.root / "images")
        self.pod_network = PodNetworkNamespace(self.log("pod-network"))
        self.pod_network.start()
        return containerd_bin

    def _containerd_fields(self, ordinal: int, containerd_bin: Path | None) -> dict[str, Any]:
        if containerd_bin is None:
            return {}
        assert self.node_images is not None
        return {
            "ordinal": ordinal,
            "containerd_bin": containerd_bin,
            "network": self.pod_network,
            "sandbox_image": self.node_images.sandbox,
        }

    def stop_kubelets(self) -> None:
        for kubelet in self.kubelet_nodes.values():
            kubelet.stop()
        if self.pod_network is not None:
            self.pod_network.stop()
        if self.node_addresses is not None:
            self.node_addresses.remove()

    def _ready_node_count(self) -> int:
        out = self.cp.kubectl(
            "get",
            "nodes",
            "-o",
            "jsonpath={range .items[*]}{.status.conditions[?(@.type=='Ready')].status}{'\\n'}{end}",
            check=False,
        ).stdout
        return sum(1 for line in out.splitlines() if line.strip() == "True")

    def agent_argv(self, node: str) -> list[str]:
        """The node's kubelet plugin (DaemonSet cd-node-agent)."""
        dirs = self.layout.node(node)
        address = self.cluster.node(node).address
        return [
            "--node-name", node,
            "--kubelet-dir", str(dirs.kubelet_dir),
            "--cdi-root", str(dirs.cdi_root),
            "--hardware", "simulated",
            "--sim-cluster", str(self.layout.cluster_file),
            "--sim-state-dir", str(self.layout.nodes_dir),
            "--claim-source", "kubernetes",
            "--kubeconfig", str(self.cp.kubeconfig),
            "--publish-clique-label", "true",
            "--health-host", address,
            "--health-port", str(AGENT_HEALTH_PORT),
            "--etcd-endpoint", self.etcd.endpoint,
            "--log-format", "json",
        ]  # fmt: skip

    def imex_agent_argv(self, node: str) -> list[str]:
        """The node's IMEX agent (DaemonSet cd-imex-agent)."""
        dirs = self.layout.node(node)
        address = self.cluster.node(node).address
        return [
            "--node-name", node,
            "--node-ip", address,
            "--kubelet-dir", str(dirs.kubelet_dir),
            "--cdi-root", str(dirs.cdi_root),
            "--imex-work-dir", str(dirs.imex_dir),
            "--hardware", "simulated",
            "--sim-cluster", str(self.layout.cluster_file),
            "--sim-state-dir", str(self.layout.nodes_dir),
            "--lease-ttl-s", str(IMEX_AGENT_LEASE_TTL_S),
            # The session's end leaves no daemon behind (in a cluster they outlive the agent).
            "--stop-daemons-on-exit", "true",
            "--health-host", address,
            "--health-port", str(IMEX_AGENT_HEALTH_PORT),
            "--etcd-endpoint", self.etcd.endpoint,
            "--log-format", "json",
        ]  # fmt: skip

    def start_agents(self) -> None:
        self.cluster.save(self.layout.cluster_file)
        for node in self.node_names:
            prepare_node_dirs(self.cluster, node, self.layout.nodes_dir)
            dirs = self.layout.node(node)
            for d in (dirs.kubelet_dir, dirs.cdi_root, dirs.imex_dir):
                d.mkdir(parents=True, exist_ok=True)
        self.start_imex_agents(self.node_names)
        self.start_plugins(self.node_names)

    def start_plugins(self, nodes: list[str]) -> None:
        """Start the kubelet plugins of ``nodes`` and wait until they serve kubelet."""
        for node in nodes:
            self.agents[node] = self._spawn(f"agent-{node}", AGENT_TARGET, self.agent_argv(node))
        self._wait_ready("agent", AGENT_HEALTH_PORT, nodes)

    def start_imex_agents(self, nodes: list[str]) -> None:
        for node in nodes:
            self.imex_agents[node] = self._spawn(
                f"imex-{node}", IMEX_AGENT_TARGET, self.imex_agent_argv(node)
            )
        self._wait_ready("imex", IMEX_AGENT_HEALTH_PORT, nodes)

    def lose_node(self, node: str) -> None:
        """The tray is gone: its kubelet, kubelet plugin and IMEX agent (with its daemon) stop; its
        pods stay in the API server as they were."""
        self.kubelet_nodes[node].stop_kubelet(kill=True)
        self.stop_plugins([node])
        terminate(self.imex_agents[node])  # SIGTERM: the agent stops its daemons

    def restore_node(self, node: str) -> None:
        """Bring a lost tray back (kubelet, IMEX agent, kubelet plugin)."""
        self.kubelet_nodes[node].start_kubelet()
        self.start_imex_agents([node])
        self.start_plugins([node])

    def stop_plugins(self, nodes: list[str]) -> None:
        """End the kubelet plugins of ``nodes`` as a DaemonSet pod deletion does (SIGTERM, then
        SIGKILL after the grace period) and wait until they are gone."""
        for node in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.agents[node], signal.SIGTERM)
        for node in nodes:
            terminate(self.agents[node])
        assert not any(pid_alive(self.agents[n]) for n in nodes)

    def _wait_ready(self, kind: str, port: int, nodes: list[str]) -> None:
        urls = {n: f"http://{self.cluster.node(n).address}:{port}/readyz" for n in nodes}
        wait_until(
            lambda: all(http_ok(u) for u in urls.values()),
            f"every {kind} process of {len(nodes)} nodes to be ready",
            90.0,
            explain=lambda: "\n".join(
                f"--- {kind}-{n} ---\n{log_tail(self.log(f'{kind}-{n}'), 10)}"
                for n, u in urls.items()
                if not http_ok(u)
            ),
        )

    def start_advisor(self) -> None:
        self.ports.update(advisor_grpc=free_port(), extender=free_port(), advisor_health=free_port())
        self.advisor_pid = self._spawn(
            "advisor",
            ADVISOR_TARGET,
            [
                "--identity", "advisor",
                "--etcd-endpoint", self.etcd.endpoint,
                "--grpc-host", "127.0.0.1",
                "--grpc-port", str(self.ports["advisor_grpc"]),
                "--extender-enabled", "true",
                "--extender-host", "127.0.0.1",
                "--extender-port", str(self.ports["extender"]),
                "--template-source", "kubernetes",
                "--kubeconfig", str(self.cp.kubeconfig),
                "--health-host", "127.0.0.1",
                "--health-port", str(self.ports["advisor_health"]),
                "--log-format", "json",
            ],
        )  # fmt: skip
        wait_until(
            lambda: http_ok(f"http://127.0.0.1:{self.ports['advisor_health']}/readyz"),
            "the placement advisor to be ready",
            60.0,
            explain=lambda: log_tail(self.log("advisor")),
        )

    def configure_scheduler(self) -> None:
        extender = {
            "urlPrefix": f"http://127.0.0.1:{self.ports['extender']}/",
            "filterVerb": "filter",
            "prioritizeVerb": "prioritize",
            "weight": 1,
            "enableHTTPS": False,
            # Whole Node objects here (the shipped configuration sends names: cdsim's Kubernetes
            # mode runs that), so the real kube-scheduler exercises both shapes.
            "nodeCacheCapable": False,
            "ignorable": False,
            "httpTimeout": "10s",
        }
        path = self.root / "kube-scheduler-extender.yaml"
        path.write_text(yaml.safe_dump(self.cp.scheduler_config(extenders=[extender])))
        self.cp.restart_scheduler(path)

    def controller_argv(self, identity: str, health_port: int) -> list[str]:
        """One replica of the controller (Deployment cd-controller); replicas elect a leader."""
        return [
            "--identity", identity,
            "--mode", "kubernetes",
            "--kubeconfig", str(self.cp.kubeconfig),
            "--etcd-endpoint", self.etcd.endpoint,
            "--leader-lease-ttl-s", str(CONTROLLER_LEASE_TTL_S),
            "--sweep-interval-s", str(CONTROLLER_SWEEP_S),
            "--health-host", "127.0.0.1",
            "--health-port", str(health_port),
            "--log-format", "json",
        ]  # fmt: skip

    def start_controller(self) -> None:
        if "controller_health" not in self.ports:
            self.ports["controller_health"] = free_port()
        self.controller_starts += 1
        self.controller_pid = self._spawn(
            "controller",
            CONTROLLER_TARGET,
            self.controller_argv(f"controller-{self.controller_starts}", self.ports["controller_health"]),
        )
        wait_until(
            lambda: http_ok(f"http://127.0.0.1:{self.ports['controller_health']}/healthz"),
            "the controller to serve /healthz",
            60.0,
            explain=lambda: log_tail(self.log("controller")),
        )

    def kill_shim(self) -> None:
        """SIGKILL the kubelet shim (all nodes' kubelets at once)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.shim_pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(self.shim_pid), "the killed kubelet shim to exit", 10.0)

    def kill_controller(self) -> None:
        """SIGKILL the controller: no lease revoked, no cleanup."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.controller_pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(self.controller_pid), "the killed controller to exit", 10.0)

    def wait_resource_slices(self) -> None:
        expected = len(self.node_names)

        def count() -> int:
            out = self.cp.kubectl(
                "get",
                "resourceslices",
                "-o",
                "jsonpath={range .items[*]}{.spec.driver}{'\\n'}{end}",
                check=False,
            ).stdout
            return sum(1 for line in out.splitlines() if line.strip() == DRIVER)

        wait_until(lambda: count() >= expected, f"{expected} ResourceSlices of {DRIVER}", 60.0)


def example_objects(file_name: str) -> list[dict[str, Any]]:
    """The documents of one NVIDIA example, unchanged."""
    with open(EXAMPLES_DIR / file_name) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def example_compute_domain(file_name: str, name: str, template: str, namespace: str) -> dict[str, Any]:
    """The ComputeDomain of an NVIDIA example with only its names changed."""
    docs = [d for d in example_objects(file_name) if d.get("kind") == "ComputeDomain"]
    assert len(docs) == 1, f"{file_name} should hold one ComputeDomain"
    cd = docs[0]
    cd["metadata"]["name"] = name
    cd["metadata"]["namespace"] = namespace
    cd["spec"]["channel"]["resourceClaimTemplate"]["name"] = template
    return cd


def iter_lines(path: Path) -> Iterator[dict[str, Any]]:
    """JSON log lines of a service log (other lines skipped)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            obj = json.loads(line)
            if isinstance(obj, dict):
                yield obj
