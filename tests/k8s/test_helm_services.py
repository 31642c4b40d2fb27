"""What the chart gives each container really starts that program: the chart's etcd and our four
services run here as processes with the command, arguments, environment and mounted files
`helm template` renders, against a control plane of this module's own.

- etcd: three members from the StatefulSet's command, with the certificates the chart made
  (peer TLS, client TLS with client certificates required);
- the roles Job's command: etcd's authentication on, one user and role per component;
- the controller, the placement advisor, and one node's kubelet plugin and IMEX agent, each with
  its own client certificate, so each reaches etcd only as its etcd user: each healthy, the IMEX
  agent's node record written, a ComputeDomain created in Kubernetes mirrored by the controller;
  the advisor, rendered with placementAdvisor.tls on, answers a Place call made with the client
  certificate the chart issued for cd-scheduler and refuses one made without;
  then, with kubelet played on the node by tools/sim/kubeletshim (as `cdsim up --kubernetes` does), a
  pod of the domain's channel claim: the domain turns Ready with the node.

What a pod has that a process here does not is stood in for, and only that: each mount path is a
directory under one root (secrets written there as kubelet writes them), the Pod's network is the
host's (so fixed ports become free ones), the members' DNS names become localhost (their
certificates name it), the in-cluster credentials become an admin kubeconfig, and the node
programs get what manifests/overlays/sim adds for simulated hardware (HARDWARE=simulated and two
flags).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import yaml
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.exceptions import StreamTerminatedError

from libs.gen.computedomain.placement import v1 as pp
from libs.state.config import EtcdConfig
from libs.state.keys import Keys
from libs.state.store import Store
from tests.address_blocks import CHART_SERVICES
from tests.manifests.helm import helm_binary, render
from tests.manifests.objects import REPO_ROOT, Obj, container, env_values, find, of_kind, pod_spec
from tests.polling import wait_until
from tools.cached_tool import BuildError
from tools.cdsim import proc_scan
from tools.controlplane.binaries import Binaries
from tools.controlplane.cluster import ControlPlane, die_with_parent
from tools.net_ports import free_port
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.hardware.simulated import prepare_node_dirs

pytestmark = pytest.mark.timeout(240)

NAMESPACE = "cd-chart"
HEALTH_TIMEOUT_S = 60.0
DOMAIN_TIMEOUT_S = 90.0
ETCD_TIMEOUT_S = 60.0
MEMBERS = 3
BIN = Path(sys.executable).parent
# Flags naming a port the program listens on (the Pod network is the host's here).
PORT_FLAGS = ("--health-port", "--grpc-port", "--extender-port")
# The manifests/overlays/sim additions for simulated hardware (both node DaemonSets).
SIM_CLUSTER = "/etc/computedomains/sim/cluster.json"
SIM_STATE = "/var/lib/computedomains/sim"
# Flags whose value is a path in the container.
PATH_FLAG = re.compile(r"-(file|dir|root|binary|cluster)$")
# The chart's own switches this run turns on beside its defaults.
VALUES = {"placementAdvisor": {"tls": {"enabled": True}}, "schedulerPlugin": {"enabled": True}}
ADVISOR_NAME = f"cd-placement-advisor.{NAMESPACE}.svc"
# How a refused handshake reaches a grpclib client: the connection goes, the call fails.
REFUSED = (OSError, ssl.SSLError, ConnectionError, StreamTerminatedError)


@pytest.fixture(scope="module")
def cluster(
    control_plane_binaries: Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    cp = ControlPlane(control_plane_binaries, tmp_path_factory.mktemp("helm-services"))
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


class Processes:
    """The programs started here, stopped (SIGTERM, then SIGKILL) at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.running: dict[str, tuple[subprocess.Popen[bytes], IO[bytes]]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            argv, env={"PATH": os.environ["PATH"], **env}, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )  # fmt: skip
        self.running[name] = (proc, log)

    def tail(self, name: str) -> str:
        return "\n".join((self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-20:])

    def exited(self, name: str) -> bool:
        return self.running[name][0].poll() is not None

    def stop(self) -> None:
        for proc, _ in self.running.values():
            proc.terminate()
        for proc, log in self.running.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


class Host:
    """One host's files: hostPath volumes under `root/host`, each container's own under
    `root/<container>`; a container's paths are resolved through its mounts, as in a Pod."""

    def __init__(self, root: Path, objects: list[Obj]) -> None:
        self.root = root
        self.secrets = {s["metadata"]["name"]: s for s in of_kind(objects, "Secret")}
        # The sim overlay's: the cluster description (a ConfigMap) and the state (a hostPath).
        self.shared = {
            SIM_CLUSTER.rpartition("/")[0]: self.host(SIM_CLUSTER.rpartition("/")[0]),
            SIM_STATE: self.host(SIM_STATE),
        }

    def host(self, path: str) -> Path:
        return self.root / "host" / path.lstrip("/")

    def container(self, name: str, workload: Obj, c: dict[str, Any]) -> Fs:
        volumes = {v["name"]: v for v in pod_spec(workload).get("volumes") or []}
        fs = Fs(self.root / name, dict(self.shared), self.root / "host")
        for m in c.get("volumeMounts") or []:
            volume = volumes.get(m["name"]) or {}
            if "hostPath" in volume:
                target = self.host(volume["hostPath"]["path"])
            else:  # a Secret, an emptyDir, a claim: the container's own
                target = fs.root / m["mountPath"].lstrip("/")
            target.mkdir(parents=True, exist_ok=True)
            fs.mounts[m["mountPath"]] = target
            secret = volume.get("secret")
            if secret:
                for key, data in self.secrets[secret["secretName"]]["data"].items():
                    (target / key).write_bytes(base64.b64decode(data))
                    (target / key).chmod(secret.get("defaultMode", 0o644))
        return fs


class Fs:
    def __init__(self, root: Path, mounts: dict[str, Path], host_root: Path) -> None:
        self.root = root
        self.mounts = mounts
        self.host_root = host_root

    def local(self, flag: str, value: str) -> str:
        """A path flag's value as a path here: through the container's mounts; a path outside
        them (the kubelet dir the plugin directories are mounted from, the driver root where the
        host's /dev is) as the host's."""
        if not PATH_FLAG.search(flag) or not value.startswith("/"):
            return value
        for mount in sorted(self.mounts, key=len, reverse=True):
            if value == mount or value.startswith(mount.rstrip("/") + "/"):
                return str(self.mounts[mount] / value[len(mount) :].lstrip("/"))
        return str(self.host_root / value.lstrip("/"))


def expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def wait_healthy(procs: Processes, name: str, url: str) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        assert not procs.exited(name), f"{name} exited:\n{procs.tail(name)}"
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    pytest.fail(f"{name}: {url} not healthy after {HEALTH_TIMEOUT_S:.0f} s:\n{procs.tail(name)}")


def wait_node_ready(procs: Processes, cp: ControlPlane, node_name: str) -> None:
    """The kubelet shim registered the Node and reports it Ready."""
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        assert not procs.exited("kubeletshim"), f"kubeletshim exited:\n{procs.tail('kubeletshim')}"
        got = cp.kubectl("get", "node", node_name, "-o", "json", check=False)
        if got.returncode == 0:
            conditions = json.loads(got.stdout).get("status", {}).get("conditions", [])
            if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
                return
        time.sleep(0.3)
    pytest.fail(f"Node {node_name} not Ready after {HEALTH_TIMEOUT_S:.0f} s:\n{procs.tail('kubeletshim')}")


def start_etcd(procs: Processes, host: Host, objects: list[Obj], etcd_binary: Path) -> str:
    """The StatefulSet's members; returns the client endpoints, host:port,..."""
    etcd = find(objects, "StatefulSet", "cd-etcd")
    c = container(etcd)
    ports = {i: (free_port(), free_port(), free_port()) for i in range(MEMBERS)}
    # https://cd-etcd-<i>.cd-etcd.<namespace>.svc:<port> -> https://localhost:<member's port>
    member_url = re.compile(rf"https://(cd-etcd-(\d)|\$\(POD_NAME\))\.cd-etcd\.{NAMESPACE}\.svc:(2379|2380)")
    for i in range(MEMBERS):
        client, peer, metrics = ports[i]

        def localhost(m: re.Match[str], i: int = i) -> str:
            member = int(m.group(2)) if m.group(2) else i
            port = ports[member][0] if m.group(3) == "2379" else ports[member][1]
            return f"https://localhost:{port}"

        fs = host.container(f"etcd-{i}", etcd, c)
        argv = [str(etcd_binary)]
        for arg in c["command"][1:]:
            flag, _, value = arg.partition("=")
            value = member_url.sub(localhost, value)
            value = value.replace("0.0.0.0:2379", f"127.0.0.1:{client}").replace(
                "0.0.0.0:2380", f"127.0.0.1:{peer}"
            )
            value = value.replace("0.0.0.0:2381", f"127.0.0.1:{metrics}")
            value = fs.local(flag, value)
            argv.append(f"{flag}={value}" if value or "=" in arg else flag)
        argv = [expand(a, {"POD_NAME": f"cd-etcd-{i}"}) for a in argv]
        procs.start(f"etcd-{i}", argv, {})
    for i in range(MEMBERS):
        wait_healthy(procs, f"etcd-{i}", f"http://127.0.0.1:{ports[i][2]}/readyz")
    return ",".join(f"localhost:{ports[i][0]}" for i in range(MEMBERS))


def run_roles_job(host: Host, objects: list[Obj], endpoints: str) -> str:
    job = find(objects, "Job", "cd-etcd-roles")
    c = container(job)
    fs = host.container("etcd-roles", job, c)
    assert c["command"][:3] == ["python", "-m", "libs.state.enable_auth"]
    env = {**env_values(c), "ETCD_ENDPOINT": endpoints}
    argv = [sys.executable, *c["command"][1:]]
    for arg in c["args"]:
        flag, _, value = arg.partition("=")
        argv.append(f"{flag}={fs.local(flag, expand(value, env))}")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=90, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def start_service(
    procs: Processes, host: Host, workload: Obj, endpoints: str, kubeconfig: Path, downward: dict[str, str]
) -> dict[str, int]:
    """Start the workload's program as the chart renders it; returns the ports it was given
    (--health-port, and the advisor's --grpc-port and --extender-port)."""
    c = container(workload)
    fs = host.container(workload["metadata"]["name"], workload, c)
    env = {k: downward.get(v, v) for k, v in env_values(c).items()}
    env["ETCD_ENDPOINT"] = endpoints
    args = [a for a in c["args"]]
    if env.get("HARDWARE") == "nvml":  # manifests/overlays/sim's additions
        env["HARDWARE"] = "simulated"
        args += [f"--sim-cluster={SIM_CLUSTER}", f"--sim-state-dir={SIM_STATE}"]
    kube_flags = {"--mode=kubernetes", "--claim-source=kubernetes", "--template-source=kubernetes"}
    if kube_flags & set(args):
        args.append(f"--kubeconfig={kubeconfig}")  # in a Pod: its service account
    ports: dict[str, int] = {}
    argv = [str(BIN / c["command"][0])]
    for arg in args:
        flag, _, value = arg.partition("=")
        value = expand(value, env)
        if flag in PORT_FLAGS:
            ports[flag] = free_port()
            value = str(ports[flag])
        elif flag != "--kubeconfig":
            value = fs.local(flag, value)
        argv.append(f"{flag}={value}")
    name = workload["metadata"]["name"]
    procs.start(name, argv, {k: v for k, v in env.items() if not v.startswith("<")})
    return ports


def form_domain(procs: Processes, host: Host, cp: ControlPlane, node_name: str, address: str) -> None:
    """kubelet (tools/sim/kubeletshim, as `cdsim up --kubernetes` plays it) on the node, a pod of
    the domain's channel claim: the domain turns Ready with the node."""
    nodes_file = host.root / "nodes.json"
    kubelet_dir = host.host("/var/lib/kubelet")  # what the plugin's --kubelet-dir is here
    nodes_file.write_text(
        json.dumps({"nodes": [{"name": node_name, "kubeletDir": str(kubelet_dir), "address": address}]})
    )
    procs.start(
        "kubeletshim",
        [sys.executable, "-m", "tools.sim.kubeletshim", f"--kubeconfig={cp.kubeconfig}", f"--nodes-file={nodes_file}",
         "--log-format=json"],
        {"PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    wait_node_ready(procs, cp, node_name)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "chart-worker", "namespace": "default"},
        "spec": {
            "containers": [
                {"name": "worker", "image": "worker", "resources": {"claims": [{"name": "channel"}]}}
            ],
            "resourceClaims": [{"name": "channel", "resourceClaimTemplateName": "chart-domain-channel"}],
        },
    }
    cp.kubectl("create", "-f", "-", input=yaml.safe_dump(pod))
    deadline = time.monotonic() + DOMAIN_TIMEOUT_S
    while True:
        cd = json.loads(
            cp.kubectl("get", "computedomain", "chart-domain", "-n", "default", "-o", "json").stdout
        )
        status = cd.get("status") or {}
        if status.get("status") == "Ready" and [n["name"] for n in status.get("nodes") or []] == [node_name]:
            return
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {name}\n{procs.tail(name)}" for name in procs.running)
            pytest.fail(f"the domain never turned Ready: {status}\n{tails}")
        time.sleep(0.5)


def secret_files(root: Path, host: Host, secret: str) -> Path:
    """A rendered Secret's keys as files in a directory of their own."""
    directory = root / "identities" / secret
    directory.mkdir(parents=True)
    for key, data in host.secrets[secret]["data"].items():
        (directory / key).write_bytes(base64.b64decode(data))
    return directory


async def place(port: int, certificates: Path, *, with_client_certificate: bool) -> pp.PlaceResponse:
    """A dry-run Place for one node, over TLS to ADVISOR_NAME, as cd-scheduler makes it."""
    context = ssl.create_default_context(cafile=str(certificates / "ca.crt"))
    if with_client_certificate:
        context.load_cert_chain(str(certificates / "tls.crt"), str(certificates / "tls.key"))
    context.set_alpn_protocols(["h2"])
    channel = Channel(
        "127.0.0.1", port, ssl=context, config=Configuration(ssl_target_name_override=ADVISOR_NAME)
    )
    try:
        return await pp.PlacementAdvisorStub(channel, timeout=10).place(pp.PlaceRequest(num_nodes=1))
    finally:
        channel.close()


def check_advisor_mtls(procs: Processes, root: Path, host: Host, grpc_port: int) -> None:
    """cd-scheduler's client certificate gets an answer, and a placement once the node is in the
    advisor's inventory; no client certificate gets no answer."""
    scheduler = secret_files(root, host, "cd-scheduler-advisor-client-tls")
    wait_until(
        lambda: asyncio.run(place(grpc_port, scheduler, with_client_certificate=True)).feasible,
        "a feasible placement for cd-scheduler's certificate",
        HEALTH_TIMEOUT_S,
        explain=lambda: procs.tail("cd-placement-advisor"),
    )
    with pytest.raises(REFUSED):
        asyncio.run(place(grpc_port, scheduler, with_client_certificate=False))


def identity(root: Path, host: Host, secret: str, endpoints: str) -> EtcdConfig:
    """A client of the chart's etcd with the certificate of `secret`."""
    directory = secret_files(root, host, secret)
    return EtcdConfig(
        endpoint=endpoints,
        ca_file=str(directory / "ca.crt"),
        cert_file=str(directory / "tls.crt"),
        key_file=str(directory / "tls.key"),
    )


async def keys_under(config: EtcdConfig, prefix: str) -> list[str]:
    async with Store(config) as store:
        found = await store.client.get_prefix(prefix.encode(), keys_only=True)
        return [kv.key.decode() for kv in found]


def test_the_charts_etcd_and_services_start_from_what_it_renders(
    cluster: ControlPlane, control_plane_binaries: Binaries
) -> None:
    try:
        helm = helm_binary()
    except BuildError as exc:
        pytest.fail(str(exc), pytrace=False)
    # Short: unix socket paths under it must stay within 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="cdh-"))
    procs = Processes(root)
    try:
        objects = render(helm, NAMESPACE, VALUES, root)
        cluster.kubectl(
            "apply", "--server-side", "-f", "-",
            input=yaml.safe_dump_all([o for o in objects if o["kind"] in ("CustomResourceDefinition", "DeviceClass")]),
        )  # fmt: skip
        host = Host(root, objects)
        endpoints = start_etcd(procs, host, objects, control_plane_binaries.etcd)
        assert "etcd authentication enabled" in run_roles_job(host, objects, endpoints)
        # After every upgrade too: a no-op once on.
        assert "etcd authentication was on already" in run_roles_job(host, objects, endpoints)

        sim = ClusterDescription(racks=1, trays_per_rack=1, address_block=CHART_SERVICES)
        [node_name] = list(sim.node_names())
        host.host(SIM_CLUSTER).parent.mkdir(parents=True, exist_ok=True)
        sim.save(host.host(SIM_CLUSTER))
        prepare_node_dirs(sim, node_name, host.host(SIM_STATE))
        downward = {"<spec.nodeName>": node_name, "<status.hostIP>": sim.node(node_name).address}
        ports = {
            name: start_service(
                procs, host, find(objects, kind, name), endpoints, cluster.kubeconfig, downward
            )
            for kind, name in (
                ("Deployment", "cd-controller"),
                ("Deployment", "cd-placement-advisor"),
                ("DaemonSet", "cd-imex-agent"),
                ("DaemonSet", "cd-node-agent"),
            )
        }
        for name, given in ports.items():
            wait_healthy(procs, name, f"http://127.0.0.1:{given['--health-port']}/healthz")

        # Each wrote what it writes, as its own etcd user; etcd refuses a user its role does not
        # allow (the node agent reading the controller's mesh CAs).
        root_config = identity(root, host, "cd-etcd-client-root", endpoints)
        keys = Keys("/cd/v1/")
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while keys.node(node_name) not in asyncio.run(keys_under(root_config, keys.nodes())):
            assert time.monotonic() < deadline, f"no node record:\n{procs.tail('cd-imex-agent')}"
            time.sleep(0.5)
        # The controller, in Kubernetes mode as the chart runs it, mirrors a ComputeDomain into
        # the chart's etcd.
        domain = {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomain",
            "metadata": {"name": "chart-domain", "namespace": "default"},
            "spec": {"numNodes": 1, "channel": {"resourceClaimTemplate": {"name": "chart-domain-channel"}}},
        }
        uid = cluster.kubectl(
            "create", "-o", "jsonpath={.metadata.uid}", "-f", "-", input=yaml.safe_dump(domain)
        ).stdout
        while keys.domain(uid) not in asyncio.run(keys_under(root_config, keys.domains())):
            assert time.monotonic() < deadline, f"the domain was not mirrored:\n{procs.tail('cd-controller')}"
            time.sleep(0.5)
        check_advisor_mtls(procs, root, host, ports["cd-placement-advisor"]["--grpc-port"])
        form_domain(procs, host, cluster, node_name, sim.node(node_name).address)
        as_agent = identity(root, host, "cd-etcd-client-node-agent", endpoints)
        with pytest.raises(Exception, match="permission denied"):
            asyncio.run(keys_under(as_agent, keys.mesh_authorities()))
    finally:
        procs.stop()
        # The IMEX agent leaves its daemons running when it stops (the next agent adopts them):
        # left alive, they hold the node's IMEX ports for the next run.
        proc_scan.kill_all(proc_scan.imex_daemons_under(root))
        shutil.rmtree(root, ignore_errors=True)
