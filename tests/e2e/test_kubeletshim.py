"""The kubelet shim against the real API server: Nodes and Leases as kubelets keep them, pods
without claims run, pods deleted gracefully go away (no kubelet would remove them otherwise), and
a restarted shim releases the claims of a pod deleted while it was down."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import pytest
from kubernetes_asyncio.client import ApiClient

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from tests.e2e import kube
from tests.e2e.harness import CLIQUE_LABEL, EXAMPLES_DIR, E2EEnvironment
from tests.e2e.scenario import cdi_spec_exists, wait_cd_ready

pytestmark = pytest.mark.e2e


async def test_every_simulated_node_is_registered_ready_with_its_clique_and_a_fresh_lease(
    e2e_env: E2EEnvironment, api: ApiClient
) -> None:
    listing = await kube.raw_get(api, "/api/v1/nodes")
    assert listing is not None
    nodes = {n["metadata"]["name"]: n for n in listing["items"]}
    assert set(e2e_env.node_names) <= set(nodes)
    for name in e2e_env.node_names:
        node = nodes[name]
        ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True", (name, ready)
        assert node["metadata"]["labels"][CLIQUE_LABEL] == e2e_env.cluster.node(name).clique
        assert {"type": "InternalIP", "address": e2e_env.cluster.node(name).address} in node["status"][
            "addresses"
        ]
        assert node["status"]["allocatable"]["pods"] == "110"

    async def lease_fresh() -> dict | None:
        lease = await kube.raw_get(
            api, f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
        )
        if lease is None:
            return None
        renewed = datetime.fromisoformat(lease["spec"]["renewTime"].replace("Z", "+00:00"))
        return lease if (datetime.now(UTC) - renewed).total_seconds() < 30 else None

    for name in (e2e_env.node_names[0], e2e_env.node_names[-1]):
        lease = await kube.eventually(lease_fresh, f"a recently renewed Lease of {name}")
        assert lease["spec"]["holderIdentity"] == name
        owner = lease["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["uid"]) == ("Node", nodes[name]["metadata"]["uid"])


async def test_pod_without_claims_runs_and_graceful_delete_removes_it(
    e2e_env: E2EEnvironment, api: ApiClient, namespace: str
) -> None:
    node = e2e_env.node_names[5]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plain", "namespace": namespace},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "ubuntu:22.04"}]},
    }
    e2e_env.cp.kubectl("create", "-f", "-", input=json.dumps(pod))

    async def running() -> dict | None:
        pods = await kube.list_pods(api, namespace)
        return pods[0] if pods and kube.is_running(pods[0]) else None

    started = await kube.eventually(
        running, "the plain pod to run", explain=lambda: e2e_env.explain("kubeletshim")
    )
    assert started["status"]["hostIP"] == e2e_env.cluster.node(node).address
    assert started["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]

    await kube.delete_pod(api, namespace, "plain")  # graceful: 30 s unless a kubelet finishes it

    async def gone() -> bool | None:
        return True if not await kube.list_pods(api, namespace) else None

    await kube.eventually(gone, "the deleted pod to be removed by the shim", timeout_s=20.0)


async def test_nvidia_injection_example_runs_and_a_restarted_shim_releases_its_claim(
    e2e_env: E2EEnvironment, api: ApiClient, e2e_store: Store, namespace: str
) -> None:
    """NVIDIA's validation manifest (CD + pod), unchanged; then kubelet restarts while the pod is
    deleted: the new kubelet finds the terminating pod, unprepares its claim, removes it."""
    e2e_env.cp.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES_DIR / "imex-channel-injection.yaml"))

    async def running() -> dict | None:
        pods = await kube.list_pods(api, namespace)
        return pods[0] if pods and kube.is_running(pods[0]) else None

    pod = await kube.eventually(running, "the example pod to run", explain=e2e_env.explain)
    node = pod["spec"]["nodeName"]
    claim_name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim = await kube.get_claim(api, namespace, claim_name)
    assert claim is not None
    claim_uid = claim["metadata"]["uid"]
    cd = await wait_cd_ready(e2e_env, api, namespace, "imex-channel-injection", [node])
    assert cdi_spec_exists(e2e_env, node, claim_uid)

    e2e_env.kill_shim()
    await kube.delete_pod(api, namespace, pod["metadata"]["name"])
    # Without a kubelet the pod stays Terminating and its claim prepared.
    await asyncio.sleep(1.0)
    assert [
        p["metadata"].get("deletionTimestamp") is not None for p in await kube.list_pods(api, namespace)
    ] == [True]
    assert cdi_spec_exists(e2e_env, node, claim_uid)
    e2e_env.start_shim()

    async def released() -> bool | None:
        if await kube.list_pods(api, namespace) or cdi_spec_exists(e2e_env, node, claim_uid):
            return None
        members, _ = await e2e_store.list(e2e_store.keys.members(cd["metadata"]["uid"]), pb.Member)
        return True if not members else None

    await kube.eventually(
        released, "the restarted shim to unprepare the claim and remove the pod", explain=e2e_env.explain
    )
    await kube.delete_cd(api, namespace, "imex-channel-injection")

    async def cd_gone() -> bool | None:
        return True if await kube.get_cd(api, namespace, "imex-channel-injection") is None else None

    await kube.eventually(cd_gone, "the example ComputeDomain to be deleted", explain=e2e_env.explain)
