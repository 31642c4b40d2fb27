"""Smoke tests: the loopback control plane serves DRA and really allocates devices."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

import pytest
from kubernetes_asyncio.client import (
    ApiClient,
    CoreV1Api,
    CoreV1ResourceClaim,
    ResourceV1Api,
    V1CELDeviceSelector,
    V1Container,
    V1Device,
    V1DeviceAttribute,
    V1DeviceClaim,
    V1DeviceClass,
    V1DeviceClassSpec,
    V1DeviceRequest,
    V1DeviceSelector,
    V1ExactDeviceRequest,
    V1Namespace,
    V1ObjectMeta,
    V1Pod,
    V1PodResourceClaim,
    V1PodSpec,
    V1ResourceClaimSpec,
    V1ResourceClaimTemplate,
    V1ResourceClaimTemplateSpec,
    V1ResourcePool,
    V1ResourceRequirements,
    V1ResourceSlice,
    V1ResourceSliceSpec,
)
from kubernetes_asyncio.client.exceptions import ApiException

from tests.polling import eventually
from tools.controlplane.cluster import ControlPlane
from tools.controlplane.nodes import create_schedulable_node

pytestmark = pytest.mark.e2e

DRIVER = "compute-domain.nvidia.com"
T = TypeVar("T")


async def _ignore_not_found(call: Awaitable[Any]) -> None:
    try:
        await call
    except ApiException as exc:
        if exc.status != 404:
            raise


def _channel_slice(name: str, node: str, run_id: str) -> V1ResourceSlice:
    return V1ResourceSlice(
        metadata=V1ObjectMeta(name=name),
        spec=V1ResourceSliceSpec(
            driver=DRIVER,
            node_name=node,
            pool=V1ResourcePool(name=node, generation=1, resource_slice_count=1),
            devices=[
                V1Device(
                    name="channel-0",
                    attributes={
                        "type": V1DeviceAttribute(string="channel"),
                        "id": V1DeviceAttribute(int=0),
                        # Isolates this test's devices from other tests sharing the cluster.
                        "testRun": V1DeviceAttribute(string=run_id),
                    },
                )
            ],
        ),
    )


def _channel_class(name: str, run_id: str) -> V1DeviceClass:
    expression = (
        f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "channel" '
        f'&& device.attributes["{DRIVER}"].testRun == "{run_id}"'
    )
    return V1DeviceClass(
        metadata=V1ObjectMeta(name=name),
        spec=V1DeviceClassSpec(selectors=[V1DeviceSelector(cel=V1CELDeviceSelector(expression=expression))]),
    )


def _channel_claim_template(name: str, class_name: str) -> V1ResourceClaimTemplate:
    request = V1DeviceRequest(name="channel", exactly=V1ExactDeviceRequest(device_class_name=class_name))
    return V1ResourceClaimTemplate(
        metadata=V1ObjectMeta(name=name),
        spec=V1ResourceClaimTemplateSpec(spec=V1ResourceClaimSpec(devices=V1DeviceClaim(requests=[request]))),
    )


def _workload_pod(name: str, template: str) -> V1Pod:
    container = V1Container(
        name="main",
        image="registry.invalid/workload:1",
        resources=V1ResourceRequirements(claims=[CoreV1ResourceClaim(name="channel")]),
    )
    return V1Pod(
        metadata=V1ObjectMeta(name=name),
        spec=V1PodSpec(
            containers=[container],
            resource_claims=[V1PodResourceClaim(name="channel", resource_claim_template_name=template)],
        ),
    )


async def test_kubectl_lists_dra_resources_in_resource_k8s_io_v1(control_plane: ControlPlane) -> None:
    resources = control_plane.kubectl("api-resources", "--api-group=resource.k8s.io", "-o", "wide").stdout
    rows = {line.split()[0]: line.split() for line in resources.splitlines()[1:] if line.strip()}
    for kind in ("deviceclasses", "resourceclaims", "resourceclaimtemplates", "resourceslices"):
        assert kind in rows, f"{kind} missing from:\n{resources}"
        assert "resource.k8s.io/v1" in rows[kind], rows[kind]
    versions = control_plane.kubectl("api-versions").stdout.split()
    assert "resource.k8s.io/v1" in versions


async def test_device_class_and_resource_slice_round_trip(k8s_api: ApiClient) -> None:
    resource = ResourceV1Api(k8s_api)
    run_id = uuid.uuid4().hex[:8]
    node, class_name, slice_name = f"node-{run_id}", f"channel-{run_id}", f"slice-{run_id}"
    try:
        await resource.create_device_class(_channel_class(class_name, run_id))
        await resource.create_resource_slice(_channel_slice(slice_name, node, run_id))

        device_class = await resource.read_device_class(class_name)
        assert f'.testRun == "{run_id}"' in device_class.spec.selectors[0].cel.expression
        read_slice = await resource.read_resource_slice(slice_name)
        assert read_slice.spec.driver == DRIVER
        assert read_slice.spec.node_name == node
        assert read_slice.spec.pool.name == node
        assert [d.name for d in read_slice.spec.devices] == ["channel-0"]
        assert read_slice.spec.devices[0].attributes["testRun"].string == run_id
    finally:
        await _ignore_not_found(resource.delete_resource_slice(slice_name))
        await _ignore_not_found(resource.delete_device_class(class_name))


async def test_scheduler_binds_pod_and_allocates_channel_from_our_slice(k8s_api: ApiClient) -> None:
    core, resource = CoreV1Api(k8s_api), ResourceV1Api(k8s_api)
    run_id = uuid.uuid4().hex[:8]
    namespace, node = f"smoke-{run_id}", f"node-{run_id}"
    class_name, slice_name, template = f"channel-{run_id}", f"slice-{run_id}", "channel"
    try:
        await core.create_namespace(V1Namespace(metadata=V1ObjectMeta(name=namespace)))
        await create_schedulable_node(core, node)
        await resource.create_device_class(_channel_class(class_name, run_id))
        await resource.create_resource_slice(_channel_slice(slice_name, node, run_id))
        await resource.create_namespaced_resource_claim_template(
            namespace, _channel_claim_template(template, class_name)
        )
        await core.create_namespaced_pod(namespace, _workload_pod("workload", template))

        async def bound_node() -> str | None:
            pod = await core.read_namespaced_pod("workload", namespace)
            return pod.spec.node_name or None

        assert await eventually(bound_node, "the scheduler to bind the pod", 30.0) == node

        async def allocated_claim() -> Any:
            pod = await core.read_namespaced_pod("workload", namespace)
            statuses = pod.status.resource_claim_statuses or []
            if not statuses or not statuses[0].resource_claim_name:
                return None
            claim = await resource.read_namespaced_resource_claim(statuses[0].resource_claim_name, namespace)
            return claim if claim.status and claim.status.allocation else None

        claim = await eventually(allocated_claim, "the claim's allocation", 30.0)
        results = claim.status.allocation.devices.results
        assert [(r.request, r.driver, r.pool, r.device) for r in results] == [
            ("channel", DRIVER, node, "channel-0")
        ]
        pod = await core.read_namespaced_pod("workload", namespace)
        assert [ref.uid for ref in claim.status.reserved_for] == [pod.metadata.uid]
        # The allocation pins the claim to our node, as a kubelet plugin would rely on.
        terms = claim.status.allocation.node_selector.node_selector_terms
        assert any(
            f.key == "metadata.name" and f.values == [node] for t in terms for f in (t.match_fields or [])
        )
    finally:
        # No kubelet finishes graceful deletion of a bound pod; delete it at once.
        await _ignore_not_found(core.delete_namespaced_pod("workload", namespace, grace_period_seconds=0))
        await _ignore_not_found(core.delete_namespace(namespace))
        await _ignore_not_found(resource.delete_resource_slice(slice_name))
        await _ignore_not_found(resource.delete_device_class(class_name))
        await _ignore_not_found(core.delete_node(node))
