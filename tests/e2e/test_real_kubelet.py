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
import io
import json
import os
import random
from typing import Any

import pytest
import yaml
from kubernetes_asyncio.client import ApiClient

from libs.cdi.spec import claim_cdi_device_id
from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import check_store_invariants
from libs.state.store import Store
from services.controller.kube.node_health import CONDITION_NODES_READY, REASON_NODE_NOT_READY
from services.nodeagent.wire.resourceslice import resource_slice_name
from tests.e2e import kube
from tests.e2e.conftest import admin_api, fresh_namespace, services_store
from tests.e2e.harness import CLIQUE_LABEL, DRIVER, EXAMPLES_DIR, E2EEnvironment, example_objects, iter_lines
from tests.e2e.scenario import apply_example_cd, cdi_spec_exists, wait_cd_ready, wait_job_running
from tools.cdsim import workload
from tools.chaos import continuity
from tools.chaoskube.soak import FAULTS as CHAOS_FAULTS
from tools.chaoskube.soak import KubeSoak, KubeSoakOptions
from tools.sim.kubelet.addresses import is_local_only
from tools.sim.kubelet.record import created_containers, records

pytestmark = pytest.mark.e2e

EXAMPLE = "imex-channel-injection.yaml"
EXAMPLE_CD = "imex-channel-injection"
IMPORT_TIMEOUT_S = 30.0
JOB_RUNNING_S = 180.0
CI_SOAK_S = 45.0  # seconds of random steps; faults in flight and the final checks come on top


def _registrations(env: E2EEnvironment, node: str) -> int:
    """How often kubelet has accepted the registration of `node`'s kubelet plugin."""
    return sum(1 for e in iter_lines(env.log(f"agent-{node}")) if e.get("event") == "registered with kubelet")


async def _running_pod(api: ApiClient, namespace: str, env: E2EEnvironment) -> dict[str, Any]:
    async def running() -> dict[str, Any] | None:
        pods = await kube.list_pods(api, namespace)
        return pods[0] if len(pods) == 1 and kube.is_running(pods[0]) else None

    return await kube.eventually(running, f"the pod in {namespace} to run", explain=env.explain_kubelets)


async def _pods_running(api: ApiClient, namespace: str, job: str, pods: int, env: E2EEnvironment) -> None:
    """The Job's pods all Running, waited for longer than usual: kubelet can see a new pod before
    the API server's node authorizer links the pod to the node, and then it retries the pod's
    prepare only about 90 s later ("no relationship found between node ..."; seen on a loaded
    machine)."""

    async def running() -> bool | None:
        found = [p for p in await kube.list_pods(api, namespace, f"e2e-job={job}") if kube.is_running(p)]
        return True if len(found) == pods else None

    await kube.eventually(
        running, f"{pods} Running pods of Job {job}", timeout_s=JOB_RUNNING_S, explain=env.explain_kubelets
    )


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


async def _slice_published_again(api: ApiClient, env: E2EEnvironment, node: str) -> None:
    """Kubelet deletes its node's ResourceSlices when it starts; the node's agent publishes its
    slice again (else no claim can be allocated on the node any more)."""

    async def published() -> bool | None:
        version = await kube.resource_api(api)
        found = await kube.raw_get(
            api, f"/apis/resource.k8s.io/{version}/resourceslices/{resource_slice_name(node)}"
        )
        return True if found is not None and found["spec"]["nodeName"] == node else None

    await kube.eventually(published, f"{node}'s ResourceSlice published again", explain=env.explain_kubelets)


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
        await _slice_published_again(api, env, node)
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


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), None)


def _ready_status(node: dict[str, Any]) -> str:
    return str(next(c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready"))


async def test_a_stopped_kubelet_is_reported_on_the_domain_and_its_return_leaves_the_jobs_imports_intact(
    kubelet_env: E2EEnvironment,
) -> None:
    """Kubelet stops under a running 2-pod Job: the node lifecycle controller marks the Node's Ready
    condition Unknown; our controller reports it on the domain (NodesReady False, naming the node,
    with a Warning event) while the domain stays Ready: the pods, claims, members and the
    workload's imports stay as they are (the node's IMEX daemon does not depend on kubelet). The
    restarted kubelet turns the Node Ready again, the report clears, nothing was recreated.

    The Job's pods tolerate an unreachable node for 300 s (upstream's default; this environment
    shortens the default to EVICTION_TOLERATION_S so a lost node's pod is replaced quickly), so the
    outage is not long enough for Kubernetes to evict them."""
    env = kubelet_env
    async with admin_api(env) as api, services_store(env) as store, fresh_namespace(api, "notready") as ns:
        await apply_example_cd(api, ns, "imex-compute-domain.yaml", EXAMPLE_CD, "imex-channel-0")
        job = kube.indexed_job("steady", ns, "imex-channel-0", pods=2, size_hint=2)
        job["spec"]["template"]["spec"]["tolerations"] = [
            {"key": taint, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
            for taint in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
        ]
        await kube.create_job(api, job)
        await _pods_running(api, ns, "steady", 2, env)
        formed = await wait_job_running(env, api, ns, "steady", 2, "imex-channel-0")
        await wait_cd_ready(env, api, ns, EXAMPLE_CD, formed.nodes)
        cd_uid = formed.cd_uid
        importers = await workload.import_all(store, cd_uid, "steady", IMPORT_TIMEOUT_S)
        assert continuity.verdict(await workload.check("steady", importers)) == continuity.INTACT
        node = formed.nodes[0]
        members_before = {
            m.value.node_name: m for m in (await store.list(store.keys.members(cd_uid), pb.Member))[0]
        }
        kubelet = env.kubelet_nodes[node]
        sandboxes = list(records(kubelet.record_path, "RunPodSandbox"))

        kubelet.stop_kubelet()
        try:

            async def not_ready() -> dict[str, Any] | None:
                found = await kube.raw_get(api, f"/api/v1/nodes/{node}")
                return found if found is not None and _ready_status(found) == "Unknown" else None

            await kube.eventually(not_ready, f"the node lifecycle controller to mark {node} not ready")

            async def reported() -> dict[str, Any] | None:
                status = ((await kube.get_cd(api, ns, EXAMPLE_CD)) or {}).get("status") or {}
                cond = _condition(status, CONDITION_NODES_READY)
                return status if cond and cond["status"] == "False" else None

            cd_status = await kube.eventually(reported, f"the controller to report {node} not Ready")
            assert cd_status["status"] == "Ready", cd_status
            cond = _condition(cd_status, CONDITION_NODES_READY)
            assert cond is not None and cond["reason"] == REASON_NODE_NOT_READY, cd_status
            assert f"{node} (Ready=Unknown, NodeStatusUnknown" in cond["message"], cond
            assert formed.nodes[1] not in cond["message"], cond
            events = await kube.object_events(api, ns, "ComputeDomain", EXAMPLE_CD)
            warnings = [e for e in events if e.get("reason") == REASON_NODE_NOT_READY]
            assert warnings and node in warnings[-1]["message"], events
            assert warnings[-1]["type"] == "Warning"
            assert continuity.verdict(await workload.check("steady", importers)) == continuity.INTACT
        finally:
            kubelet.start_kubelet()

        async def ready_again() -> dict[str, Any] | None:
            found = await kube.raw_get(api, f"/api/v1/nodes/{node}")
            return found if found is not None and _ready_status(found) == "True" else None

        await kube.eventually(ready_again, f"{node} to be Ready again under its restarted kubelet")
        await _slice_published_again(api, env, node)

        async def reported_ready() -> dict[str, Any] | None:
            status = ((await kube.get_cd(api, ns, EXAMPLE_CD)) or {}).get("status") or {}
            cond = _condition(status, CONDITION_NODES_READY)
            return status if cond and cond["status"] == "True" else None

        cd_status = await kube.eventually(reported_ready, f"the controller to report {node} Ready again")
        assert cd_status["status"] == "Ready", cd_status
        pods = [p for p in await kube.list_pods(api, ns, "e2e-job=steady") if kube.is_running(p)]
        assert sorted(p["metadata"]["uid"] for p in pods) == sorted(p["metadata"]["uid"] for p in formed.pods)
        assert not any(p["metadata"].get("deletionTimestamp") for p in pods), pods
        assert list(records(kubelet.record_path, "RunPodSandbox")) == sandboxes
        members_after = {
            m.value.node_name: m for m in (await store.list(store.keys.members(cd_uid), pb.Member))[0]
        }
        assert {n: (m.create_revision, m.value.index) for n, m in members_after.items()} == {
            n: (m.create_revision, m.value.index) for n, m in members_before.items()
        }
        assert continuity.verdict(await workload.check("steady", importers)) == continuity.INTACT
        await wait_cd_ready(env, api, ns, EXAMPLE_CD, formed.nodes)

        claim_uids = {p["spec"]["nodeName"]: await _claim_uid(api, ns, p) for p in formed.pods}
        await kube.delete_job(api, ns, "steady")
        for pod in formed.pods:
            await kube.delete_pod(api, ns, pod["metadata"]["name"])
        for pod_node, claim_uid in claim_uids.items():
            await _unprepared(env, api, store, ns, pod_node, claim_uid, cd_uid)
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
        await _pods_running(api, ns, "resilient", 2, env)
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


@pytest.mark.timeout(600)
async def test_chaos_of_random_jobs_and_kubernetes_faults_keeps_every_invariant(
    kubelet_env: E2EEnvironment, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Kubernetes-mode chaos soak, short (`make chaos-k8s` runs it for 10 minutes on its own
    environment): random ComputeDomain jobs through the API server on this module's kubelets,
    every kind of fault at least once (kubelet restart, cd-node-agent kill, controller failover
    between two replicas, kube-apiserver restart, a node lost and declared out of service), and
    invariants 1-6 checked throughout, at quiescence and after every job is deleted. Last in the
    module: it leaves a second controller replica's work and restarted processes behind. The seed
    is fresh each run (or $CHAOS_SEED) and printed."""
    env = kubelet_env
    seed = int(os.environ.get("CHAOS_SEED") or random.randrange(2**31))
    options = KubeSoakOptions(duration_s=CI_SOAK_S, seed=seed, max_job_size=2)
    out = io.StringIO()
    async with admin_api(env) as api, services_store(env) as store:
        soak = KubeSoak(env, api, store, options, out)
        ok = await soak.run()
    summary = soak.summary(ok)
    shown = f"seed {seed}\n{soak.report(ok)}\n{out.getvalue()[-20000:]}"
    with capsys.disabled():
        print(f"\nkubernetes chaos soak: {json.dumps(summary)}")
    assert ok and summary["violations"] == [], shown
    assert set(summary["faults"]) >= set(CHAOS_FAULTS), shown
    # The first job takes two of the four trays (imports); one stays spare for a lost node's pod,
    # so in 45 s there is room for one or two jobs.
    assert summary["jobs"].get("formed", 0) >= 1 and summary["jobs"].get("delete ok", 0) >= 1, shown
    assert summary["jobs"].get("imports ok", 0) >= 1, shown
    assert summary["checks"].get("1-3", 0) >= 20 and summary["checks"].get("cluster idle") == 1, shown
