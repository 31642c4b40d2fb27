"""A ComputeDomain from NVIDIA's documentation and an Indexed Job of 4 pods, end to end.

Real kube-scheduler (with our extender) places the pods in one clique and allocates `channel-0`
from our ResourceSlices; the kube-controller-manager's job and resourceclaim controllers make the
pods and claims; each node's kubelet prepares the claims through its node agent's DRA socket; the
controller reports the domain Ready with the 4 nodes. Deleting the Job empties the domain;
deleting the CD leaves nothing behind.
"""

from __future__ import annotations

import pytest
from kubernetes_asyncio.client import ApiClient

from libs.invariants.checker import check_store_invariants
from libs.state.store import Store
from tests.e2e import kube
from tests.e2e.harness import E2EEnvironment
from tests.e2e.scenario import (
    apply_example_cd,
    cdi_spec_exists,
    delete_cd_and_wait_gone,
    delete_job_and_wait_released,
    kubectl_get_computedomains,
    wait_cd_ready,
    wait_job_running,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


async def test_indexed_job_forms_ready_domain_in_one_clique_and_teardown_leaves_nothing(
    e2e_env: E2EEnvironment, api: ApiClient, e2e_store: Store, namespace: str
) -> None:
    cd_name, template, job = "imex-channel-injection", "imex-channel-0", "training"
    await apply_example_cd(api, namespace, "imex-compute-domain.yaml", cd_name, template)
    rows = kubectl_get_computedomains(e2e_env, namespace)
    assert rows[cd_name]["STATUS"] == "NotReady"

    await kube.create_job(api, kube.indexed_job(job, namespace, template, pods=4, size_hint=4))
    formed = await wait_job_running(e2e_env, api, namespace, job, 4, template)
    cd = await wait_cd_ready(e2e_env, api, namespace, cd_name, formed.nodes)
    assert cd["metadata"]["uid"] == formed.cd_uid
    for node, uid in zip(formed.nodes, formed.claim_uids, strict=True):
        assert cdi_spec_exists(e2e_env, node, uid), f"no CDI spec for claim {uid} on {node}"
    assert await check_store_invariants(e2e_store) == []

    rows = kubectl_get_computedomains(e2e_env, namespace)
    assert rows[cd_name]["STATUS"] == "Ready"
    assert rows[cd_name]["NODES"] == "4"
    short = e2e_env.cp.kubectl(
        "get", "cd", cd_name, "-n", namespace, "-o", "jsonpath={.status.status}"
    ).stdout
    assert short == "Ready"

    await delete_job_and_wait_released(e2e_env, api, e2e_store, namespace, job, formed, cd_name)
    rows = kubectl_get_computedomains(e2e_env, namespace)
    assert (rows[cd_name]["STATUS"], rows[cd_name]["NODES"]) == ("NotReady", "0")

    await delete_cd_and_wait_gone(e2e_env, api, e2e_store, namespace, cd_name, template, formed)
