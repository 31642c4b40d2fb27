"""`cdsim up --kubernetes` as a user drives it: up, `kubectl apply -f examples/...`, Ready, delete, down.

One local cluster (2 NVL72 racks of 5 trays: two cliques of 5 nodes, each a real kubelet on the
simulated container runtime) serves the module, whose tests run in order: the printed KUBECONFIG
works -> `kubectl get nodes -o wide` shows each node's kubelet version and node IP -> every
manifest of examples/ applied in a namespace of its own reaches Ready with its pods Running in one
clique, then is deleted with nothing left (in Kubernetes and in the store) -> `cdsim down` leaves
no process and frees the ports.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import address_blocks
from tests.cdsim.cli import cdsim, ok
from tests.polling import wait_until
from tools.cached_tool import BuildError
from tools.cdsim.layout import StateLayout
from tools.cdsim.proc_scan import KUBE_MARKERS, cluster_processes
from tools.cdsim.run_state import RunState
from tools.cdsim.services import AGENT_HEALTH_PORT, IMEX_AGENT_HEALTH_PORT
from tools.controlplane.binaries import ensure_binaries
from tools.sim.kubelet.addresses import NODE_IP_NETWORK, addresses_in_range

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(900)]

# Two cliques of 5: every example fits one (at most 5 nodes), and 10 kubelets with their control
# plane hold 53 of the 128 inotify instances a user gets (tools/sim/kubelet/inotify.py).
RACKS, TRAYS = 2, 5
ADDRESS_BLOCK = address_blocks.CDSIM
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CLIQUE_LABEL = "nvidia.com/gpu.clique"
READY_TIMEOUT_S = 180.0
GONE_TIMEOUT_S = 120.0


@dataclass
class LocalCluster:
    state_dir: Path
    kubeconfig: Path
    bin_dir: Path
    up_seconds: float
    up_output: str

    @property
    def layout(self) -> StateLayout:
        return StateLayout.at(self.state_dir)

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120.0) -> str:
        proc = subprocess.run(
            [str(self.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check:
            assert proc.returncode == 0, f"kubectl {' '.join(args)}: exit {proc.returncode}\n{proc.stderr}"
        return proc.stdout

    def items(self, kind: str, namespace: str | None = None) -> list[dict[str, Any]]:
        where = ["-n", namespace] if namespace else []
        doc = json.loads(self.kubectl("get", kind, *where, "-o", "json"))
        return list(doc.get("items") or [])


def wait_for_nothing_missing(check: Callable[[], str], what: str, timeout_s: float) -> None:
    """tests/polling.wait_until for a check that returns what is still missing ("" when done),
    reporting the last thing missing when it times out."""
    missing = ""

    def done() -> bool | None:
        nonlocal missing
        missing = check()
        return True if not missing else None

    wait_until(
        done, what, timeout_s, explain=lambda: f"still missing: {missing}", first_delay_s=0.2, max_delay_s=2.0
    )


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As a server binds: connections in TIME_WAIT do not keep a port from being reused.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def local_cluster() -> Iterator[LocalCluster]:
    try:
        ensure_binaries()  # built once by `make setup-k8s`; here it is found in the cache
    except BuildError as exc:
        pytest.fail(f"building the Kubernetes control plane failed:\n{exc}", pytrace=False)
    state_dir = Path(tempfile.mkdtemp(prefix="cdk-"))
    try:
        began = time.monotonic()
        result = cdsim(
            state_dir,
            "up",
            "--kubernetes",
            "--racks",
            str(RACKS),
            "--trays",
            str(TRAYS),
            "--address-block",
            str(ADDRESS_BLOCK),
            timeout=600,
        )
        up_seconds = time.monotonic() - began
        out = ok(result)
        match = re.search(r"^export KUBECONFIG=(\S+) PATH=(\S+):\$PATH$", out, re.MULTILINE)
        assert match, f"no export line in:\n{out}"
        yield LocalCluster(state_dir, Path(match[1]), Path(match[2]), up_seconds, out)
    finally:
        cdsim(state_dir, "down", timeout=180)
        shutil.rmtree(state_dir, ignore_errors=True)


def test_up_prints_a_kubeconfig_that_works(local_cluster: LocalCluster) -> None:
    print(f"cdsim up --kubernetes: {local_cluster.up_seconds:.1f} s to a usable KUBECONFIG")
    print(local_cluster.up_output)
    assert local_cluster.kubeconfig.is_relative_to(local_cluster.state_dir)
    status = ok(cdsim(local_cluster.state_dir, "status"))
    assert f"export KUBECONFIG={local_cluster.kubeconfig} " in status, status
    nodes = local_cluster.items("nodes")
    assert len(nodes) == RACKS * TRAYS
    cliques = set()
    for node in nodes:
        conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert conditions.get("Ready") == "True", node["metadata"]["name"]
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "4"
        cliques.add(node["metadata"]["labels"][CLIQUE_LABEL])
    assert len(cliques) == RACKS
    slices = [
        s for s in local_cluster.items("resourceslices") if s["spec"]["driver"] == "compute-domain.nvidia.com"
    ]
    assert {s["spec"]["nodeName"] for s in slices} == {n["metadata"]["name"] for n in nodes}
    # Owned by their Node, as when kubelet registered the Node first: deleting a Node removes its slice.
    for piece in slices:
        owners = piece["metadata"].get("ownerReferences") or []
        assert [(o["kind"], o["name"]) for o in owners] == [("Node", piece["spec"]["nodeName"])], piece[
            "metadata"
        ]
    assert local_cluster.kubectl(
        "get", "deviceclass", "compute-domain-default-channel.nvidia.com", "-o", "name"
    )
    # The base's RBAC and admission policies are there for users to read; no workload of it is.
    assert local_cluster.kubectl("get", "clusterrole", "-o", "name").count("computedomain") >= 1
    assert not local_cluster.items("pods", "compute-domains-system")


def test_kubectl_get_nodes_wide_shows_a_real_kubelet_on_each_node(local_cluster: LocalCluster) -> None:
    table = local_cluster.kubectl("get", "nodes", "-o", "wide")
    print(f"kubectl get nodes -o wide:\n{table}")
    header, *rows = table.splitlines()
    columns = header.split()
    assert columns[:7] == ["NAME", "STATUS", "ROLES", "AGE", "VERSION", "INTERNAL-IP", "EXTERNAL-IP"], header
    version = ensure_binaries().version
    assert version.startswith("v1."), version
    assert len(rows) == RACKS * TRAYS
    for row in rows:
        _, status, _, _, kubelet_version, internal_ip = row.split()[:6]
        # The version kubelet itself reports in its Node status.
        assert (status, kubelet_version) == ("Ready", version), row
        assert ipaddress.ip_address(internal_ip) in NODE_IP_NETWORK, row
    for node in local_cluster.items("nodes"):
        assert node["status"]["nodeInfo"]["kubeletVersion"] == version, node["metadata"]["name"]


def reservations(kube: LocalCluster) -> str:
    """The advisor's node reservations in the store, as text ("" when there are none)."""
    state = RunState.load(kube.layout)
    assert state is not None
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.cdctl.main",
            "get",
            "reservations",
            # The state dir gives the endpoint and, in a secured run, the client certificate.
            "--state-dir",
            str(kube.layout.root),
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    held = [f"{r['id']}: {r['node_names']}" for r in json.loads(proc.stdout)["items"]]
    return "; ".join(held)


@dataclass(frozen=True)
class Expect:
    pods: int
    domains: dict[str, int]  # ComputeDomain -> nodes it must have
    same_clique: bool = False  # all domains of the example in one clique


EXAMPLE_CASES = {
    "channel-injection-single.yaml": Expect(pods=1, domains={"single-channel": 1}),
    "channel-injection-all.yaml": Expect(pods=1, domains={"all-channels": 1}),
    "torchrun-indexed-job.yaml": Expect(pods=4, domains={"torchrun": 4}),
    "mpi-launcher-workers.yaml": Expect(pods=3, domains={"mpi": 2}),
    "two-domains-one-clique.yaml": Expect(pods=5, domains={"team-a": 2, "team-b": 3}, same_clique=True),
    "gang-podgroup-indexed-job.yaml": Expect(pods=4, domains={"gang": 4}),
}


def test_every_example_is_tested() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(EXAMPLE_CASES)


def _claim_templates(pod: dict[str, Any]) -> set[str]:
    return {c.get("resourceClaimTemplateName") for c in pod["spec"].get("resourceClaims") or []} - {None}


def _template_of(cd: dict[str, Any]) -> str:
    return str(cd["spec"]["channel"]["resourceClaimTemplate"]["name"])


@pytest.mark.parametrize("example", sorted(EXAMPLE_CASES))
def test_example_reaches_ready_and_leaves_nothing(local_cluster: LocalCluster, example: str) -> None:
    expect = EXAMPLE_CASES[example]
    kube = local_cluster
    namespace = f"ex-{uuid.uuid4().hex[:6]}"
    kube.kubectl("create", "namespace", namespace)
    path = str(EXAMPLES / example)
    began = time.monotonic()
    kube.kubectl("apply", "-n", namespace, "-f", path)

    def not_ready() -> str:
        cds = kube.items("computedomains", namespace)
        pods = kube.items("pods", namespace)
        waiting = [c["metadata"]["name"] for c in cds if (c.get("status") or {}).get("status") != "Ready"]
        pending = [p["metadata"]["name"] for p in pods if p["status"].get("phase") != "Running"]
        if waiting or pending or len(pods) != expect.pods or len(cds) != len(expect.domains):
            return f"domains not Ready: {waiting}, pods not Running: {pending}, {len(pods)} pods"
        return ""

    wait_for_nothing_missing(not_ready, f"{example} Ready with {expect.pods} pods Running", READY_TIMEOUT_S)
    print(f"{example}: Ready in {time.monotonic() - began:.1f} s")

    cds = {c["metadata"]["name"]: c for c in kube.items("computedomains", namespace)}
    pods = kube.items("pods", namespace)
    node_clique = {n["metadata"]["name"]: n["metadata"]["labels"][CLIQUE_LABEL] for n in kube.items("nodes")}
    used: dict[str, str] = {}
    for name, nodes in expect.domains.items():
        status = cds[name]["status"]
        members = {n["name"] for n in status["nodes"]}
        assert status["nodeCount"] == nodes == len(members), status
        assert all(n["status"] == "Ready" for n in status["nodes"]), status
        # The domain's pods are on exactly its member nodes, all in one clique.
        on = {p["spec"]["nodeName"] for p in pods if _template_of(cds[name]) in _claim_templates(p)}
        assert on == members
        assert len({node_clique[n] for n in members}) == 1, f"{name} spans cliques: {members}"
        for node in members:
            assert node not in used, f"{node} is in both {used.get(node)} and {name}"
            used[node] = name
    if expect.same_clique:
        assert len({node_clique[n] for n in used}) == 1, f"the domains are in different cliques: {used}"
    if example == "channel-injection-all.yaml":
        (node,) = used
        spec_text = "".join(p.read_text() for p in kube.layout.node(node).cdi_root.glob("*"))
        assert "channel2047" in spec_text, "allocationMode All should inject all 2048 channels"

    # Every pod is bound, so the advisor released what it had reserved for them (with its
    # default TTL, 300 s, the nodes would otherwise stay reserved past the delete below).
    wait_for_nothing_missing(
        lambda: reservations(kube), "the advisor to release the reservations its pods served", 30.0
    )

    kube.kubectl("delete", "-n", namespace, "-f", path, "--wait=true", "--timeout=120s")

    def left() -> str:
        things = {kind: kube.items(kind, namespace) for kind in ("pods", "resourceclaims", "computedomains")}
        found = {kind: [o["metadata"]["name"] for o in objs] for kind, objs in things.items() if objs}
        return str(found) if found else ""

    wait_for_nothing_missing(left, f"everything of {example} to be gone from {namespace}", GONE_TIMEOUT_S)
    # The advisor released its reservations for the domains' pods (once the pods were bound, or
    # when the domain went; its TTL is 300 s), so the next example finds every node free.
    wait_for_nothing_missing(
        lambda: reservations(kube), "the advisor's reservations to be released", GONE_TIMEOUT_S
    )
    assert "nothing of any domain is left" in ok(
        cdsim(kube.state_dir, "check", "--idle", "--settle", "30", timeout=120)
    )
    kube.kubectl("delete", "namespace", namespace, "--wait=false")


def test_down_leaves_no_process_and_frees_the_ports(local_cluster: LocalCluster) -> None:
    layout = local_cluster.layout
    state = RunState.load(layout)
    assert state is not None and state.phase == "ready"
    server = yaml.safe_load(local_cluster.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    apiserver = re.fullmatch(r"https://127\.0\.0\.1:(\d+)", server)
    assert apiserver, server
    ports = [("127.0.0.1", int(apiserver[1]))]
    for endpoint in (state.etcd_endpoint, state.advisor_endpoint):
        host, _, port = endpoint.rpartition(":")
        ports.append((host, int(port)))
    kube_etcd = re.search(
        r"--listen-client-urls=http://127\.0\.0\.1:(\d+)", (layout.kube_dir / "logs" / "etcd.log").read_text()
    )
    assert kube_etcd
    ports.append(("127.0.0.1", int(kube_etcd[1])))
    addresses = {
        info.health_url.split("/")[2].split(":")[0] for info in state.processes.values() if info.node
    }
    ports += [(a, p) for a in addresses for p in (AGENT_HEALTH_PORT, IMEX_AGENT_HEALTH_PORT)]
    assert cluster_processes(layout), "the scan should see the running cluster"
    assert not any(port_free(h, p) for h, p in ports[:4]), "the servers should be listening before down"

    began = time.monotonic()
    out = ok(cdsim(local_cluster.state_dir, "down", timeout=180))
    print(f"cdsim down: {time.monotonic() - began:.1f} s")
    assert "nothing of it runs any more" in out
    assert "leftover" not in out, out  # the supervisor stopped everything itself
    assert cluster_processes(layout) == []
    busy = [(h, p) for h, p in ports if not port_free(h, p)]
    assert not busy, f"ports still in use after down: {busy}"


def test_a_killed_supervisor_takes_the_control_plane_with_it() -> None:
    """SIGKILL of the supervisor (no stop in order): the control plane goes with it, and `down`
    finds and ends whatever else is left."""
    state_dir = Path(tempfile.mkdtemp(prefix="cdk-"))
    try:
        ok(
            cdsim(
                state_dir,
                "up",
                "--kubernetes",
                "--racks",
                "1",
                "--trays",
                "2",
                "--address-block",
                "80",
                timeout=600,
            )
        )
        layout = StateLayout.at(state_dir)
        state = RunState.load(layout)
        assert state is not None
        os.kill(state.supervisor_pid, signal.SIGKILL)

        def control_plane_alive() -> str:
            alive = [p for p in cluster_processes(layout) if any(m in p.command for m in KUBE_MARKERS)]
            return ", ".join(p.command[:60] for p in alive)

        wait_for_nothing_missing(
            control_plane_alive, "the control plane and the kubelets to end with their supervisor", 30.0
        )
        ok(cdsim(state_dir, "down", timeout=180))
        assert cluster_processes(layout) == []
        # Nobody removed the kubelets' node IPs before the kill: down does.
        ips = {str(NODE_IP_NETWORK.network_address + 80 * 1024 + i) for i in (1, 2)}
        assert not ips & set(addresses_in_range()), addresses_in_range()
    finally:
        cdsim(state_dir, "down", timeout=180)
        shutil.rmtree(state_dir, ignore_errors=True)


def test_down_during_a_start_stops_it_at_once() -> None:
    """`cdsim down` while `up --kubernetes` is still starting (minutes on a cold machine) does not
    wait for the start to finish: everything stops, and `up` reports that it failed."""
    state_dir = Path(tempfile.mkdtemp(prefix="cdk-"))
    cluster = ["--racks", "1", "--trays", "2", "--address-block", str(address_blocks.CDSIM_DOWN_DURING_START)]
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tools.cdsim.main",
            "--state-dir",
            str(state_dir),
            "up",
            "--kubernetes",
            *cluster,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        layout = StateLayout.at(state_dir)

        def not_starting() -> str:
            state = RunState.load(layout)
            return "" if state is not None and state.phase == "starting" else "no run.json in phase starting"

        wait_for_nothing_missing(not_starting, "the supervisor to be starting", 60.0)
        began = time.monotonic()
        out = ok(cdsim(state_dir, "down", timeout=180))
        assert "stopped" in out
        print(f"cdsim down during the start: {time.monotonic() - began:.1f} s")
        assert time.monotonic() - began < 10.0, "down waited for the start"
        _, err = up.communicate(timeout=60)
        assert up.returncode == 1, err
        assert "stopped (cdsim down or SIGTERM) before it was up" in err
        assert cluster_processes(layout) == []
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
        cdsim(state_dir, "down", timeout=180)
        shutil.rmtree(state_dir, ignore_errors=True)
