"""Pods of another ComputeDomain that hold the IMEX channel of chosen nodes and ask for no GPU: the
state in which a node's GPUs are free and its channel is not (a node is in one domain at a time)."""

from __future__ import annotations

from typing import Any, cast

from kubernetes_asyncio.client import ApiClient, CoreV1Api

from tests.e2e import kube
from tests.e2e.harness import CLIQUE_LABEL, E2EEnvironment
from tests.e2e.kueue.queued_job import queued_job

HOLDER = "holder"
HOLDER_TEMPLATE = "holder-channel"
HOSTNAME_LABEL = "kubernetes.io/hostname"


async def nodes_by_clique(env: E2EEnvironment, api: ApiClient) -> dict[str, list[str]]:
    """The environment's nodes by their clique label, each clique's sorted; checks the shape."""
    labels = await kube.node_labels(api)
    cliques: dict[str, list[str]] = {}
    for node in sorted(env.node_names):
        cliques.setdefault(labels[node][CLIQUE_LABEL], []).append(node)
    assert len(cliques) == env.racks and all(len(n) == env.trays for n in cliques.values()), cliques
    return cliques


def holder_pod(name: str, namespace: str, node: str) -> dict[str, Any]:
    """A pod pinned to `node` holding a channel of the holder domain and asking for no GPU."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"e2e-holder": "true"}},
        "spec": {
            "nodeSelector": {HOSTNAME_LABEL: node},
            "containers": [
                {"name": "main", "image": "ubuntu:22.04", "resources": {"claims": [{"name": "imex-channel"}]}}
            ],
            "resourceClaims": [{"name": "imex-channel", "resourceClaimTemplateName": HOLDER_TEMPLATE}],
        },
    }


async def take_channels(env: E2EEnvironment, api: ApiClient, namespace: str, nodes: list[str]) -> None:
    """The holder domain (not queued in Kueue) with one running pod on each of `nodes`."""
    cd, _ = queued_job(namespace, len(nodes))
    cd["metadata"]["name"] = HOLDER
    cd["spec"]["channel"]["resourceClaimTemplate"]["name"] = HOLDER_TEMPLATE
    await kube.create_cd(api, cd)
    await kube.eventually(
        lambda: kube.get_template(api, namespace, HOLDER_TEMPLATE), f"template {HOLDER_TEMPLATE}"
    )
    for i, node in enumerate(nodes):
        pod = holder_pod(f"{HOLDER}-{i}", namespace, node)
        await CoreV1Api(api).create_namespaced_pod(namespace, cast(Any, pod))  # sent as it is

    async def running() -> bool | None:
        pods = await kube.list_pods(api, namespace, "e2e-holder=true")
        return True if len(pods) == len(nodes) and all(kube.is_running(p) for p in pods) else None

    await kube.eventually(running, f"{len(nodes)} holder pods running", explain=env.explain_kubelets)


async def release_channels(api: ApiClient, namespace: str, nodes: list[str]) -> None:
    """Delete the holder pods (the holder domain is the caller's to delete)."""
    for i in range(len(nodes)):
        await kube.delete_pod(api, namespace, f"{HOLDER}-{i}")


async def tear_down(
    env: E2EEnvironment, api: ApiClient, namespace: str, job: str, cd_name: str, taken: list[str]
) -> None:
    """Delete the test's Job, the holder pods and both ComputeDomains, and wait for the domains to go."""
    await kube.delete_job(api, namespace, job)
    await release_channels(api, namespace, taken)
    for name in (cd_name, HOLDER):
        await kube.delete_cd(api, namespace, name)

    async def domains_gone() -> bool | None:
        found = [await kube.get_cd(api, namespace, n) for n in (cd_name, HOLDER)]
        return True if found == [None, None] else None

    await kube.eventually(domains_gone, "both ComputeDomains deleted", explain=env.explain)
