"""The oldest supported Kubernetes (1.32) end to end, on a smaller cluster: one rack of 4 nodes.

1.32 serves DRA only as beta, off by default, and only as resource.k8s.io/v1beta1; its kubelet
speaks only the v1beta1 DRA gRPC service. The control plane is started as an operator would
(feature gate, runtime config), each node runs 1.32's kubelet, the DeviceClass comes from manifests/components/resource-v1beta1,
and every service finds the version on its own. An Indexed Job of 4 pods forms a Ready domain
through the real scheduler (with our extender) and controller manager; deleting the Job and then
the ComputeDomain leaves nothing behind. The full suite runs on the newest release (1.37).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import pytest
from kubernetes_asyncio.client import ApiClient

from libs.invariants.checker import check_store_invariants
from libs.state.store import Store
from tests.e2e import kube
from tests.e2e.conftest import admin_api, fresh_namespace, oldest_binaries, running, services_store
from tests.e2e.harness import DEVICE_CLASS, DRIVER, E2EEnvironment, iter_lines
from tests.e2e.scenario import (
    apply_example_cd,
    cdi_spec_exists,
    delete_cd_and_wait_gone,
    delete_job_and_wait_released,
    wait_cd_ready,
    wait_job_running,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NODES = 4


@pytest.fixture(scope="module")
def oldest_env() -> Iterator[E2EEnvironment]:
    env = E2EEnvironment(oldest_binaries(), racks=1, trays=NODES, kubelets="real")
    with running(env):
        yield env


@pytest.fixture
async def oldest_api(oldest_env: E2EEnvironment) -> AsyncIterator[ApiClient]:
    async with admin_api(oldest_env) as api:
        yield api


@pytest.fixture
async def oldest_store(oldest_env: E2EEnvironment) -> AsyncIterator[Store]:
    async with services_store(oldest_env) as store:
        yield store


@pytest.fixture
async def oldest_namespace(oldest_api: ApiClient) -> AsyncIterator[str]:
    async with fresh_namespace(oldest_api, "e2e-oldest") as name:
        yield name


def _server_minor(env: E2EEnvironment) -> str:
    version = json.loads(env.cp.kubectl("version", "-o", "json").stdout)
    return str(version["serverVersion"]["minor"])


async def test_a_job_forms_a_ready_domain_on_the_oldest_kubernetes_and_teardown_leaves_nothing(
    oldest_env: E2EEnvironment, oldest_api: ApiClient, oldest_store: Store, oldest_namespace: str
) -> None:
    env, api, store, namespace = oldest_env, oldest_api, oldest_store, oldest_namespace
    assert _server_minor(env) == "32"
    assert await kube.resource_api(api) == "v1beta1"
    device_class = json.loads(env.cp.kubectl("get", "deviceclass", DEVICE_CLASS, "-o", "json").stdout)
    assert device_class["apiVersion"] == "resource.k8s.io/v1beta1"

    # Each node agent published its slice in the v1beta1 shape (attributes under `basic`).
    slices = json.loads(env.cp.kubectl("get", "resourceslices", "-o", "json").stdout)["items"]
    ours = [s for s in slices if s["spec"]["driver"] == DRIVER]
    assert sorted(s["spec"]["nodeName"] for s in ours) == sorted(env.node_names)
    for item in ours:
        assert item["apiVersion"] == "resource.k8s.io/v1beta1"
        [device] = item["spec"]["devices"]
        assert device["basic"]["attributes"]["type"] == {"string": "channel"}

    cd_name, template, job = "imex-channel-injection", "imex-channel-0", "training"
    await apply_example_cd(api, namespace, "imex-compute-domain.yaml", cd_name, template)
    rct = await kube.get_template(api, namespace, template)
    assert rct is not None and rct["apiVersion"] == "resource.k8s.io/v1beta1"
    [request] = rct["spec"]["spec"]["devices"]["requests"]
    assert request["deviceClassName"] == DEVICE_CLASS and "exactly" not in request

    await kube.create_job(api, kube.indexed_job(job, namespace, template, pods=NODES, size_hint=NODES))
    formed = await wait_job_running(env, api, namespace, job, NODES, template)
    await wait_cd_ready(env, api, namespace, cd_name, formed.nodes)
    for node, uid in zip(formed.nodes, formed.claim_uids, strict=True):
        assert cdi_spec_exists(env, node, uid), f"no CDI spec for claim {uid} on {node}"
    assert await check_store_invariants(store) == []

    # 1.32's own kubelet (which speaks only the v1beta1 DRA service) registered each plugin and
    # prepared the claims above.
    nodes = json.loads(env.cp.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    assert {n["status"]["nodeInfo"]["kubeletVersion"] for n in nodes} == {env.cp.version}
    for node in env.node_names:
        registered = [
            e for e in iter_lines(env.log(f"agent-{node}")) if e.get("event") == "registered with kubelet"
        ]
        assert len(registered) == 1, node

    await delete_job_and_wait_released(env, api, store, namespace, job, formed, cd_name)
    await delete_cd_and_wait_gone(env, api, store, namespace, cd_name, template, formed)
