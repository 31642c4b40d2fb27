"""The upstream kubelet calls our kubelet plugin: each node of a small environment runs kubelet
(built from k8s.io/kubernetes, the control plane's release) on crisim, the simulated container
runtime, whose record shows what kubelet asked it to run.

What only a real kubelet shows: its plugin watcher registers cd-node-agent; the CDI device it hands
the runtime is the channel's, for each container of a pod that claims it and no other; deleting
the pod unprepares the claim; a restarted kubelet keeps the running pod and later unprepares from
its own checkpoint; a restarted plugin is registered again; a failed prepare gets kubelet's event
and retry."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import yaml
from kubernetes_asyncio.client import ApiClient

from libs.cdi.spec import claim_cdi_device_id
from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import check_store_invariants
from libs.state.store import Store
from tests.e2e import kube
from tests.e2e.conftest import admin_api, fresh_namespace, services_store
from tests.e2e.harness import CLIQUE_LABEL, DRIVER, EXAMPLES_DIR, E2EEnvironment, example_objects, iter_lines
from tests.e2e.scenario import apply_example_cd, cdi_spec_exists, wait_cd_ready, wait_job_running
from tools.kubelet.addresses import is_local_only
from tools.kubelet.record import created_containers, records

pytestmark = pytest.mark.e2e

EXAMPLE = "imex-channel-injection.yaml"
EXAMPLE_CD = "imex-channel-injection"


def _registrations(env: E2EEnvironment, node: str) -> int:
    """How often kubelet has accepted the registration of `node`'s kubelet plugin."""
    return sum(1 for e in iter_lines(env.log(f"agent-{node}")) if e.get("event") == "registered with kubelet")


async def _running_pod(api: ApiClient, namespace: str, env: E2EEnvironment) -> dict[str, Any]:
    async def running() -> dict[str, Any] | None:
        pods = await kube.list_pods(api, namespace)
        return pods[0] if len(pods) == 1 and kube.is_running(pods[0]) else None

    return await kube.eventually(running, f"the pod in {namespace} to run", explain=env.explain_kubelets)


async def _claim_uid(api: ApiClient, namespace: str, pod: dict[str, Any]) -> str:
    claim_name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim = await kube.get_claim(api, namespace, claim_name)
    assert claim is not None
    return str(claim["metadata"]["uid"])


async def _unprepared(
    env: E2EEnvironment, api: ApiClient, store: Store, namespace: str, node: str, claim_uid: str, cd_uid: str
) -> None:
    async def released() -> bool | None:
        if await kube.list_pods(api, namespace) or cdi_spec_exists(env, node, claim_uid):
            return None
        members, _ = await store.list(store.keys.members(cd_uid), pb.Member)
        return True if not members else None

    await kube.eventually(
        released, "kubelet to unprepare the claim and remove the pod", explain=env.explain_kubelets
    )


async def test_every_node_is_registered_by_its_kubelet_on_a_local_only_node_ip(
    kubelet_env: E2EEnvironment,
) -> None:
    async with admin_api(kubelet_env) as api:
        listing = await kube.raw_get(api, "/api/v1/nodes")
    assert listing is not None
    nodes = {n["metadata"]["name"]: n for n in listing["items"]}
    assert set(nodes) == set(kubelet_env.node_names)
    for name, node in nodes.items():
        kubelet = kubelet_env.kubelet_nodes[name]
        assert node["status"]["nodeInfo"]["kubeletVersion"] == kubelet_env.cp.version
        assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("fakeRuntime://")
        assert {"type": "InternalIP", "address": kubelet.ip} in node["status"]["addresses"]
        assert is_local_only(kubelet.ip)
        assert node["metadata"]["labels"][CLIQUE_LABEL] == kubelet_env.cluster.node(name).clique
        ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True", (name, ready)
        # Kubelet's plugin watcher found cd-node-agent's registration socket, and kubelet told the
        # plugin it accepted it (NotifyRegistrationStatus).
        assert (kubelet.kubelet_dir / "plugins_registry" / f"{DRIVER}-reg.sock").is_socket()

    async def registered() -> dict[str, int] | None:
        counts = {n: _registrations(kubelet_env, n) for n in kubelet_env.node_names}
        return counts if all(counts.values()) else None

    counts = await kube.eventually(registered, "kubelet to accept every node's plugin registration")
    assert set(counts.values()) == {1}, counts

    # The nodes' GPUs, through kubelet's device-plugin API (crisim plays NVIDIA's device plugin),
    # on a status update after the plugin registered.
    async def gpus_advertised() -> bool | None:
        async with admin_api(kubelet_env) as api:
            found = await kube.raw_get(api, "/api/v1/nodes")
        gpus = {n["status"]["capacity"].get("nvidia.com/gpu") for n in (found or {}).get("items", [])}
        return True if gpus == {str(kubelet_env.cluster.gpus_per_tray)} else None

    await kube.eventually(gpus_advertised, "every Node to have its GPUs as nvidia.com/gpu")


async def test_the_runtime_gets_the_channel_cdi_device_for_the_claiming_container_and_no_other(
    kubelet_env: E2EEnvironment,
) -> None:
    env = kubelet_env
    async with admin_api(env) as api, services_store(env) as store, fresh_namespace(api, "cdi") as ns:
        env.cp.kubectl("apply", "-n", ns, "-f", str(EXAMPLES_DIR / EXAMPLE))
        pod = await _running_pod(api, ns, env)
        node = pod["spec"]["nodeName"]
        claim_uid = await _claim_uid(api, ns, pod)
        cd = await wait_cd_ready(env, api, ns, EXAMPLE_CD, [node])
        assert cdi_spec_exists(env, node, claim_uid)

        plain = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "plain", "namespace": ns},
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": "ubuntu:22.04"}]},
        }
        env.cp.kubectl("create", "-f", "-", input=json.dumps(plain))

        async def plain_created() -> list[dict[str, Any]] | None:
            pods = {p["metadata"]["name"]: p for p in await kube.list_pods(api, ns)}
            if "plain" not in pods or not kube.is_running(pods["plain"]):
                return None
            return created_containers(env.kubelet_nodes[node].record_path, pods["plain"]["metadata"]["uid"])

        plain_containers = await kube.eventually(plain_created, "the plain pod to run")
        record = env.kubelet_nodes[node].record_path
        claiming = created_containers(record, pod["metadata"]["uid"])
        assert [c["container"]["name"] for c in claiming] == [c["name"] for c in pod["spec"]["containers"]]
        for container in claiming:
            assert container["container"]["cdi_devices"] == [claim_cdi_device_id(claim_uid)], container
        assert [c["container"]["cdi_devices"] for c in plain_containers] == [[]]
        # No other node's runtime was asked for the claim's device.
        for other, kubelet in env.kubelet_nodes.items():
            if other != node:
                devices = {
                    d for r in records(kubelet.record_path, "CreateContainer") for d in r["cdi_devices"]
                }
                assert claim_cdi_device_id(claim_uid) not in devices, other

        await kube.delete_pod(api, ns, "plain")
        await kube.delete_pod(api, ns, pod["metadata"]["name"])
        await _unprepared(env, api, store, ns, node, claim_uid, cd["metadata"]["uid"])
        await kube.delete_cd(api, ns, EXAMPLE_CD)


async def test_a_restarted_kubelet_keeps_the_pod_prepared_and_unprepares_it_later_from_its_checkpoint(
    kubelet_env: E2EEnvironment,
) -> None:
    env = kubelet_env
    async with admin_api(env) as api, services_store(env) as store, fresh_namespace(api, "restart") as ns:
        env.cp.kubectl("apply", "-n", ns, "-f", str(EXAMPLES_DIR / EXAMPLE))
        pod = await _running_pod(api, ns, env)
        node = pod["spec"]["nodeName"]
        claim_uid = await _claim_uid(api, ns, pod)
        cd = await wait_cd_ready(env, api, ns, EXAMPLE_CD, [node])
        kubelet = env.kubelet_nodes[node]
        sandboxes_before = [r for r in records(kubelet.record_path, "RunPodSandbox")]

        kubelet.stop_kubelet()
        kubelet.start_kubelet()

        async def healthy_again() -> bool | None:
            return True if kubelet.kubelet_healthy() else None

        await kube.eventually(healthy_again, f"the restarted kubelet of {node} to serve /healthz")
        # Give it time to resync the pod: nothing is unprepared, no sandbox is recreated.
        await asyncio.sleep(15.0)
        assert cdi_spec_exists(env, node, claim_uid)
        assert [r for r in records(kubelet.record_path, "RunPodSandbox")] == sandboxes_before
        again = await _running_pod(api, ns, env)
        assert again["metadata"]["uid"] == pod["metadata"]["uid"]
        members, _ = await store.list(store.keys.members(cd["metadata"]["uid"]), pb.Member)
        assert [m.value.node_name for m in members] == [node]

        await kube.delete_pod(api, ns, pod["metadata"]["name"])
        await _unprepared(env, api, store, ns, node, claim_uid, cd["metadata"]["uid"])
        await kube.delete_cd(api, ns, EXAMPLE_CD)


async def test_a_restarted_kubelet_plugin_is_registered_again_by_kubelets_plugin_watcher(
    kubelet_env: E2EEnvironment,
) -> None:
    env = kubelet_env
    node = env.node_names[1]
    before = _registrations(env, node)
    env.stop_plugins([node])
    env.start_plugins([node])

    async def registered_again() -> bool | None:
        return True if _registrations(env, node) == before + 1 else None

    await kube.eventually(registered_again, f"kubelet to register {node}'s restarted plugin")


async def test_a_failed_prepare_gets_kubelets_event_and_retry_then_succeeds(
    kubelet_env: E2EEnvironment,
) -> None:
    """The plugin of the pod's node is down when kubelet first prepares: kubelet reports the failure
    on the pod and retries on its own; once the plugin is back, the pod runs with its device."""
    env = kubelet_env
    node = env.node_names[2]
    objects = example_objects(EXAMPLE)
    for obj in objects:
        if obj["kind"] == "Pod":
            obj["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    async with admin_api(env) as api, services_store(env) as store, fresh_namespace(api, "retry") as ns:
        env.stop_plugins([node])
        try:
            env.cp.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(objects))
            pod_name = next(o["metadata"]["name"] for o in objects if o["kind"] == "Pod")

            async def failed() -> list[dict[str, Any]] | None:
                events = await kube.pod_events(api, ns, pod_name)
                failures = [e for e in events if e.get("reason") == "FailedPrepareDynamicResources"]
                return failures or None

            failures = await kube.eventually(failed, "kubelet's FailedPrepareDynamicResources event")
            assert failures[0]["source"]["component"] == "kubelet", failures[0]
            assert failures[0]["type"] == "Warning"
            assert not cdi_spec_exists(
                env, node, await _claim_uid(api, ns, (await kube.list_pods(api, ns))[0])
            )
        finally:
            env.start_plugins([node])
        pod = await _running_pod(api, ns, env)
        assert pod["spec"]["nodeName"] == node
        claim_uid = await _claim_uid(api, ns, pod)
        created = created_containers(env.kubelet_nodes[node].record_path, pod["metadata"]["uid"])
        assert [c["container"]["cdi_devices"] for c in created] == [[claim_cdi_device_id(claim_uid)]]
        cd = await wait_cd_ready(env, api, ns, EXAMPLE_CD, [node])
        await kube.delete_pod(api, ns, pod_name)
        await _unprepared(env, api, store, ns, node, claim_uid, cd["metadata"]["uid"])
        await kube.delete_cd(api, ns, EXAMPLE_CD)


def _ready_status(node: dict[str, Any]) -> str:
    return str(next(c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready"))


async def test_a_stopped_kubelet_turns_its_node_not_ready_and_back_without_disturbing_the_domain(
    kubelet_env: E2EEnvironment,
) -> None:
    """Kubelet stops under a running pod: the node lifecycle controller marks the Node's Ready
    condition Unknown; the pod, its claim, the domain and its member stay as they are (the node's
    IMEX daemon does not depend on kubelet). The restarted kubelet turns the Node Ready again."""
    env = kubelet_env
    node = env.node_names[3]
    objects = example_objects(EXAMPLE)
    for obj in objects:
        if obj["kind"] == "Pod":
            obj["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    async with admin_api(env) as api, services_store(env) as store, fresh_namespace(api, "notready") as ns:
        env.cp.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(objects))
        pod = await _running_pod(api, ns, env)
        claim_uid = await _claim_uid(api, ns, pod)
        cd = await wait_cd_ready(env, api, ns, EXAMPLE_CD, [node])
        cd_uid = cd["metadata"]["uid"]
        [member] = (await store.list(store.keys.members(cd_uid), pb.Member))[0]
        kubelet = env.kubelet_nodes[node]
        sandboxes = list(records(kubelet.record_path, "RunPodSandbox"))

        kubelet.stop_kubelet()
        try:

            async def not_ready() -> dict[str, Any] | None:
                found = await kube.raw_get(api, f"/api/v1/nodes/{node}")
                return found if found is not None and _ready_status(found) == "Unknown" else None

            await kube.eventually(not_ready, f"the node lifecycle controller to mark {node} not ready")
            cd_status = ((await kube.get_cd(api, ns, EXAMPLE_CD)) or {}).get("status") or {}
            assert cd_status.get("status") == "Ready", cd_status
            assert cdi_spec_exists(env, node, claim_uid)
        finally:
            kubelet.start_kubelet()

        async def ready_again() -> dict[str, Any] | None:
            found = await kube.raw_get(api, f"/api/v1/nodes/{node}")
            return found if found is not None and _ready_status(found) == "True" else None

        await kube.eventually(ready_again, f"{node} to be Ready again under its restarted kubelet")
        again = await _running_pod(api, ns, env)
        assert again["metadata"]["uid"] == pod["metadata"]["uid"]
        assert list(records(kubelet.record_path, "RunPodSandbox")) == sandboxes
        [member_after] = (await store.list(store.keys.members(cd_uid), pb.Member))[0]
        assert member_after.create_revision == member.create_revision
        assert member_after.value.index == member.value.index
        await wait_cd_ready(env, api, ns, EXAMPLE_CD, [node])

        await kube.delete_pod(api, ns, pod["metadata"]["name"])
        await _unprepared(env, api, store, ns, node, claim_uid, cd_uid)
        await kube.delete_cd(api, ns, EXAMPLE_CD)


async def test_a_job_whose_containers_exit_completes_and_kubelet_unprepares_its_claims(
    kubelet_env: E2EEnvironment,
) -> None:
    """crisim ends a container whose command is `sh -c "sleep N; exit K"` after N s with code K:
    an Indexed Job of 2 such pods (K=0) completes, kubelet unprepares the finished pods' claims on
    its own (no delete), and a pod exiting with 3 fails with that exit code."""
    env = kubelet_env
    async with admin_api(env) as api, fresh_namespace(api, "complete") as ns:
        await apply_example_cd(api, ns, "imex-compute-domain.yaml", EXAMPLE_CD, "imex-channel-0")
        job = kube.indexed_job("finite", ns, "imex-channel-0", pods=2, size_hint=2)
        job["spec"]["template"]["spec"]["containers"][0]["command"] = ["sh", "-c", "sleep 3; exit 0"]
        await kube.create_job(api, job)

        async def complete() -> dict[str, Any] | None:
            found = await kube.raw_get(api, f"/apis/batch/v1/namespaces/{ns}/jobs/finite")
            conditions = ((found or {}).get("status") or {}).get("conditions") or []
            return (
                found if any(c["type"] == "Complete" and c["status"] == "True" for c in conditions) else None
            )

        done = await kube.eventually(complete, "the Job to complete", explain=env.explain_kubelets)
        assert done["status"]["succeeded"] == 2
        pods = await kube.list_pods(api, ns, "e2e-job=finite")
        assert sorted(p["status"]["phase"] for p in pods) == ["Succeeded", "Succeeded"]
        # The claims are gone with the finished pods (the resource claim controller deletes them):
        # each one's uid is in the CDI device kubelet gave the runtime.
        claim_uids: dict[str, str] = {}
        for p in pods:
            node = p["spec"]["nodeName"]
            [created] = created_containers(env.kubelet_nodes[node].record_path, p["metadata"]["uid"])
            [device] = created["container"]["cdi_devices"]
            claim_uids[p["metadata"]["uid"]] = device.split("=", 1)[1].removesuffix("-channel-0")
            assert device == claim_cdi_device_id(claim_uids[p["metadata"]["uid"]])
            exits = [
                r
                for r in records(env.kubelet_nodes[node].record_path, "ContainerExited")
                if r["pod"]["uid"] == p["metadata"]["uid"]
            ]
            assert [r["exit_code"] for r in exits] == [0]
            assert p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0

        async def unprepared() -> bool | None:
            return (
                True
                if not any(
                    cdi_spec_exists(env, p["spec"]["nodeName"], claim_uids[p["metadata"]["uid"]])
                    for p in pods
                )
                else None
            )

        await kube.eventually(unprepared, "kubelet to unprepare the finished pods' claims")

        failing = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "failing", "namespace": ns},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {"name": "main", "image": "ubuntu:22.04", "command": ["sh", "-c", "sleep 1; exit 3"]}
                ],
            },
        }
        env.cp.kubectl("create", "-f", "-", input=json.dumps(failing))

        async def failed() -> dict[str, Any] | None:
            found = {p["metadata"]["name"]: p for p in await kube.list_pods(api, ns)}.get("failing")
            return found if found and found["status"].get("phase") == "Failed" else None

        failed_pod = await kube.eventually(failed, "the pod exiting with 3 to fail")
        assert failed_pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3

        await kube.delete_job(api, ns, "finite")
        await kube.delete_cd(api, ns, EXAMPLE_CD)


@pytest.mark.xfail(
    strict=False,
    reason=(
        "known flaky, open in issue 29: in one full-suite run (after the module's other tests) the "
        "node lifecycle controller did not evict the lost tray's pod within 180 s, so no replacement "
        "was made; alone it passes (and failed before the controller's lost-claims fix)"
    ),
)
async def test_a_lost_node_s_pod_is_replaced_on_a_spare_tray_of_its_clique_and_the_domain_is_ready_again(
    kubelet_env: E2EEnvironment,
) -> None:
    """A tray of a running 2-pod Job is lost for good: the node lifecycle controller marks it
    unreachable, its pod is evicted after EVICTION_TOLERATION_S, the Job makes a replacement, the
    scheduler (with our extender) puts it on a spare tray of the same clique, it joins the domain,
    and the domain is Ready again; the survivor's membership is untouched."""
    env = kubelet_env
    async with admin_api(env) as api, services_store(env) as store, fresh_namespace(api, "lost") as ns:
        await apply_example_cd(api, ns, "imex-compute-domain.yaml", EXAMPLE_CD, "imex-channel-0")
        job = kube.indexed_job("resilient", ns, "imex-channel-0", pods=2, size_hint=2)
        job["spec"]["backoffLimit"] = 4
        await kube.create_job(api, job)
        formed = await wait_job_running(env, api, ns, "resilient", 2, "imex-channel-0")
        await wait_cd_ready(env, api, ns, EXAMPLE_CD, formed.nodes)
        lost, survivor = formed.nodes
        [lost_pod] = [p for p in formed.pods if p["spec"]["nodeName"] == lost]
        lost_claim = lost_pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
        [kept] = [
            m
            for m in (await store.list(store.keys.members(formed.cd_uid), pb.Member))[0]
            if m.value.node_name == survivor
        ]

        env.lose_node(lost)
        try:

            async def replaced() -> list[dict[str, Any]] | None:
                pods = [p for p in await kube.list_pods(api, ns, "e2e-job=resilient") if kube.is_running(p)]
                nodes = sorted(
                    p["spec"]["nodeName"] for p in pods if not p["metadata"].get("deletionTimestamp")
                )
                return pods if len(nodes) == 2 and lost not in nodes else None

            pods = await kube.eventually(
                replaced,
                f"the Job's pod on lost {lost} replaced on another tray",
                timeout_s=180.0,
                explain=env.explain_kubelets,
            )
            new_node = next(
                p["spec"]["nodeName"] for p in pods if p["spec"]["nodeName"] not in (lost, survivor)
            )
            assert env.cluster.node(new_node).clique == env.cluster.node(survivor).clique
            # The evicted pod stays Terminating (no kubelet ends it), so its claim stays reserved
            # and our controller keeps the lost node's index for its return (NodeLost). The
            # operator declares the node gone (Kubernetes' non-graceful node shutdown): the pod
            # garbage collector deletes its pods, the claim is released, the domain re-forms.
            env.cp.kubectl("taint", "nodes", lost, "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute")

            async def claim_gone() -> bool | None:
                return True if await kube.get_claim(api, ns, lost_claim) is None else None

            await kube.eventually(claim_gone, f"the lost pod's claim {lost_claim} deleted")
            await wait_cd_ready(env, api, ns, EXAMPLE_CD, [survivor, new_node])
            [kept_after] = [
                m
                for m in (await store.list(store.keys.members(formed.cd_uid), pb.Member))[0]
                if m.value.node_name == survivor
            ]
            assert kept_after.create_revision == kept.create_revision
            # The lost node holds nothing of the domain any more: no claim record, no member.
            assert (await store.list(store.keys.preparations(lost), pb.PreparedClaim))[0] == []
            members = (await store.list(store.keys.members(formed.cd_uid), pb.Member))[0]
            assert sorted(m.value.node_name for m in members) == sorted([survivor, new_node])
            assert await check_store_invariants(store) == []
        finally:
            env.restore_node(lost)
            env.cp.kubectl("taint", "nodes", lost, "node.kubernetes.io/out-of-service-", check=False)
        await kube.delete_job(api, ns, "resilient")
        await kube.delete_cd(api, ns, EXAMPLE_CD)
