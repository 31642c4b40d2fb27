"""The kubelet shim's pure parts and its plugin client, without a control plane.

What kubelet reads from pods and claims before calling a driver, the objects it writes, the nodes
file, and registration against the node agent's real registration service (and a plugin that
is not the one we want).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from libs.gen import pluginregistration as reg
from libs.runtime.health import Health
from services.nodeagent.wire.registration import RegistrationServer, RegistrationService
from services.nodeagent.wire.unix_socket import start_unix_server, stop_unix_server
from tools.sim.hardware.cluster import ClusterDescription
from tools.sim.kubeletshim import plugin
from tools.sim.kubeletshim.nodes import (
    CLIQUE_LABEL,
    NodesFileError,
    ShimNode,
    load_nodes_file,
    nodes_document,
    nodes_of_cluster,
    parse_nodes,
)
from tools.sim.kubeletshim.objects import event_name, node_status, pod_event, running_pod_status
from tools.sim.kubeletshim.pods import ClaimRef, NotReadyYet, claim_for_driver, claim_names, is_running
from tools.sim.kubeletshim.release import KubeletRelease, minor_of

DRIVER = "compute-domain.nvidia.com"
NOW = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


def _pod(claims: list[dict[str, Any]], statuses: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "pod-uid", "resourceVersion": "7"},
        "spec": {"containers": [{"name": "main", "image": "img:1"}, {"name": "side", "image": "img:2"}]},
        "status": {"phase": "Pending"},
    }
    pod["spec"]["resourceClaims"] = claims
    if statuses is not None:
        pod["status"]["resourceClaimStatuses"] = statuses
    return pod


def _claim(results: list[dict[str, Any]] | None, reserved_for: list[str]) -> dict[str, Any]:
    status: dict[str, Any] = {
        "reservedFor": [{"resource": "pods", "name": "p", "uid": u} for u in reserved_for]
    }
    if results is not None:
        status["allocation"] = {"devices": {"results": results}}
    return {"metadata": {"namespace": "ns", "name": "c", "uid": "claim-uid"}, "status": status}


# ---- pods ------------------------------------------------------------------------------------


def test_claim_names_follow_spec_order_with_direct_and_generated_claims() -> None:
    pod = _pod(
        [
            {"name": "a", "resourceClaimTemplateName": "tmpl"},
            {"name": "b", "resourceClaimName": "shared"},
            {"name": "c", "resourceClaimTemplateName": "optional"},
        ],
        [{"name": "a", "resourceClaimName": "p-a-xyz"}, {"name": "c"}],  # c: no claim was needed
    )
    assert claim_names(pod) == ["p-a-xyz", "shared"]


def test_claim_names_wait_for_the_resourceclaim_controller() -> None:
    pod = _pod([{"name": "a", "resourceClaimTemplateName": "tmpl"}], [])
    with pytest.raises(NotReadyYet, match="'a' has not been created yet"):
        claim_names(pod)


def test_claim_for_driver_needs_allocation_and_reservation_for_this_pod() -> None:
    ours = [{"request": "channel", "driver": DRIVER, "pool": "n1", "device": "channel-0"}]
    with pytest.raises(NotReadyYet, match="not allocated"):
        claim_for_driver(_claim(None, ["pod-uid"]), "pod-uid", DRIVER)
    with pytest.raises(NotReadyYet, match="not reserved for the pod"):
        claim_for_driver(_claim(ours, ["other-pod"]), "pod-uid", DRIVER)
    assert claim_for_driver(_claim(ours, ["pod-uid"]), "pod-uid", DRIVER) == ClaimRef("ns", "c", "claim-uid")
    gpu = [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0"}]
    assert claim_for_driver(_claim(gpu, ["pod-uid"]), "pod-uid", DRIVER) is None


def test_running_status_marks_every_container_ready_and_is_recognised() -> None:
    pod = _pod([])
    status = running_pod_status(pod, "127.1.0.3", NOW)
    assert status["phase"] == "Running" and status["podIP"] == "127.1.0.3"
    assert [c["name"] for c in status["containerStatuses"]] == ["main", "side"]
    assert all(
        c["ready"] and c["state"]["running"]["startedAt"] == "2026-01-02T03:04:05Z"
        for c in status["containerStatuses"]
    )
    assert not is_running(pod)
    assert is_running({**pod, "status": status})


def test_events_of_the_same_failure_share_one_object_and_name_the_pod() -> None:
    a = pod_event(_pod([]), "n1", "FailedPrepareDynamicResources", "boom", NOW)
    b = pod_event(_pod([]), "n1", "FailedPrepareDynamicResources", "boom", NOW)
    c = pod_event(_pod([]), "n1", "FailedPrepareDynamicResources", "other", NOW)
    assert a["metadata"]["name"] == b["metadata"]["name"] != c["metadata"]["name"]
    assert a["metadata"]["name"] == event_name("p", "FailedPrepareDynamicResources", "boom")
    assert a["involvedObject"] == {
        "apiVersion": "v1", "kind": "Pod", "name": "p", "namespace": "ns", "uid": "pod-uid", "resourceVersion": "7"
    }  # fmt: skip
    assert (a["type"], a["source"], a["count"]) == ("Warning", {"component": "kubelet", "host": "n1"}, 1)


def test_node_status_is_ready_with_capacity_and_addresses() -> None:
    node = ShimNode("n1", Path("k"), "127.1.0.1", {CLIQUE_LABEL: "u.1"}, {"cpu": "4", "pods": "10"})
    status = node_status(node, NOW)
    assert status["allocatable"] == status["capacity"] == {"cpu": "4", "pods": "10"}
    assert status["conditions"][0]["type"] == "Ready" and status["conditions"][0]["status"] == "True"
    assert status["addresses"][0] == {"type": "InternalIP", "address": "127.1.0.1"}
    assert node.all_labels == {"kubernetes.io/hostname": "n1", CLIQUE_LABEL: "u.1"}


# ---- nodes file ------------------------------------------------------------------------------


def test_nodes_of_a_simulated_cluster_carry_clique_label_and_cdsim_kubelet_dir(tmp_path: Path) -> None:
    cluster = ClusterDescription(racks=2, trays_per_rack=3, address_block=77)
    nodes = nodes_of_cluster(cluster, tmp_path)
    assert [n.name for n in nodes] == list(cluster.node_names())
    first = nodes[0]
    assert first.kubelet_dir == tmp_path / "rack0-tray0" / "kubelet"
    assert first.address == cluster.node("rack0-tray0").address
    assert first.labels[CLIQUE_LABEL] == cluster.node("rack0-tray0").clique
    assert nodes[0].labels[CLIQUE_LABEL] != nodes[3].labels[CLIQUE_LABEL]  # one clique per rack
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps(nodes_document(nodes)))
    assert load_nodes_file(path) == nodes


@pytest.mark.parametrize(
    ("doc", "problem"),
    [
        ([], '"nodes" list'),
        ({"nodes": [{"kubeletDir": "k"}]}, r"nodes\[0\].name"),
        ({"nodes": [{"name": "a"}]}, r"nodes\[0\].kubeletDir"),
        ({"nodes": [{"name": "a", "kubeletDir": "k"}, {"name": "a", "kubeletDir": "k"}]}, "listed twice"),
        ({"nodes": [{"name": "a", "kubeletDir": "k", "labels": {"x": 1}}]}, r"nodes\[0\].labels"),
    ],
)
def test_malformed_nodes_file_names_the_field(doc: Any, problem: str) -> None:
    with pytest.raises(NodesFileError, match=problem):
        parse_nodes(doc)


# ---- plugin registration ---------------------------------------------------------------------


@pytest.fixture
def kubelet_dir() -> Any:
    # Short: unix socket paths must stay under 108 bytes.
    with tempfile.TemporaryDirectory(prefix="shim-") as d:
        yield Path(d)


@pytest.fixture
async def agent_registration(kubelet_dir: Path) -> AsyncIterator[RegistrationService]:
    """The node agent's own registration service on the registry socket."""
    endpoint = kubelet_dir / "plugins" / DRIVER / "dra.sock"
    service = RegistrationService(endpoint, Health())
    server = RegistrationServer(service, plugin.registration_socket(kubelet_dir, DRIVER))
    await server.start()
    try:
        yield service
    finally:
        await server.stop()


async def test_registration_with_the_node_agent_learns_its_dra_socket(
    kubelet_dir: Path, agent_registration: RegistrationService
) -> None:
    info = await plugin.register(kubelet_dir, DRIVER)
    assert info.endpoint == kubelet_dir / "plugins" / DRIVER / "dra.sock"
    assert "v1.DRAPlugin" in info.versions
    assert agent_registration.registered  # the agent was told


class _WrongPlugin(reg.RegistrationBase):
    def __init__(self) -> None:
        self.status: reg.RegistrationStatus | None = None

    async def get_info(self, info_request: reg.InfoRequest) -> reg.PluginInfo:
        return reg.PluginInfo(
            type="DRAPlugin", name="gpu.example.com", endpoint="/x.sock", supported_versions=["v1.DRAPlugin"]
        )

    async def notify_registration_status(
        self, registration_status: reg.RegistrationStatus
    ) -> reg.RegistrationStatusResponse:
        self.status = registration_status
        return reg.RegistrationStatusResponse()


async def test_registration_of_another_driver_is_rejected_and_the_plugin_told_why(kubelet_dir: Path) -> None:
    wrong = _WrongPlugin()
    server = await start_unix_server([wrong], plugin.registration_socket(kubelet_dir, DRIVER))
    try:
        with pytest.raises(plugin.RegistrationRejected, match=r"gpu\.example\.com"):
            await plugin.register(kubelet_dir, DRIVER)
    finally:
        await stop_unix_server(server, plugin.registration_socket(kubelet_dir, DRIVER))
    assert wrong.status is not None and not wrong.status.plugin_registered
    assert "gpu.example.com" in wrong.status.error


def test_the_kubelet_plays_the_control_planes_release() -> None:
    new, old = KubeletRelease("v1.37.2", "v1"), KubeletRelease("v1.32.13", "v1beta1")
    assert new.kubelet_version == "v1.37.2-kubeletshim"
    assert node_status(ShimNode("n1", Path("/k")), NOW, None, old.kubelet_version)["nodeInfo"][
        "kubeletVersion"
    ] == ("v1.32.13-kubeletshim")
    # From 1.34 kubelet prefers the v1 DRA service and still takes v1beta1; before, only v1beta1.
    assert new.dra_services == ("v1.DRAPlugin", "v1beta1.DRAPlugin")
    assert old.dra_services == ("v1beta1.DRAPlugin",)
    assert KubeletRelease("v1.33.5").dra_services == ("v1beta1.DRAPlugin",)
    assert minor_of("v1.34.1-eks.3") == 34
    with pytest.raises(ValueError, match="not a Kubernetes version"):
        minor_of("latest")


async def test_a_132_kubelet_registers_the_node_agent_on_v1beta1(
    kubelet_dir: Path, agent_registration: RegistrationService
) -> None:
    info = await plugin.register(kubelet_dir, DRIVER, KubeletRelease("v1.32.13").dra_services)
    assert info.service == "v1beta1.DRAPlugin"
    newest = await plugin.register(kubelet_dir, DRIVER)
    assert newest.service == "v1.DRAPlugin"


def test_a_plugin_without_a_service_the_kubelet_knows_is_refused() -> None:
    only_v1 = reg.PluginInfo(
        type="DRAPlugin", name=DRIVER, endpoint="/x.sock", supported_versions=["v1.DRAPlugin"]
    )
    assert plugin.check_info(only_v1, DRIVER) == ""
    problem = plugin.check_info(only_v1, DRIVER, KubeletRelease("v1.32.13").dra_services)
    assert problem == "plugin supports ['v1.DRAPlugin'], none of ['v1beta1.DRAPlugin']"


async def test_no_plugin_socket_is_a_call_error(kubelet_dir: Path) -> None:
    with pytest.raises(plugin.CALL_ERRORS) as caught:
        await plugin.register(kubelet_dir, DRIVER)
    assert "not available" in plugin.describe_call_error(caught.value)


def test_grpclibs_lost_connection_error_is_a_connection_error() -> None:
    """grpclib's AttributeError for a peer gone mid-call is retried like a lost connection;
    any other AttributeError is a bug and goes through."""
    with pytest.raises(ConnectionResetError, match="lost during the call"):
        with plugin.connection_errors():
            raise AttributeError("'Connection' object has no attribute '_transport'")
    with pytest.raises(AttributeError, match="spelling"):
        with plugin.connection_errors():
            raise AttributeError("spelling")
