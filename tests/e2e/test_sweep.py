"""The controller's sweep on the real API server: a ResourceClaimTemplate and a node label left
for a ComputeDomain that no longer exists (a crash between teardown steps) are removed, finalizer
included; those of a live domain stay."""

from __future__ import annotations

import json
import uuid

import pytest
from kubernetes_asyncio.client import ApiClient

from libs.kube.resource_api import device_request
from tests.e2e import kube
from tests.e2e.harness import DOMAIN_LABEL, E2EEnvironment
from tests.e2e.scenario import apply_example_cd

pytestmark = pytest.mark.e2e


def _leftover_template(namespace: str, name: str, cd_uid: str, version: str) -> dict:
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {DOMAIN_LABEL: cd_uid},
            "finalizers": [DOMAIN_LABEL],
        },
        "spec": {"spec": {"devices": {"requests": [device_request("channel", "x", version)]}}},
    }


async def test_sweep_removes_leftovers_of_a_gone_domain_and_keeps_a_live_ones(
    e2e_env: E2EEnvironment, api: ApiClient, namespace: str
) -> None:
    live = await apply_example_cd(api, namespace, "imex-compute-domain.yaml", "live", "live-channel")
    dead_uid = str(uuid.uuid4())
    e2e_env.cp.kubectl(
        "create",
        "-f",
        "-",
        input=json.dumps(
            _leftover_template(namespace, "dead-channel", dead_uid, await kube.resource_api(api))
        ),
    )
    node = e2e_env.node_names[7]
    e2e_env.cp.kubectl("label", "node", node, f"{DOMAIN_LABEL}={dead_uid}")

    async def swept() -> bool | None:
        labels = (await kube.node_labels(api))[node]
        template = await kube.get_template(api, namespace, "dead-channel")
        return True if template is None and DOMAIN_LABEL not in labels else None

    await kube.eventually(
        swept, "the sweep to remove the dead domain's template and node label", explain=e2e_env.explain
    )
    kept = await kube.get_template(api, namespace, "live-channel")
    assert kept is not None and kept["metadata"]["labels"][DOMAIN_LABEL] == live["metadata"]["uid"]

    await kube.delete_cd(api, namespace, "live")

    async def gone() -> bool | None:
        return True if await kube.get_cd(api, namespace, "live") is None else None

    await kube.eventually(gone, "the live ComputeDomain to be deleted", explain=e2e_env.explain)
