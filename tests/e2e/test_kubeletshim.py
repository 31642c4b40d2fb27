"""The kubelet shim against the real API server (a small environment of its own, shim_env): Nodes
and Leases as kubelets keep them, pods without claims run, pods deleted gracefully go away (no
kubelet would remove them otherwise), and a restarted shim releases the claims of a pod deleted
while it was down.

The shim stays only where real kubelets do not fit on one machine (the 256-node formation
benchmark, tools/bench/k8s_env.py), so the differential test below runs one scenario through the
shim and through real kubelets (the session environment) and asserts that our kubelet plugin sees
the same DRA calls: every node's plugin registered, each of the Job's claims prepared and
unprepared once, and the same CDI devices reaching the container runtime (crisim's record on the
real side, what the shim got from NodePrepareResources on the other)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest
from kubernetes_asyncio.client import ApiClient

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from tests.e2e import kube
from tests.e2e.conftest import admin_api, fresh_namespace, services_store
from tests.e2e.harness import CLIQUE_LABEL, EXAMPLES_DIR, E2EEnvironment, iter_lines
from tests.e2e.scenario import (
    Formed,
    apply_example_cd,
    cdi_spec_exists,
    delete_job_and_wait_released,
    wait_cd_ready,
    wait_job_running,
)
from tools.sim.kubelet.record import created_containers

pytestmark = pytest.mark.e2e


@pytest.fixture
async def shim_api(shim_env: E2EEnvironment) -> AsyncIterator[ApiClient]:
    async with admin_api(shim_env) as client:
        yield client


@pytest.fixture
async def shim_store(shim_env: E2EEnvironment) -> AsyncIterator[Store]:
    async with services_store(shim_env) as store:
        yield store


@pytest.fixture
async def shim_namespace(shim_api: ApiClient) -> AsyncIterator[str]:
    async with fresh_namespace(shim_api, "shim") as name:
        yield name


async def test_every_simulated_node_is_registered_ready_with_its_clique_and_a_fresh_lease(
    shim_env: E2EEnvironment, shim_api: ApiClient
) -> None:
    listing = await kube.raw_get(shim_api, "/api/v1/nodes")
    assert listing is not None
    nodes = {n["metadata"]["name"]: n for n in listing["items"]}
    assert set(shim_env.node_names) <= set(nodes)
    for name in shim_env.node_names:
        node = nodes[name]
        ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True", (name, ready)
        assert node["metadata"]["labels"][CLIQUE_LABEL] == shim_env.cluster.node(name).clique
        assert {"type": "InternalIP", "address": shim_env.cluster.node(name).address} in node["status"][
            "addresses"
        ]
        assert node["status"]["allocatable"]["pods"] == "110"

    async def lease_fresh() -> dict | None:
        lease = await kube.raw_get(
            shim_api, f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
        )
        if lease is None:
            return None
        renewed = datetime.fromisoformat(lease["spec"]["renewTime"].replace("Z", "+00:00"))
        return lease if (datetime.now(UTC) - renewed).total_seconds() < 30 else None

    for name in (shim_env.node_names[0], shim_env.node_names[-1]):
        lease = await kube.eventually(lease_fresh, f"a recently renewed Lease of {name}")
        assert lease["spec"]["holderIdentity"] == name
        owner = lease["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["uid"]) == ("Node", nodes[name]["metadata"]["uid"])


async def test_pod_without_claims_runs_and_graceful_delete_removes_it(
    shim_env: E2EEnvironment, shim_api: ApiClient, shim_namespace: str
) -> None:
    node = shim_env.node_names[-1]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plain", "namespace": shim_namespace},
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "ubuntu:22.04"}]},
    }
    shim_env.cp.kubectl("create", "-f", "-", input=json.dumps(pod))

    async def running() -> dict | None:
        pods = await kube.list_pods(shim_api, shim_namespace)
        return pods[0] if pods and kube.is_running(pods[0]) else None

    started = await kube.eventually(
        running, "the plain pod to run", explain=lambda: shim_env.explain("kubeletshim")
    )
    assert started["status"]["hostIP"] == shim_env.cluster.node(node).address
    assert started["status"]["containerStatuses"][0]["state"]["running"]["startedAt"]

    await kube.delete_pod(shim_api, shim_namespace, "plain")  # graceful: 30 s unless a kubelet finishes it

    async def gone() -> bool | None:
        return True if not await kube.list_pods(shim_api, shim_namespace) else None

    await kube.eventually(gone, "the deleted pod to be removed by the shim", timeout_s=20.0)


async def test_nvidia_injection_example_runs_and_a_restarted_shim_releases_its_claim(
    shim_env: E2EEnvironment, shim_api: ApiClient, shim_store: Store, shim_namespace: str
) -> None:
    """NVIDIA's validation manifest (CD + pod), unchanged; then kubelet restarts while the pod is
    deleted: the new kubelet finds the terminating pod, unprepares its claim, removes it."""
    shim_env.cp.kubectl(
        "apply", "-n", shim_namespace, "-f", str(EXAMPLES_DIR / "imex-channel-injection.yaml")
    )

    async def running() -> dict | None:
        pods = await kube.list_pods(shim_api, shim_namespace)
        return pods[0] if pods and kube.is_running(pods[0]) else None

    pod = await kube.eventually(running, "the example pod to run", explain=shim_env.explain)
    node = pod["spec"]["nodeName"]
    claim_name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim = await kube.get_claim(shim_api, shim_namespace, claim_name)
    assert claim is not None
    claim_uid = claim["metadata"]["uid"]
    cd = await wait_cd_ready(shim_env, shim_api, shim_namespace, "imex-channel-injection", [node])
    assert cdi_spec_exists(shim_env, node, claim_uid)

    shim_env.kill_shim()
    await kube.delete_pod(shim_api, shim_namespace, pod["metadata"]["name"])
    # Without a kubelet the pod stays Terminating and its claim prepared.
    await asyncio.sleep(1.0)
    assert [
        p["metadata"].get("deletionTimestamp") is not None
        for p in await kube.list_pods(shim_api, shim_namespace)
    ] == [True]
    assert cdi_spec_exists(shim_env, node, claim_uid)
    shim_env.start_shim()

    async def released() -> bool | None:
        if await kube.list_pods(shim_api, shim_namespace) or cdi_spec_exists(shim_env, node, claim_uid):
            return None
        members, _ = await shim_store.list(shim_store.keys.members(cd["metadata"]["uid"]), pb.Member)
        return True if not members else None

    await kube.eventually(
        released, "the restarted shim to unprepare the claim and remove the pod", explain=shim_env.explain
    )
    await kube.delete_cd(shim_api, shim_namespace, "imex-channel-injection")

    async def cd_gone() -> bool | None:
        return True if await kube.get_cd(shim_api, shim_namespace, "imex-channel-injection") is None else None

    await kube.eventually(cd_gone, "the example ComputeDomain to be deleted", explain=shim_env.explain)


COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


@dataclass(frozen=True)
class DraCalls:
    """What one run's kubelet plugins were asked, with each claim uid replaced by its pod's
    completion index (claim uids differ between runs)."""

    registered: frozenset[str]  # nodes whose plugin kubelet registered
    prepared: dict[str, int]  # "index -> CDI device ids" -> how often the plugin prepared it
    unprepared: dict[str, int]  # index -> how often the plugin unprepared it
    runtime: dict[str, list[str]]  # index -> CDI devices that reached the container runtime


def _by_index(formed: Formed) -> dict[str, str]:
    """claim uid -> its pod's completion index."""
    out = {}
    for pod in formed.pods:
        claim_name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        out[formed.claims[claim_name]["metadata"]["uid"]] = pod["metadata"]["annotations"][COMPLETION_INDEX]
    return out


def _normalised(text: str, index_of: dict[str, str]) -> str:
    return re.sub("|".join(map(re.escape, index_of)), lambda m: f"<claim {index_of[m.group(0)]}>", text)


def _dra_calls(env: E2EEnvironment, namespace: str, formed: Formed) -> DraCalls:
    index_of = _by_index(formed)
    registered: set[str] = set()
    prepared: dict[str, int] = {}
    unprepared: dict[str, int] = {}
    for node in env.node_names:
        for line in iter_lines(env.log(f"agent-{node}")):
            event = line.get("event")
            if event == "registered with kubelet":
                registered.add(node)
            elif event == "claim prepared" and line.get("namespace") == namespace:
                key = _normalised(f"{line['claim_uid']} -> {line['cdi_device_id']}", index_of)
                prepared[key] = prepared.get(key, 0) + 1
            elif event == "claim unprepared" and line.get("namespace") == namespace:
                key = _normalised(line["claim_uid"], index_of)
                unprepared[key] = unprepared.get(key, 0) + 1
    runtime: dict[str, list[str]] = {}
    if env.kubelets == "real":
        for pod in formed.pods:
            record = env.kubelet_nodes[pod["spec"]["nodeName"]].record_path
            devices = [
                d
                for c in created_containers(record, pod["metadata"]["uid"])
                for d in c["container"]["cdi_devices"]
            ]
            runtime[pod["metadata"]["annotations"][COMPLETION_INDEX]] = [
                _normalised(d, index_of) for d in devices
            ]
    else:
        for line in iter_lines(env.log("kubeletshim")):
            if line.get("event") == "claims prepared" and line.get("namespace") == namespace:
                (claim_uid,) = line["claim_uids"]
                runtime[index_of[claim_uid]] = [_normalised(d, index_of) for d in line["cdi_device_ids"]]
    return DraCalls(frozenset(registered), prepared, unprepared, runtime)


async def _run_job(env: E2EEnvironment, api: ApiClient, store: Store, namespace: str) -> DraCalls:
    """NVIDIA's channel-injection ComputeDomain with an Indexed Job of 2 pods, run and deleted."""
    await apply_example_cd(api, namespace, "imex-channel-injection.yaml", "diff", "diff-channel")
    await kube.create_job(api, kube.indexed_job("diff", namespace, "diff-channel", pods=2, size_hint=2))
    formed = await wait_job_running(env, api, namespace, "diff", 2, "diff-channel")
    await wait_cd_ready(env, api, namespace, "diff", formed.nodes)
    await delete_job_and_wait_released(env, api, store, namespace, "diff", formed, "diff")
    await kube.delete_cd(api, namespace, "diff")
    return _dra_calls(env, namespace, formed)


async def test_the_shim_and_real_kubelets_make_the_same_dra_calls_and_hand_the_runtime_the_same_cdi_devices(
    e2e_env: E2EEnvironment,
    api: ApiClient,
    e2e_store: Store,
    namespace: str,
    shim_env: E2EEnvironment,
    shim_api: ApiClient,
    shim_store: Store,
    shim_namespace: str,
) -> None:
    real = await _run_job(e2e_env, api, e2e_store, namespace)
    shim = await _run_job(shim_env, shim_api, shim_store, shim_namespace)

    assert real.registered == set(e2e_env.node_names)
    assert shim.registered == set(shim_env.node_names)
    channel = "k8s.compute-domain.nvidia.com/claim=<claim {}>-channel-0"
    assert real.prepared == {f"<claim {i}> -> {channel.format(i)}": 1 for i in "01"}, real
    assert real.unprepared == {f"<claim {i}>": 1 for i in "01"}, real
    assert real.runtime == {i: [channel.format(i)] for i in "01"}, real
    assert (shim.prepared, shim.unprepared, shim.runtime) == (real.prepared, real.unprepared, real.runtime)
