"""The node agent keeps its ResourceSlice and clique label in step with the hardware, on the real
API server: a node that drops off the NVLink fabric publishes an empty cliqueID (new pool
generation) and loses its clique label; back on the fabric, both return."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient

from libs.kube.resource_api import device_attributes, resource_path
from tests.e2e import kube
from tests.e2e.harness import CLIQUE_LABEL, E2EEnvironment
from tools.sim.hardware.simulated import FaultInjector, SimulatedNodePaths

pytestmark = pytest.mark.e2e


async def _slice(api: ApiClient, node: str) -> dict[str, Any] | None:
    version = await kube.resource_api(api)
    return await kube.raw_get(
        api, resource_path(version, "resourceslices", name=f"{node}-compute-domain.nvidia.com")
    )


def _clique_attribute(resource_slice: dict[str, Any]) -> str:
    return str(device_attributes(resource_slice["spec"]["devices"][0])["cliqueID"]["string"])


async def test_slice_and_label_follow_the_node_off_and_back_onto_the_fabric(
    e2e_env: E2EEnvironment, api: ApiClient
) -> None:
    node = e2e_env.node_names[-1]
    clique = e2e_env.cluster.node(node).clique
    before = await _slice(api, node)
    assert before is not None and _clique_attribute(before) == clique
    generation = before["spec"]["pool"]["generation"]
    paths = SimulatedNodePaths.under(e2e_env.layout.nodes_dir, node)
    faults = FaultInjector(paths.faults_file, e2e_env.cluster.gpus_per_tray)

    faults.set_non_fabric(True)
    try:

        async def off_fabric() -> dict[str, Any] | None:
            current = await _slice(api, node)
            labels = (await kube.node_labels(api))[node]
            if current is None or _clique_attribute(current) != "" or CLIQUE_LABEL in labels:
                return None
            return current

        off = await kube.eventually(off_fabric, f"{node}'s slice and label to show it off the fabric")
        assert off["spec"]["pool"]["generation"] > generation
        assert off["metadata"]["uid"] == before["metadata"]["uid"]  # updated in place
        assert off["spec"]["devices"][0]["name"] == "channel-0"
    finally:
        faults.clear()

    async def back() -> dict[str, Any] | None:
        current = await _slice(api, node)
        labels = (await kube.node_labels(api))[node]
        if current is None or _clique_attribute(current) != clique or labels.get(CLIQUE_LABEL) != clique:
            return None
        return current

    restored = await kube.eventually(back, f"{node}'s slice and label back on clique {clique}")
    assert restored["spec"]["pool"]["generation"] > off["spec"]["pool"]["generation"]
