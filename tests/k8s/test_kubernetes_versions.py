"""Each supported Kubernetes release takes our DRA objects in the resource.k8s.io version it serves.

The newest (the session's control plane, 1.37) serves v1; the oldest (1.32, started here with
what tools/controlplane/cluster.py sets for it: the DynamicResourceAllocation gate and the beta
API) serves only v1beta1. Discovery, the DeviceClass of the kustomize component and of the Helm
chart, the node agent's ResourceSlice and the controller's workload template are each checked
against the real API server, which validates every field.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio.client import ApiClient, CoreV1Api, V1Namespace, V1ObjectMeta

from libs.kube.resource_api import ServedVersion, discover_version, resource_path
from services.controller.kube.resourceclaimtemplate import ensure_template, remove_template
from services.nodeagent.wire.resourceslice import (
    ResourceSlicePublisher,
    ResourceSliceSettings,
    live_slice_content,
    slice_content,
)
from tests.k8s.conftest import admin_api
from tests.manifests.helm import helm_binary, render
from tests.manifests.objects import NAMESPACE
from tests.manifests.test_resource_versions import render_v1beta1_overlay
from tools.cached_tool import BuildError
from tools.controlplane.binaries import ensure_binaries, supported_minors
from tools.controlplane.cluster import ControlPlane, dra_args, merge_flags, workload_scheduling_args
from tools.controlplane.nodes import create_schedulable_node

pytestmark = pytest.mark.timeout(300)

DEVICE_CLASS = "compute-domain-default-channel.nvidia.com"


@pytest.fixture(scope="module")
def oldest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    try:
        binaries = ensure_binaries(minor=supported_minors()[-1])
    except BuildError as exc:
        pytest.fail(f"building the oldest Kubernetes control plane failed:\n{exc}", pytrace=False)
    cp = ControlPlane(binaries, tmp_path_factory.mktemp("oldest-controlplane"))
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture
async def oldest_api(oldest: ControlPlane) -> AsyncIterator[ApiClient]:
    async with admin_api(oldest) as api:
        yield api


def test_each_release_gets_what_it_needs_to_serve_dra() -> None:
    assert dra_args(37) == (["--runtime-config=resource.k8s.io/v1=true"], [])
    gate = ["--feature-gates=DynamicResourceAllocation=true"]
    assert dra_args(33) == (
        ["--runtime-config=resource.k8s.io/v1beta1=true,resource.k8s.io/v1beta2=true", *gate],
        gate,
    )
    assert dra_args(32) == (["--runtime-config=resource.k8s.io/v1beta1=true", *gate], gate)
    with pytest.raises(RuntimeError, match=r"1\.31 is older than the oldest supported, 1\.32"):
        dra_args(31)


def test_gang_scheduling_is_served_from_1_37_and_never_passed_to_1_32() -> None:
    gates = ["--feature-gates=GenericWorkload=true,TopologyAwareWorkloadScheduling=true"]
    assert workload_scheduling_args(37) == (
        ["--runtime-config=scheduling.k8s.io/v1beta1=true", *gates],
        gates,
    )
    with_job = workload_scheduling_args(37, with_job=True)[1]
    assert with_job == [gates[0] + ",WorkloadWithJob=true"]
    assert workload_scheduling_args(32) == ([], [])
    # One flag of each, so a process listing shows every gate in one place.
    assert merge_flags(
        [
            "--runtime-config=a=true",
            "--feature-gates=X=true",
            "--v=2",
            "--runtime-config=b=true",
            "--feature-gates=Y=true",
        ]
    ) == ["--runtime-config=a=true,b=true", "--feature-gates=X=true,Y=true", "--v=2"]


async def test_discovery_finds_v1_on_the_newest_and_v1beta1_on_the_oldest(
    k8s_api: ApiClient, control_plane: ControlPlane, oldest_api: ApiClient, oldest: ControlPlane
) -> None:
    # The session's control plane is the newest unless CD_K8S_MINOR chose another.
    assert await discover_version(k8s_api) == ("v1" if control_plane.binaries.minor >= 34 else "v1beta1")
    assert await discover_version(oldest_api) == "v1beta1"
    assert oldest.version == "v1.32.13"
    served = oldest.kubectl("api-versions").stdout.split()
    assert "resource.k8s.io/v1beta1" in served and "resource.k8s.io/v1" not in served
    assert "scheduling.k8s.io/v1beta1" not in served  # no PodGroup before 1.37
    newest = control_plane.kubectl("api-versions").stdout.split()
    assert ("scheduling.k8s.io/v1beta1" in newest) == (control_plane.binaries.minor >= 37)


def _apply(
    cp: ControlPlane, objects: list[dict[str, object]], *extra: str
) -> subprocess.CompletedProcess[str]:
    return cp.kubectl(
        "apply", "--server-side", *extra, "-f", "-", input=yaml.safe_dump_all(objects), check=False
    )


def test_the_oldest_takes_the_v1beta1_device_class_of_the_component_and_the_chart(
    oldest: ControlPlane, tmp_path: Path
) -> None:
    base_class = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "x"}}
    refused = _apply(oldest, [base_class], "--dry-run=server")
    assert (
        refused.returncode != 0
        and 'no matches for kind "DeviceClass" in version "resource.k8s.io/v1"' in (refused.stderr)
    )
    component = [o for o in render_v1beta1_overlay(tmp_path) if o["kind"] == "DeviceClass"]
    try:
        helm = helm_binary()
    except BuildError as exc:
        pytest.fail(str(exc), pytrace=False)
    chart = [
        o
        for o in render(helm, NAMESPACE, {"resourceApiVersion": "v1beta1"}, tmp_path)
        if o["kind"] == "DeviceClass"
    ]
    # The chart adds its own labels; the object is the component's.
    assert [(o["apiVersion"], o["spec"]) for o in component] == [(o["apiVersion"], o["spec"]) for o in chart]
    applied = _apply(oldest, component)
    assert applied.returncode == 0, applied.stderr
    live = json.loads(oldest.kubectl("get", "deviceclass", DEVICE_CLASS, "-o", "json").stdout)
    assert live["apiVersion"] == "resource.k8s.io/v1beta1"
    assert live["spec"]["selectors"] == component[0]["spec"]["selectors"]


async def test_the_node_agents_slice_round_trips_in_v1beta1(
    oldest: ControlPlane, oldest_api: ApiClient
) -> None:
    node = f"node-{uuid.uuid4().hex[:8]}"
    created = await create_schedulable_node(CoreV1Api(oldest_api), node)
    publisher = ResourceSlicePublisher(oldest_api, node, ResourceSliceSettings(delete_on_shutdown=True))
    await publisher.sync("uuid-a.0")
    assert publisher.served.known == "v1beta1"
    path = resource_path("v1beta1", "resourceslices", name=publisher.name)
    live = json.loads(oldest.kubectl("get", "--raw", path).stdout)
    assert live["spec"]["devices"][0]["basic"]["attributes"]["cliqueID"] == {"string": "uuid-a.0"}
    assert live_slice_content(live) == slice_content(node, "uuid-a.0")
    assert live["metadata"]["ownerReferences"][0]["uid"] == created.metadata.uid

    await publisher.sync("uuid-b.1")  # the clique changed: rewritten, pool generation bumped
    live = json.loads(oldest.kubectl("get", "--raw", path).stdout)
    assert live_slice_content(live) == slice_content(node, "uuid-b.1")
    assert live["spec"]["pool"]["generation"] == 2
    await publisher.delete()
    assert oldest.kubectl("get", "--raw", path, check=False).returncode != 0


async def test_the_controllers_workload_template_round_trips_in_v1beta1(
    oldest: ControlPlane, oldest_api: ApiClient
) -> None:
    namespace, cd_uid = f"rct-{uuid.uuid4().hex[:6]}", str(uuid.uuid4())
    await CoreV1Api(oldest_api).create_namespace(V1Namespace(metadata=V1ObjectMeta(name=namespace)))
    version = await ServedVersion(oldest_api).get()
    assert (
        await ensure_template(oldest_api, cd_uid, namespace, "channel", "All", version)
    ).outcome == "created"
    assert (
        await ensure_template(oldest_api, cd_uid, namespace, "channel", "All", version)
    ).outcome == "exists"
    path = resource_path(version, "resourceclaimtemplates", namespace, "channel")
    live = json.loads(oldest.kubectl("get", "--raw", path).stdout)
    [request] = live["spec"]["spec"]["devices"]["requests"]
    assert request["deviceClassName"] == DEVICE_CLASS
    assert live["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]["allocationMode"] == "All"
    # Removing drops our finalizer first (an update of the stored object), then deletes it.
    assert await remove_template(oldest_api, namespace, "channel", cd_uid, version)
    assert oldest.kubectl("get", "--raw", path, check=False).returncode != 0
