"""The processes the Kubernetes formation benchmark runs against, each real and started here.

- the loopback control plane of tools/controlplane (its etcd, kube-apiserver with an audit log of
  every write, kube-controller-manager, kube-scheduler with the placement advisor's extender) and
  manifests/base without its workloads (CRD, DeviceClass, RBAC, admission policies);
- our etcd, a `cd-controller` in Kubernetes mode, a `cd-placement-advisor` serving the extender;
- the kubelet shim (tools/sim/kubeletshim) playing kubelet for every node: Node, Lease, pod sync, the
  DRA calls to each node's socket;
- scale-mode hosts (tools/sim/scalesim) running each node's IMEX agent and kubelet plugin in
  Kubernetes mode: claims read from the API server, a ResourceSlice and clique label per node.

The control plane's etcd keeps its data on disk and fsyncs, as a production control plane's does
(tools/controlplane turns fsync off for tests; `DurableControlPlane` leaves it on).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tools import launch
from tools.bench import simenv
from tools.cdsim.kube_plane import CRD_NAME, base_objects, extender_config
from tools.controlplane.binaries import Binaries
from tools.controlplane.cluster import ControlPlane
from tools.net_ports import free_port
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.kubeletshim.nodes import CLIQUE_LABEL, ShimNode, nodes_document
from tools.sim.scalesim.agent import AgentLayout
from tools.sim.scalesim.host import spread_nodes

# Only writes are audited: reads are most of the traffic and none of the question.
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  verbs: [create, update, patch, delete, deletecollection]
- level: None
"""
_NO_FSYNC = "--unsafe-no-fsync=true"
_READY_TIMEOUT_S = 120.0
_NODES_TIMEOUT_S = 600.0


class DurableControlPlane(ControlPlane):
    """The loopback control plane with its etcd fsyncing, as on a production control plane."""

    def _etcd_cmd(self, client_port: int, peer_port: int) -> list[str]:
        return [arg for arg in super()._etcd_cmd(client_port, peer_port) if arg != _NO_FSYNC]


@dataclass(frozen=True)
class KubeSettings:
    """How the control plane and the node side are configured (all recorded with the results)."""

    racks: int
    nodes: int
    host_processes: int
    mesh_tls: bool
    # Client rate limits of kube-controller-manager and kube-scheduler (0 = their defaults).
    client_qps: int
    client_burst: int
    node_cache_capable: bool = True  # as manifests/README.md configures the extender
    percentage_of_nodes_to_score: int = 100
    shim_retry_initial_s: float = 0.25
    shim_retry_cap_s: float = 4.0


def wait_for(
    check: Callable[[], bool], timeout_s: float, what: str, explain: Callable[[], str] = str
) -> None:
    deadline = time.monotonic() + timeout_s
    delay = 0.1
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{explain()}")
        time.sleep(delay)
        delay = min(delay * 1.5, 1.0)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class KubeEnvironment:
    """Everything of one run under `base`; `start()` brings it up, `stop()` ends what started."""

    base: Path
    binaries: Binaries
    settings: KubeSettings
    etcd_endpoint: str
    prefix: str
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    host: simenv.HostGroup | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        s = self.settings
        self.block = simenv.free_address_block(s.racks)
        # tools.sim.scalesim builds the same cluster from these (simenv.start_host's seed).
        self.cluster = ClusterDescription(
            racks=s.racks, trays_per_rack=18, seed=f"bench-{self.base.name}", address_block=self.block
        )
        self.node_names = spread_nodes(self.cluster, s.nodes)
        self.audit_log = self.base / "audit.log"
        self.extender_port = free_port()
        self.advisor_grpc_port = free_port()
        self.plane = DurableControlPlane(
            self.binaries,
            self.base / "kube",
            scheduler_config=self.base / "kube-scheduler.yaml",
            apiserver_args=(
                f"--audit-policy-file={self._write('audit-policy.yaml', AUDIT_POLICY)}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-mode=blocking",
            ),
            controller_manager_args=self._qps_args(),
            startup_timeout_s=180.0,
        )

    def _write(self, name: str, text: str) -> Path:
        path = self.base / name
        path.write_text(text)
        return path

    def _qps_args(self) -> tuple[str, ...]:
        s = self.settings
        if not s.client_qps:
            return ()
        return (f"--kube-api-qps={s.client_qps}", f"--kube-api-burst={s.client_burst}")

    def log(self, name: str) -> Path:
        return self.base / f"{name}.log"

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        try:
            self._timed("control plane", self._start_plane)
            self._timed("controller", self._start_controller)
            self._timed("advisor", self._start_advisor)
            self._timed("kubelet shim", self._start_shim)
            self._timed("node agents", self._start_hosts)
            self._timed("resource slices", self._wait_slices)
        except BaseException:
            self.stop()
            raise

    def _timed(self, what: str, step: Callable[[], None]) -> None:
        began = time.monotonic()
        step()
        self.timings[what] = round(time.monotonic() - began, 1)
        print(f"[formation_k8s] {what} up in {self.timings[what]} s", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.host is not None:
            self.host.stop()
            self.host = None
        for proc in reversed(list(self.processes.values())):
            launch.stop_process(proc)
        self.processes.clear()
        self.plane.stop()

    # ---- steps -------------------------------------------------------------------------------

    def _start_plane(self) -> None:
        extender = {
            **extender_config(self.extender_port),
            "nodeCacheCapable": self.settings.node_cache_capable,
        }
        config = self.plane.scheduler_config(extenders=[extender])
        # kube-scheduler stops filtering once it found "enough" feasible nodes (at 256 nodes: about
        # half) and hands the extender only those; the advisor then sees too few free nodes for
        # a domain of them all ("NO_CAPACITY: 256 nodes requested but only 122 free").
        config["percentageOfNodesToScore"] = self.settings.percentage_of_nodes_to_score
        if self.settings.client_qps:
            config["clientConnection"].update(qps=self.settings.client_qps, burst=self.settings.client_burst)
        (self.base / "kube-scheduler.yaml").write_text(yaml.safe_dump(config))
        self.plane.start()
        objects = base_objects(self.plane.bin_dir / "kubectl")
        self.plane.kubectl(
            "apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(objects), timeout_s=120
        )
        self.plane.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")

    def _start_service(self, service: str, settings: list[str], health_url: str) -> None:
        started = launch.start_service(service, settings, self.log(service))
        self.processes[service] = started.proc
        started.wait_healthy(
            lambda: launch.http_ok(health_url), _READY_TIMEOUT_S, f"healthy at {health_url}", max_poll_s=1.0
        )

    def _common(self) -> list[str]:
        return [f"--etcd-endpoint={self.etcd_endpoint}", f"--etcd-prefix={self.prefix}", "--log-format=json"]

    def _start_controller(self) -> None:
        port = free_port()
        self._start_service(
            "controller",
            [
                *self._common(), f"--log-level={simenv.log_level()}",
                "--identity=bench-controller", "--mode=kubernetes", f"--kubeconfig={self.plane.kubeconfig}",
                f"--imex-mesh-tls={str(self.settings.mesh_tls).lower()}",
                "--health-host=127.0.0.1", f"--health-port={port}",
            ],
            f"http://127.0.0.1:{port}/healthz",
        )  # fmt: skip

    def _start_advisor(self) -> None:
        port = free_port()
        self._start_service(
            "advisor",
            [
                *self._common(), f"--log-level={simenv.log_level()}",
                "--identity=bench-advisor", "--grpc-host=127.0.0.1", f"--grpc-port={self.advisor_grpc_port}",
                "--extender-enabled=true", "--extender-host=127.0.0.1", f"--extender-port={self.extender_port}",
                "--template-source=kubernetes", f"--kubeconfig={self.plane.kubeconfig}",
                "--health-host=127.0.0.1", f"--health-port={port}",
            ],
            f"http://127.0.0.1:{port}/readyz",
        )  # fmt: skip

    def shim_nodes(self) -> list[ShimNode]:
        """Every hosted node as the shim plays it: its kubelet dir in the scale host's layout."""
        nodes_dir = self.base / "n"  # simenv.start_host's --state-dir
        return [
            ShimNode(
                name=name,
                kubelet_dir=AgentLayout(nodes_dir / name).kubelet_dir,
                address=self.cluster.node(name).address,
                labels={CLIQUE_LABEL: self.cluster.node(name).clique},
            )
            for name in self.node_names
        ]

    def _start_shim(self) -> None:
        s = self.settings
        nodes_file = self.base / "shim-nodes.json"
        nodes_file.write_text(json.dumps(nodes_document(self.shim_nodes())))
        shim = launch.spawn(
            "kubelet shim",
            [
                sys.executable, "-m", "tools.sim.kubeletshim", f"--kubeconfig={self.plane.kubeconfig}",
                f"--nodes-file={nodes_file}",
                f"--retry-initial-s={s.shim_retry_initial_s}", f"--retry-cap-s={s.shim_retry_cap_s}",
                "--log-format=json", f"--log-level={simenv.log_level()}",
            ],
            self.log("kubeletshim"),
        )  # fmt: skip
        self.processes["kubeletshim"] = shim.proc
        shim.wait_healthy(
            lambda: self._count(self._nodes_ready) >= len(self.node_names),
            _NODES_TIMEOUT_S,
            f"showing {len(self.node_names)} Ready Nodes",
            max_poll_s=1.0,
        )

    def _start_hosts(self) -> None:
        self.host = simenv.start_host(
            self.etcd_endpoint,
            self.prefix,
            self.base,
            racks=self.settings.racks,
            nodes=self.settings.nodes,
            address_block=self.block,
            extra_args=(f"--kubeconfig={self.plane.kubeconfig}",),
            processes=self.settings.host_processes,
            timeout_s=_NODES_TIMEOUT_S,
        )
        missing = set(self.node_names) - set(self.host.sockets)
        if missing:
            raise RuntimeError(f"the scale hosts do not host {sorted(missing)[:5]} (cluster mismatch)")

    def _wait_slices(self) -> None:
        wanted = len(self.node_names)
        wait_for(
            lambda: self._count(self._sliced) >= wanted,
            _NODES_TIMEOUT_S,
            f"{wanted} ResourceSlices of our driver and clique-labelled Nodes",
            lambda: "\n".join(tail(h.log, 10) for h in (self.host.hosts if self.host else [])),
        )

    def _count(self, probe: Callable[[], int]) -> int:
        try:
            return probe()
        except (subprocess.SubprocessError, ValueError):
            return 0

    def _get(self, *args: str) -> list[dict[str, Any]]:
        proc = self.plane.kubectl("get", *args, "-o", "json", check=False, timeout_s=60)
        if proc.returncode != 0:
            return []
        return list(json.loads(proc.stdout).get("items") or [])

    def _nodes_ready(self) -> int:
        return sum(
            1
            for n in self._get("nodes")
            if any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in (n.get("status") or {}).get("conditions") or []
            )
        )

    def _sliced(self) -> int:
        names = set(self.node_names)
        sliced = {(s.get("spec") or {}).get("nodeName") for s in self._get("resourceslices")}
        return len(names & sliced)
