"""`cdsim up --kubernetes`: a real Kubernetes control plane in front of the simulated racks.

The supervisor runs, besides what `cdsim up` runs:

- the loopback control plane of tools/controlplane (its own etcd, kube-apiserver,
  kube-controller-manager, kube-scheduler configured with the placement advisor's extender),
  its state under `<state dir>/kube/`;
- from manifests/base, everything but the workloads: Namespace, CRD, DeviceClass, ServiceAccounts
  and RBAC, admission policies (our services run here as processes, not as pods);
- per simulated node the upstream kubelet of the control plane's release on crisim, the simulated
  container runtime (tools/sim/kubelet), each on a node IP of its own; the node lifecycle controller
  runs. How many fit is bounded by the user's inotify instances (tools/sim/kubelet/inotify.py): `up`
  refuses more nodes than fit, naming that budget;

and runs our services in Kubernetes mode: the controller mirrors ComputeDomain CRs, the kubelet
plugins take claims from the API server and publish ResourceSlices, the advisor serves the
extender. `cdsim down` stops the control plane after our services.

The control plane's processes and the kubelets die with the thread that started them
(PR_SET_PDEATHSIG is per thread), so one dedicated thread starts them and lives until they are
stopped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog
import yaml

from libs.contract.names import DRIVER_NAME
from services.nodeagent.wire.resourceslice import CLIQUE_LABEL
from tools.cdsim import proc_scan
from tools.cdsim.layout import StateLayout
from tools.cdsim.run_state import SimConfig
from tools.cdsim.services import AGENT_KIND, ServiceSpec
from tools.controlplane.binaries import Binaries
from tools.controlplane.cluster import ControlPlane
from tools.net_ports import free_port
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.kubelet.addresses import NodeAddresses, node_ip
from tools.sim.kubelet.inotify import current_budget
from tools.sim.kubelet.node import NODE_MONITOR_GRACE_S, KubeletNode

log = structlog.get_logger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
MANIFESTS_BASE = REPO_ROOT / "manifests" / "base"
CRD_NAME = "computedomains.resource.nvidia.com"
# What of manifests/base is applied: all but the workloads (Deployments, DaemonSets and their
# NetworkPolicy), whose programs run here as supervised processes.
BASE_KINDS = frozenset(
    {
        "Namespace",
        "CustomResourceDefinition",
        "DeviceClass",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
)
PRELOAD_MODULES: tuple[str, ...] = ()  # nothing beyond the simulation's services
# `up --kubernetes` without --trays: one rack of 8 trays. 8 kubelets and the control plane hold 45
# of the user's 128 inotify instances (tools/sim/kubelet/inotify.py), leaving room for the desktop,
# editors and another cluster; every example of examples/ fits (at most 5 nodes in one clique).
DEFAULT_TRAYS = 8
# A node's kubelet reports to the node lifecycle controller every NODE_LEASE_DURATION_S / 4.
NODE_LIFECYCLE_ARGS = ("--node-monitor-period=2s", f"--node-monitor-grace-period={NODE_MONITOR_GRACE_S}s")
# Cold control plane + services on a loaded two-core machine.
STARTUP_TIMEOUT_S = 300.0
KUBECTL_TIMEOUT_S = 60.0


class KubeStartFailed(RuntimeError):
    """The control plane did not come up, or the manifests did not apply; the message says why."""


def set_flag(argv: Sequence[str], flag: str, value: str) -> list[str]:
    """argv with `flag`'s value replaced (the `--flag value` form), or `flag value` appended."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == flag:
            out[i + 1] = value
            return out
    return [*out, flag, value]


def extender_config(port: int) -> dict[str, Any]:
    """kube-scheduler's extender entry for the placement advisor on 127.0.0.1:`port`."""
    return {
        "urlPrefix": f"http://127.0.0.1:{port}/",
        "filterVerb": "filter",
        "prioritizeVerb": "prioritize",
        "weight": 1,
        "enableHTTPS": False,
        # As manifests/README.md configures it: node names only (the advisor has its own inventory).
        "nodeCacheCapable": True,
        # Not ignorable: without the advisor a domain's pods could land in two cliques.
        "ignorable": False,
        "httpTimeout": "10s",
    }


def check_inotify_budget(nodes: int) -> None:
    """Raise InotifyBudgetExceeded unless `nodes` kubelets and a control plane fit this user's
    inotify instances now (the message names the budget and how many would fit)."""
    current_budget().require(nodes, control_planes=1)


def kubernetes_specs(
    specs: Sequence[ServiceSpec], *, kubeconfig: Path, extender_port: int
) -> list[ServiceSpec]:
    """The simulation's service specs turned to Kubernetes mode."""
    kc = str(kubeconfig)
    out: list[ServiceSpec] = []
    for spec in specs:
        argv = spec.argv
        if spec.kind == AGENT_KIND:
            argv = set_flag(argv, "--claim-source", "kubernetes")
            argv = set_flag(argv, "--kubeconfig", kc)
            argv = set_flag(argv, "--publish-clique-label", "true")
        elif spec.kind == "controller":
            argv = set_flag(argv, "--mode", "kubernetes")
            argv = set_flag(argv, "--kubeconfig", kc)
        elif spec.kind == "advisor":
            argv = set_flag(argv, "--extender-enabled", "true")
            argv = set_flag(argv, "--extender-host", "127.0.0.1")
            argv = set_flag(argv, "--extender-port", str(extender_port))
            argv = set_flag(argv, "--template-source", "kubernetes")
            argv = set_flag(argv, "--kubeconfig", kc)
        out.append(dataclasses.replace(spec, argv=argv))
    return out


def base_objects(kubectl: Path) -> list[dict[str, Any]]:
    """manifests/base rendered by `kubectl kustomize`, without the workloads (see BASE_KINDS)."""
    proc = subprocess.run(
        [str(kubectl), "kustomize", str(MANIFESTS_BASE)],
        capture_output=True,
        text=True,
        timeout=KUBECTL_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise KubeStartFailed(f"kubectl kustomize {MANIFESTS_BASE} failed: {proc.stderr.strip()}")
    objects = [d for d in yaml.safe_load_all(proc.stdout) if isinstance(d, dict)]
    kept = [o for o in objects if o.get("kind") in BASE_KINDS]
    missing = {"CustomResourceDefinition", "DeviceClass"} - {str(o.get("kind")) for o in kept}
    if missing:
        raise KubeStartFailed(f"manifests/base no longer has a {', '.join(sorted(missing))}")
    return kept


class _PlaneThread(threading.Thread):
    """Starts the control plane, applies the base and starts the nodes' kubelets, then keeps them
    (and their children) until stopped."""

    def __init__(
        self,
        plane: ControlPlane,
        make_kubelets: Callable[[], list[KubeletNode]],
        addresses: NodeAddresses,
    ) -> None:
        super().__init__(name="kube-control-plane", daemon=True)
        self.plane = plane
        self.make_kubelets = make_kubelets  # called once the control plane's CA exists
        self.kubelets: list[KubeletNode] = []
        self.addresses = addresses
        self.started = threading.Event()
        self.stop_requested = threading.Event()
        self.error = ""

    def run(self) -> None:
        try:
            self.plane.start()
            objects = base_objects(self.plane.bin_dir / "kubectl")
            self.plane.kubectl(
                "apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(objects), timeout_s=120.0
            )
            self.plane.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
            self.addresses.add()
            self.kubelets = self.make_kubelets()
            for kubelet in self.kubelets:
                kubelet.start()
        except Exception as exc:
            self.error = _describe(exc)
            log.error("control plane failed to start", error=self.error)
            self._stop()
            self.started.set()
            return
        self.started.set()
        self.stop_requested.wait()
        self._stop()

    def _stop(self) -> None:
        # All at once: one after the other, each kubelet's exit on a loaded machine adds up.
        with ThreadPoolExecutor(
            max_workers=max(1, len(self.kubelets)), thread_name_prefix="kubelet-stop"
        ) as pool:
            for kubelet, error in zip(self.kubelets, pool.map(_stop_kubelet, self.kubelets), strict=True):
                if error:  # the others and the control plane are stopped anyway
                    log.warning("kubelet did not stop cleanly", node=kubelet.name, error=error)
        try:
            self.addresses.remove()
        except Exception as exc:
            log.warning(
                "node IPs not removed (the kernel drops them after their lifetime)", error=_describe(exc)
            )
        self.plane.stop()


def _stop_kubelet(kubelet: KubeletNode) -> str:
    """Stop one node's kubelet and runtime; what went wrong ("" if nothing)."""
    try:
        kubelet.stop()
    except Exception as exc:
        return _describe(exc)
    return ""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        return f"{' '.join(map(str, exc.cmd[:4]))} ... failed: {(exc.stderr or '').strip()[:2000]}"
    return f"{type(exc).__name__}: {exc}"


class KubeMode:
    """What the supervisor adds in Kubernetes mode; start() before the services, stop() after."""

    def __init__(self, layout: StateLayout, config: SimConfig, cluster: ClusterDescription) -> None:
        self.layout = layout
        self.config = config
        self.cluster = cluster
        binaries = Binaries(bin_dir=Path(config.kube_bin_dir), etcd=Path(config.kube_etcd))
        self.scheduler_config_file = layout.kube_dir / "kube-scheduler-extender.yaml"
        self.plane = ControlPlane(
            binaries,
            layout.kube_dir,
            scheduler_config=self.scheduler_config_file,
            startup_timeout_s=STARTUP_TIMEOUT_S,
            # Real kubelets renew their leases: the node lifecycle controller runs, as in a cluster.
            controllers="*",
            controller_manager_args=list(NODE_LIFECYCLE_ARGS),
        )
        self.minor = binaries.minor
        self.extender_port = free_port()
        self.addresses = NodeAddresses(node_ip(cluster.address_block, i) for i in range(cluster.node_count))
        self._thread: _PlaneThread | None = None

    @property
    def kubeconfig(self) -> Path:
        return self.plane.kubeconfig

    @property
    def bin_dir(self) -> Path:
        return self.plane.bin_dir

    def adapt(self, specs: Sequence[ServiceSpec]) -> list[ServiceSpec]:
        return kubernetes_specs(specs, kubeconfig=self.kubeconfig, extender_port=self.extender_port)

    def kubelets(self) -> list[KubeletNode]:
        """Each simulated node's kubelet on crisim, its files under the node's folder (`host/`)."""
        out = []
        for node, ip in zip(self.cluster.nodes(), self.addresses.addresses, strict=True):
            dirs = self.layout.node(node.name)
            state_dir = dirs.root / "host"
            out.append(
                KubeletNode(
                    name=node.name,
                    ip=ip,
                    kubelet_dir=dirs.kubelet_dir,
                    state_dir=state_dir,
                    bin_dir=Path(self.config.kube_node_bin_dir),
                    kubeconfig=self.plane.node_kubeconfig(node.name, state_dir / "pki"),
                    log_dir=self.layout.logs_dir,
                    minor=self.minor,
                    labels={CLIQUE_LABEL: node.clique},
                    cdi_root=dirs.cdi_root,
                    gpus=self.cluster.gpus_per_tray,
                )
            )
        return out

    async def start(self) -> None:
        """Start the control plane (the scheduler with our extender), apply the base, start the
        kubelets and wait until each has registered its Node (as on a real node, before its kubelet
        plugin publishes a ResourceSlice owned by the Node)."""
        deadline = asyncio.get_running_loop().time() + STARTUP_TIMEOUT_S
        self.layout.kube_dir.mkdir(parents=True, exist_ok=True)
        scheduler = self.plane.scheduler_config(extenders=[extender_config(self.extender_port)])
        self.scheduler_config_file.write_text(yaml.safe_dump(scheduler))
        thread = self._thread = _PlaneThread(self.plane, self.kubelets, self.addresses)
        thread.start()
        await asyncio.to_thread(thread.started.wait, STARTUP_TIMEOUT_S + 180.0)
        if not thread.started.is_set():
            raise KubeStartFailed("the Kubernetes control plane did not start in time")
        if thread.error:
            raise KubeStartFailed(f"the Kubernetes control plane did not start: {thread.error}")
        await self.wait_nodes(deadline)

    async def wait_nodes(self, deadline: float) -> None:
        """Until the kubelets have registered a Node for every simulated node."""
        loop = asyncio.get_running_loop()
        names = set(self.cluster.node_names())
        while True:
            found = await asyncio.to_thread(self._kubectl_json, "get", "nodes")
            registered = {n["metadata"]["name"] for n in found.get("items") or []}
            if names <= registered:
                return
            exited = self._exited_kubelet_problem()
            if exited:  # it will not register: no need to wait for the deadline
                raise KubeStartFailed(f"a kubelet exited at start: {exited}")
            if loop.time() > deadline:
                raise KubeStartFailed(
                    f"the kubelets registered {len(names & registered)}/{len(names)} Nodes in time "
                    f"(kubelet logs in {self.layout.logs_dir})"
                )
            await asyncio.sleep(0.25)

    def _exited_kubelet_problem(self) -> str:
        """Why a kubelet that exited did not start, when its log says so ("" otherwise)."""
        thread = self._thread
        for kubelet in thread.kubelets if thread else []:
            if not kubelet.kubelet_running():
                problem = kubelet.startup_problem()
                if problem:
                    return problem
        return ""

    def _kubectl_json(self, *args: str) -> dict[str, Any]:
        proc = self.plane.kubectl(*args, "-o", "json", check=False, timeout_s=KUBECTL_TIMEOUT_S)
        if proc.returncode != 0:
            return {}
        doc: dict[str, Any] = json.loads(proc.stdout)
        return doc

    def usable(self) -> tuple[bool, str]:
        """Whether every simulated node is a Ready Node with its ResourceSlice; else what is missing."""
        nodes = self._kubectl_json("get", "nodes").get("items") or []
        ready = {
            n["metadata"]["name"]
            for n in nodes
            if any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in (n.get("status") or {}).get("conditions") or []
            )
        }
        slices = self._kubectl_json("get", "resourceslices").get("items") or []
        sliced = {
            (s.get("spec") or {}).get("nodeName")
            for s in slices
            if (s.get("spec") or {}).get("driver") == DRIVER_NAME
        }
        names = set(self.cluster.node_names())
        if names <= ready and names <= sliced:
            return True, ""
        return False, (
            f"{len(names & ready)}/{len(names)} Nodes Ready, "
            f"{len(names & sliced)}/{len(names)} with a {DRIVER_NAME} ResourceSlice"
        )

    async def wait_usable(self, deadline: float) -> None:
        """Until a workload applied now would schedule and prepare (Nodes Ready, slices published)."""
        loop = asyncio.get_running_loop()
        while True:
            ok, missing = await asyncio.to_thread(self.usable)
            if ok:
                return
            if loop.time() > deadline:
                raise KubeStartFailed(f"the simulated nodes did not join Kubernetes in time: {missing}")
            await asyncio.sleep(0.5)

    async def stop(self) -> None:
        thread = self._thread
        if thread is None:
            return
        thread.stop_requested.set()
        if not thread.started.is_set():
            # Still starting (a shutdown during the start): ControlPlane.start cannot be
            # interrupted, so end its processes (SIGKILL: a graceful etcd takes ~7 s, and a
            # half-started cluster keeps nothing); its health wait then fails at once.
            kube_dir = str(self.layout.kube_dir)
            starting = [
                p for p in proc_scan.cluster_processes(self.layout) if proc_scan.mentions(p, kube_dir)
            ]
            proc_scan.kill_all(starting, signal.SIGKILL)
        await asyncio.to_thread(thread.join, 60.0)
        if thread.is_alive():
            log.warning("control plane did not stop in time")
        else:
            log.info("control plane stopped")
