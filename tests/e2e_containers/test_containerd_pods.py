"""Real containers: each node of a small environment (one rack of two trays) runs the upstream
kubelet on containerd v2 and runc (tools.containerd), with our controller, kubelet plugins and IMEX
agents as in tests/e2e.

What only a real runtime shows: containerd's CDI injection makes the claim's channel device node
in the container (the pod's own log lists it, with the spec's major and minor), a container without
a claim has no channel directory, a Job completes when its command ends, the domain turns Ready;
and afterwards nothing of the runtime is left on the host (processes, mounts, cgroups, addresses).
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient

from tests.e2e import kube
from tests.e2e.conftest import admin_api, fresh_namespace, newest_binaries, running
from tests.e2e.harness import E2EEnvironment
from tests.e2e.scenario import apply_example_cd, wait_cd_ready
from tools.containerd.config import BRIDGE_NAME, pod_range
from tools.containerd.node import ContainerdKubeletNode
from tools.containers.engine import CGROUP_ROOT
from tools.sim.kubelet.addresses import addresses_in_range
from tools.sim.kubelet.host_state import host_state

pytestmark = pytest.mark.e2e

CHANNEL_DIR = "/dev/nvidia-caps-imex-channels"
CD_NAME = "imex-channel-injection"
TEMPLATE = "imex-channel-0"
# Long enough for the domain's status to turn Ready while the Job's pods still run.
WORKLOAD_SECONDS = 30
JOB_DONE_S = 240.0


# Where a leaked mount of the nodes would show on the host (besides the environment's own root).
NODE_MOUNT_PREFIXES = ("/run/", "/var/run/", "/var/lib/kubelet", "/var/log", "/sys/fs/cgroup/")


@pytest.fixture(scope="module")
def containerd_env() -> Iterator[E2EEnvironment]:
    # Other sessions on this machine add their own node IPs and mounts meanwhile: compare only
    # what this environment could have left.
    before = host_state()
    shared_cgroups = sorted(CGROUP_ROOT.glob("*/k8s.io"))  # containerd's parent when kubelet gives none
    env = E2EEnvironment(newest_binaries(), racks=1, trays=2, kubelets="containerd")
    nodes: list[ContainerdKubeletNode] = []
    with running(env):
        nodes = [k for k in env.kubelet_nodes.values() if isinstance(k, ContainerdKubeletNode)]
        assert len(nodes) == 2
        yield env
    left = {n.name: n.leftovers() for n in nodes if n.leftovers()}
    assert not left, f"the containerd nodes left things behind: {left}"
    forced = {n.name: n.stop_problems for n in nodes if n.stop_problems}
    assert not forced, f"stopping the containerd nodes needed force: {forced}"
    after = host_state()
    assert after["sysctl"] == before["sysctl"] and after["paths"] == before["paths"]
    assert not {n.ip for n in nodes} & set(addresses_in_range()), "node IPs left on the host"
    new_mounts = set(after["mounts"]) - set(before["mounts"])  # type: ignore[call-overload]
    leaked = [m for m in new_mounts if m.startswith((str(env.root), *NODE_MOUNT_PREFIXES))]
    assert not leaked, f"mounts left on the host: {leaked}"
    assert sorted(CGROUP_ROOT.glob("*/k8s.io")) == shared_cgroups, (
        "containers were not under their node's cgroup"
    )


def _pod_log(env: E2EEnvironment, pod: dict[str, Any]) -> list[str]:
    """What the pod's container wrote, from the log file containerd keeps for kubelet (CRI format:
    `<time> <stream> <tag> <line>`); read on the node, since kubelet's API takes no client here."""
    node = env.kubelet_nodes[pod["spec"]["nodeName"]]
    meta = pod["metadata"]
    pod_dir = node.state_dir / "var-log" / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"
    files = sorted(pod_dir.glob("*/*.log"))
    assert files, f"no container log under {pod_dir}"
    return [line.split(" ", 3)[3] for line in Path(files[0]).read_text().splitlines()]


async def _finished(
    api: ApiClient, namespace: str, selector: str, count: int, env: E2EEnvironment
) -> list[Any]:
    async def done() -> list[dict[str, Any]] | None:
        pods = await kube.list_pods(api, namespace, selector)
        ended = [p for p in pods if p["status"].get("phase") in ("Succeeded", "Failed")]
        return ended if len(ended) == count else None

    return await kube.eventually(
        done, f"{count} finished pods ({selector})", JOB_DONE_S, env.explain_kubelets
    )


def _assert_bridge_only_in_pod_network(env: E2EEnvironment) -> None:
    """The pods' bridge is in the environment's own network namespace, which has no route at all
    (the bridge has no address: no gateway), so nothing leaves it; the host has no such interface."""
    assert env.pod_network is not None
    bridge = env.pod_network.run(["ip", "-o", "link", "show", BRIDGE_NAME])
    assert bridge.returncode == 0, bridge.stderr
    routes = env.pod_network.run(["ip", "-4", "route", "show"])
    assert routes.returncode == 0 and routes.stdout.split() == [], routes
    on_host = subprocess.run(["ip", "link", "show", BRIDGE_NAME], capture_output=True, text=True, check=False)
    assert on_host.returncode != 0, on_host.stdout


def _workload(job: dict[str, Any], image: str, script: str) -> None:
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["image"] = image
    container["imagePullPolicy"] = "Never"
    container["command"] = ["sh", "-c", script]


async def test_a_job_lists_its_channel_completes_and_its_domain_turns_ready(
    containerd_env: E2EEnvironment,
) -> None:
    env = containerd_env
    assert env.node_images is not None
    major = env.cluster.imex_channel_major
    async with admin_api(env) as api, fresh_namespace(api, "ctrd") as ns:
        await apply_example_cd(api, ns, "imex-compute-domain.yaml", CD_NAME, TEMPLATE)
        job = kube.indexed_job("lister", ns, TEMPLATE, pods=2, size_hint=2)
        _workload(job, env.node_images.workload, f"ls -l {CHANNEL_DIR}; sleep {WORKLOAD_SECONDS}")
        await kube.create_job(api, job)

        # The domain forms while the pods run (their claims wait for its daemons).
        cd = await wait_cd_ready(env, api, ns, CD_NAME, env.node_names)
        assert cd["status"]["status"] == "Ready"
        _assert_bridge_only_in_pod_network(env)

        async def complete() -> dict[str, Any] | None:
            found = await kube.raw_get(api, f"/apis/batch/v1/namespaces/{ns}/jobs/lister")
            conditions = ((found or {}).get("status") or {}).get("conditions") or []
            return (
                found if any(c["type"] == "Complete" and c["status"] == "True" for c in conditions) else None
            )

        done = await kube.eventually(complete, "the Job to complete", JOB_DONE_S, env.explain_kubelets)
        assert done["status"]["succeeded"] == 2
        pods = await _finished(api, ns, "e2e-job=lister", 2, env)
        assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(env.node_names)
        for pod in pods:
            assert pod["status"]["phase"] == "Succeeded", pod["status"]
            assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
            node = env.kubelet_nodes[pod["spec"]["nodeName"]]
            assert isinstance(node, ContainerdKubeletNode)
            first, last = (ipaddress.IPv4Address(a) for a in pod_range(node.ordinal))
            assert first <= ipaddress.IPv4Address(pod["status"]["podIP"]) <= last, (node.name, pod["status"])
            lines = _pod_log(env, pod)
            # `ls -l` of the directory: its one entry is channel 0, a character device with the
            # major of the simulated /proc/devices and minor 0, as the CDI spec names it.
            entries = [line for line in lines if not line.startswith("total")]
            assert len(entries) == 1, lines
            assert re.fullmatch(rf"c\S+ +\d+ +root +root +{major}, +0 .* channel0", entries[0]), lines

        await kube.delete_job(api, ns, "lister")
        await kube.delete_cd(api, ns, CD_NAME)


async def test_a_pod_without_a_claim_has_no_channel_directory(containerd_env: E2EEnvironment) -> None:
    env = containerd_env
    assert env.node_images is not None
    async with admin_api(env) as api, fresh_namespace(api, "ctrd-plain") as ns:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "plain", "namespace": ns, "labels": {"app": "plain"}},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {
                        "name": "main",
                        "image": env.node_images.workload,
                        "imagePullPolicy": "Never",
                        "command": ["ls", "/dev"],
                    }
                ],
            },
        }
        env.cp.kubectl("create", "-f", "-", input=json.dumps(pod))
        [finished] = await _finished(api, ns, "app=plain", 1, env)
        assert finished["status"]["phase"] == "Succeeded", finished["status"]
        listing = _pod_log(env, finished)
        assert "null" in listing, listing  # ls ran and listed the container's /dev
        assert CHANNEL_DIR.rsplit("/", 1)[1] not in listing, listing
