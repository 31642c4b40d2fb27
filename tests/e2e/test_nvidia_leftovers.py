"""Switching from NVIDIA's driver: its CRD left installed, and its per-domain daemon DaemonSets.

Helm never upgrades a chart's crds/, so a cluster that ran NVIDIA's driver keeps NVIDIA's
ComputeDomain CRD, whose status declares only `status` and `nodes`: the API server prunes our
`conditions`, `nodeCount` and `imexMesh` from every status write. NVIDIA's controller also made,
per domain, a DaemonSet `computedomain-daemon-<uid>` in its own namespace selecting the Nodes
labelled `resource.nvidia.com/computeDomain=<uid>` (the label our controller writes on a domain's
members), whose pods claim a device of the DeviceClass `compute-domain-daemon.nvidia.com` through a
ResourceClaimTemplate of the same name; both carry the finalizer `resource.nvidia.com/computeDomain`.

On one rack of 4 trays (kubelet shim) whose API server has NVIDIA's CRD and an audit log: a domain
forms and turns Ready, and once it has, the controller writes no status and no Event, nor touches
a Node, for several sweep periods (the audit log counts its writes). With NVIDIA's leftovers in
place, the same holds, the DaemonSet's pods stay Pending (their DeviceClass is gone with NVIDIA's
chart) and the domain's teardown completes; only the DaemonSet remains for the operator to delete
(docs/migration.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio.client import ApiClient, CoreV1Api, V1Namespace, V1ObjectMeta

from libs.kube.resource_api import device_request, resource_path
from libs.state.store import Store
from tests.e2e import audit, kube
from tests.e2e.conftest import admin_api, fresh_namespace, newest_binaries, running, services_store
from tests.e2e.harness import CONTROLLER_SWEEP_S, DOMAIN_LABEL, E2EEnvironment
from tests.e2e.scenario import (
    apply_example_cd,
    delete_cd_and_wait_gone,
    delete_job_and_wait_released,
    wait_cd_ready,
    wait_job_running,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
NVIDIA_CRD = REPO / "tests" / "manifests" / "nvidia" / "crd-computedomains.yaml"
NVIDIA_NAMESPACE = "nvidia-dra-driver-gpu"  # where NVIDIA's install guide puts its driver
DAEMON_DEVICE_CLASS = "compute-domain-daemon.nvidia.com"
CONTROLLER_AGENT = "cd-controller"
# Quiet for this long after the domain settled: several sweeps, each of which queues every domain.
QUIET_WINDOW_S = 4 * CONTROLLER_SWEEP_S
PODS = 2
# What docs/migration.md tells the operator to run for NVIDIA's per-domain objects ($NS: the
# namespace NVIDIA's driver was installed in).
LEFTOVER_CLEANUP = """\
kubectl delete daemonsets,resourceclaimtemplates -n "$NS" -l resource.nvidia.com/computeDomain --wait=false
kubectl get daemonsets,resourceclaimtemplates -n "$NS" -l resource.nvidia.com/computeDomain -o name \\
  | xargs -r kubectl patch -n "$NS" --type=merge -p '{"metadata":{"finalizers":null}}'
"""


@pytest.fixture(scope="module")
def nvidia_env() -> Iterator[E2EEnvironment]:
    root = Path(tempfile.mkdtemp(prefix="cde2e-"))
    env = E2EEnvironment(
        newest_binaries(),
        racks=1,
        trays=4,
        root=root,
        crd=yaml.safe_load(NVIDIA_CRD.read_text()),
        apiserver_args=audit.apiserver_args(root / "audit"),
    )
    with running(env):
        yield env


@pytest.fixture
async def nvidia_api(nvidia_env: E2EEnvironment) -> AsyncIterator[ApiClient]:
    async with admin_api(nvidia_env) as api:
        yield api


@pytest.fixture
async def nvidia_store(nvidia_env: E2EEnvironment) -> AsyncIterator[Store]:
    async with services_store(nvidia_env) as store:
        yield store


@pytest.fixture
async def cd_namespace(nvidia_api: ApiClient) -> AsyncIterator[str]:
    async with fresh_namespace(nvidia_api, "e2e-nvidia") as name:
        yield name


async def run_as_operator(env: E2EEnvironment, script: str) -> None:
    """Run shell commands as an operator would, from the repository, with this cluster's kubectl."""
    proc = await asyncio.create_subprocess_exec(
        "bash", "-euo", "pipefail", "-c", script,
        cwd=REPO,
        env={
            **os.environ,
            "PATH": f"{env.cp.bin_dir}:{os.environ['PATH']}",
            "KUBECONFIG": str(env.cp.kubeconfig),
            "NS": NVIDIA_NAMESPACE,
        },
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, f"{script}\n{stderr.decode()}"


def controller_writes(env: E2EEnvironment) -> list[audit.Write]:
    return audit.writes(env.root / "audit", CONTROLLER_AGENT)


async def assert_controller_quiet(env: E2EEnvironment, api: ApiClient, nodes: list[str]) -> None:
    """Once the domain has settled, the controller writes no CD status, Event or Node for
    QUIET_WINDOW_S, and the members keep their label."""
    labels_before = {n: (await kube.node_labels(api))[n].get(DOMAIN_LABEL) for n in nodes}
    # Settled: the Ready write and its Event are in, and a whole sweep period passed without more.
    await asyncio.sleep(CONTROLLER_SWEEP_S + 1)
    before = controller_writes(env)
    await asyncio.sleep(QUIET_WINDOW_S)
    during = controller_writes(env)[len(before) :]
    assert during == [], f"the controller kept writing after the domain settled: {during}"
    labels_after = {n: (await kube.node_labels(api))[n].get(DOMAIN_LABEL) for n in nodes}
    assert labels_after == labels_before and None not in labels_after.values(), labels_after


async def test_with_nvidias_crd_the_domain_turns_ready_and_the_controller_goes_quiet(
    nvidia_env: E2EEnvironment, nvidia_api: ApiClient, nvidia_store: Store, cd_namespace: str
) -> None:
    env, api, namespace = nvidia_env, nvidia_api, cd_namespace
    cd_name, template, job = "imex", "imex-channel", "quiet"
    await apply_example_cd(api, namespace, "imex-compute-domain.yaml", cd_name, template)
    await kube.create_job(api, kube.indexed_job(job, namespace, template, pods=PODS))
    formed = await wait_job_running(env, api, namespace, job, PODS, template)
    await wait_cd_ready(env, api, namespace, cd_name, formed.nodes, nvidia_crd=True)
    written = [w for w in controller_writes(env) if w.namespace == namespace]
    assert any(w.resource == "computedomains/status" and w.code == 200 for w in written), written
    assert any(w.resource == "events" for w in written), written

    await assert_controller_quiet(env, api, formed.nodes)

    await delete_job_and_wait_released(
        env, api, nvidia_store, namespace, job, formed, cd_name, nvidia_crd=True
    )
    await delete_cd_and_wait_gone(env, api, nvidia_store, namespace, cd_name, template, formed)


def nvidia_daemon_leftovers(cd_uid: str, version: str) -> list[dict[str, Any]]:
    """What NVIDIA's controller made for a domain in its namespace: the daemon's ResourceClaimTemplate
    and DaemonSet (names, labels, finalizer, node selector, claim and tolerations as it makes them)."""
    name = f"computedomain-daemon-{cd_uid}"
    labels = {DOMAIN_LABEL: cd_uid}
    meta: dict[str, Any] = {
        "name": name,
        "namespace": NVIDIA_NAMESPACE,
        "finalizers": [DOMAIN_LABEL],
        "labels": labels,
    }
    rct = {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            **meta,
            "labels": {**labels, "resource.nvidia.com/computeDomainTarget": "Daemon"},
        },
        "spec": {
            "spec": {
                "devices": {
                    "requests": [device_request("daemon", DAEMON_DEVICE_CLASS, version)],
                    "config": [
                        {
                            "requests": ["daemon"],
                            "opaque": {
                                "driver": "compute-domain.nvidia.com",
                                "parameters": {
                                    "apiVersion": "resource.nvidia.com/v1beta1",
                                    "kind": "ComputeDomainDaemonConfig",
                                    "domainID": cd_uid,
                                },
                            },
                        }
                    ],
                }
            }
        },
    }
    daemonset = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": {DOMAIN_LABEL: cd_uid}},
            "template": {
                "metadata": {"labels": {DOMAIN_LABEL: cd_uid}},
                "spec": {
                    "nodeSelector": {DOMAIN_LABEL: cd_uid},
                    "containers": [
                        {
                            "name": "compute-domain-daemon",
                            "image": "nvcr.io/nvidia/k8s-dra-driver-gpu:v25.8.0",
                            "command": ["compute-domain-daemon", "run"],
                            "resources": {"claims": [{"name": "compute-domain-daemon"}]},
                        }
                    ],
                    "tolerations": [
                        {"operator": "Exists", "effect": effect}
                        for effect in ("NoSchedule", "NoExecute", "PreferNoSchedule")
                    ],
                    "resourceClaims": [{"name": "compute-domain-daemon", "resourceClaimTemplateName": name}],
                },
            },
        },
    }
    return [rct, daemonset]


async def daemon_pods(api: ApiClient, cd_uid: str) -> list[dict[str, Any]]:
    return await kube.list_pods(api, NVIDIA_NAMESPACE, f"{DOMAIN_LABEL}={cd_uid}")


async def test_nvidias_daemon_daemonset_left_behind_neither_blocks_nor_fights_our_domain(
    nvidia_env: E2EEnvironment, nvidia_api: ApiClient, nvidia_store: Store, cd_namespace: str
) -> None:
    env, api, namespace = nvidia_env, nvidia_api, cd_namespace
    cd_name, template, job = "imex", "imex-channel", "after-nvidia"
    version = await kube.resource_api(api)
    # The state NVIDIA's uninstall leaves: a domain, its daemon DaemonSet and template, no
    # controller of ours yet.
    env.kill_controller()
    cd = await kube.create_cd(
        api,
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomain",
            "metadata": {"name": cd_name, "namespace": namespace, "finalizers": [DOMAIN_LABEL]},
            "spec": {"numNodes": 0, "channel": {"resourceClaimTemplate": {"name": template}}},
        },
    )
    cd_uid = cd["metadata"]["uid"]
    core = CoreV1Api(api)
    if NVIDIA_NAMESPACE not in {n.metadata.name for n in (await core.list_namespace()).items}:
        await core.create_namespace(V1Namespace(metadata=V1ObjectMeta(name=NVIDIA_NAMESPACE)))
    leftovers = nvidia_daemon_leftovers(cd_uid, version)
    # kubectl sends compact JSON, as NVIDIA's Go client does (the opaque parameters stay updatable).
    env.cp.kubectl(
        "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": leftovers})
    )
    env.start_controller()

    await kube.create_job(api, kube.indexed_job(job, namespace, template, pods=PODS))
    formed = await wait_job_running(env, api, namespace, job, PODS, template)
    assert formed.cd_uid == cd_uid
    await wait_cd_ready(env, api, namespace, cd_name, formed.nodes, nvidia_crd=True)

    # The DaemonSet now selects the members: its pods are made there and can never be scheduled.
    async def pending_on_members() -> list[dict[str, Any]] | None:
        pods = await daemon_pods(api, cd_uid)
        return pods if len(pods) == PODS else None

    pods = await kube.eventually(
        pending_on_members, f"{PODS} daemon pods of NVIDIA's DaemonSet", explain=env.explain
    )
    for pod in pods:
        assert not pod["spec"].get("nodeName"), pod["spec"]
        assert pod["status"].get("phase") == "Pending", pod["status"]

    await assert_controller_quiet(env, api, formed.nodes)
    for pod in await daemon_pods(api, cd_uid):
        assert not pod["spec"].get("nodeName") and pod["status"].get("phase") == "Pending", pod["status"]

    # Teardown is not held up by them. The pods stay: the DaemonSet controller looks again at a
    # Node whose labels changed only for the daemon pods bound to it, and these never were.
    await delete_job_and_wait_released(
        env, api, nvidia_store, namespace, job, formed, cd_name, nvidia_crd=True
    )
    await delete_cd_and_wait_gone(env, api, nvidia_store, namespace, cd_name, template, formed)
    assert len(await daemon_pods(api, cd_uid)) == PODS

    # The sweep removes the daemon's template (labelled with a gone domain's uid); the DaemonSet,
    # which our controller does not own, is left for the operator.
    rct_path = resource_path(
        version, "resourceclaimtemplates", NVIDIA_NAMESPACE, f"computedomain-daemon-{cd_uid}"
    )

    async def rct_swept() -> bool | None:
        return True if await kube.raw_get(api, rct_path) is None else None

    await kube.eventually(rct_swept, "NVIDIA's daemon ResourceClaimTemplate swept", explain=env.explain)
    daemonsets = await kube.raw_get(api, f"/apis/apps/v1/namespaces/{NVIDIA_NAMESPACE}/daemonsets")
    assert [d["metadata"]["name"] for d in (daemonsets or {}).get("items", [])] == [
        f"computedomain-daemon-{cd_uid}"
    ]

    # docs/migration.md's clean-up: the DaemonSets' finalizer off, then the DaemonSets deleted;
    # the garbage collector takes their pods.
    await run_as_operator(env, LEFTOVER_CLEANUP)

    async def no_daemon_pods() -> bool | None:
        gone = not await daemon_pods(api, cd_uid) and not await kube.list_claims(api, NVIDIA_NAMESPACE)
        return True if gone else None

    await kube.eventually(
        no_daemon_pods,
        "NVIDIA's daemon pods and their claims deleted with their DaemonSet",
        explain=env.explain,
    )


# What docs/migration.md tells the operator to run to put our CRD in place of NVIDIA's.
REPLACE_CRD = "kubectl apply --server-side --force-conflicts -f manifests/base/crd-computedomains.yaml"


async def test_our_crd_replaces_nvidias_in_place_and_a_restarted_controller_writes_the_whole_status(
    nvidia_env: E2EEnvironment, nvidia_api: ApiClient, cd_namespace: str
) -> None:
    """Runs last: it leaves our CRD installed."""
    env, api, namespace = nvidia_env, nvidia_api, cd_namespace
    await apply_example_cd(api, namespace, "imex-compute-domain.yaml", "kept", "kept-channel")

    async def waiting() -> dict[str, Any] | None:
        cd = await kube.get_cd(api, namespace, "kept")
        return cd if ((cd or {}).get("status") or {}).get("status") == "NotReady" else None

    before = await kube.eventually(waiting, "the new ComputeDomain NotReady", explain=env.explain)
    assert set(before["status"]) == {"status", "nodes"}, before["status"]

    await run_as_operator(env, REPLACE_CRD)
    env.cp.kubectl(
        "wait", "--for=condition=Established", "crd/computedomains.resource.nvidia.com", "--timeout=60s"
    )
    kept = await kube.get_cd(api, namespace, "kept")
    assert kept is not None and kept["metadata"]["uid"] == before["metadata"]["uid"]
    assert kept["spec"] == before["spec"]

    env.kill_controller()
    env.start_controller()

    async def whole_status() -> dict[str, Any] | None:
        cd = await kube.get_cd(api, namespace, "kept")
        status = (cd or {}).get("status") or {}
        return (
            status if status.get("conditions") and "nodeCount" in status and status.get("imexMesh") else None
        )

    status = await kube.eventually(
        whole_status, "conditions, nodeCount and imexMesh written", explain=env.explain
    )
    assert status["status"] == "NotReady" and status["nodeCount"] == 0
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "WaitingForNodes"), ready
    rows = env.cp.kubectl("get", "computedomains", "-n", namespace).stdout.splitlines()
    assert rows[0].split() == ["NAME", "STATUS", "NODES", "AGE"], rows
    await kube.delete_cd(api, namespace, "kept")
