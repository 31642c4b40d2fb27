"""The steps of the ComputeDomain + Indexed Job scenario, shared by the scenario tests.

Each step waits (bounded) for what a user would see, asserts it, and returns what later steps
need. The store and node-local checks are the invariants of libs/invariants/checker.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kubernetes_asyncio.client import ApiClient

from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import check_domain_gone, check_store_invariants
from libs.state.store import Store
from tests.e2e import kube
from tests.e2e.harness import CLIQUE_LABEL, DOMAIN_LABEL, DRIVER, E2EEnvironment, example_compute_domain


@dataclass
class Formed:
    cd_uid: str
    pods: list[dict[str, Any]]
    claims: dict[str, dict[str, Any]]  # claim name -> claim
    nodes: list[str]
    claim_uids: list[str] = field(default_factory=list)


def cdi_spec_exists(env: E2EEnvironment, node: str, claim_uid: str) -> bool:
    root = env.layout.node(node).cdi_root
    return any(
        (root / f"k8s.compute-domain.nvidia.com-claim_{claim_uid}{s}").exists() for s in (".yaml", ".json")
    )


async def apply_example_cd(
    api: ApiClient, namespace: str, example: str, name: str, template: str
) -> dict[str, Any]:
    """Create the ComputeDomain of an NVIDIA example (names changed only); waits for its RCT."""
    created = await kube.create_cd(api, example_compute_domain(example, name, template, namespace))
    await kube.eventually(
        lambda: kube.get_template(api, namespace, template), f"ResourceClaimTemplate {namespace}/{template}"
    )
    return created


async def wait_job_running(
    env: E2EEnvironment, api: ApiClient, namespace: str, job: str, pods: int, template: str
) -> Formed:
    """All pods of the Job Running (their claims prepared by kubelet), each on its own node, in one clique."""

    async def running() -> list[dict[str, Any]] | None:
        items = [p for p in await kube.list_pods(api, namespace, f"e2e-job={job}") if kube.is_running(p)]
        return items if len(items) == pods else None

    running_pods = await kube.eventually(
        running, f"{pods} Running pods of Job {namespace}/{job}", explain=lambda: env.explain()
    )
    nodes = [p["spec"]["nodeName"] for p in running_pods]
    assert len(set(nodes)) == pods, f"pods share nodes: {nodes}"
    labels = await kube.node_labels(api)
    cliques = {labels[n].get(CLIQUE_LABEL) for n in nodes}
    assert len(cliques) == 1 and None not in cliques, f"pods spread over cliques {cliques} (nodes {nodes})"
    claims: dict[str, dict[str, Any]] = {}
    for pod in running_pods:
        statuses = pod["status"].get("resourceClaimStatuses") or []
        assert len(statuses) == 1, statuses
        claim = await kube.get_claim(api, namespace, statuses[0]["resourceClaimName"])
        assert claim is not None
        results = claim["status"]["allocation"]["devices"]["results"]
        # The real scheduler allocated channel-0 from the ResourceSlice of the pod's node.
        assert [(r["driver"], r["pool"], r["device"]) for r in results] == [
            (DRIVER, pod["spec"]["nodeName"], "channel-0")
        ], results
        assert claim["metadata"]["annotations"].get("resource.kubernetes.io/pod-claim-name") == "imex-channel"
        claims[claim["metadata"]["name"]] = claim
    template_obj = await kube.get_template(api, namespace, template)
    assert template_obj is not None
    cd_uid = template_obj["metadata"]["labels"][DOMAIN_LABEL]
    return Formed(cd_uid, running_pods, claims, nodes, [c["metadata"]["uid"] for c in claims.values()])


async def wait_cd_ready(
    env: E2EEnvironment, api: ApiClient, namespace: str, name: str, nodes: list[str], nvidia_crd: bool = False
) -> dict[str, Any]:
    """The CD's status says Ready with exactly `nodes`, each Ready with a unique index in its clique.
    With `nvidia_crd` (NVIDIA's CRD installed), the status holds only what that CRD declares."""

    async def ready() -> dict[str, Any] | None:
        cd = await kube.get_cd(api, namespace, name)
        status = (cd or {}).get("status") or {}
        members = status.get("nodes") or []
        if status.get("status") != "Ready" or sorted(m["name"] for m in members) != sorted(nodes):
            return None
        return cd

    cd = await kube.eventually(
        ready,
        f"ComputeDomain {namespace}/{name} Ready with nodes {sorted(nodes)}",
        explain=lambda: env.explain(),
    )
    status = cd["status"]
    if nvidia_crd:
        assert set(status) == {"status", "nodes"}, status
    else:
        assert status["nodeCount"] == len(nodes)
    assert all(m["status"] == "Ready" for m in status["nodes"]), status["nodes"]
    by_clique: dict[str, list[int]] = {}
    for m in status["nodes"]:
        assert m["ipAddress"] == env.cluster.node(m["name"]).address
        assert m["cliqueID"] == env.cluster.node(m["name"]).clique
        by_clique.setdefault(m["cliqueID"], []).append(m["index"])
    for indices in by_clique.values():
        assert len(set(indices)) == len(indices) and all(0 <= i < 18 for i in indices), status["nodes"]
    if not nvidia_crd:
        ready_condition = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert ready_condition["status"] == "True"

    async def members_labelled() -> bool | None:
        labels = await kube.node_labels(api)
        return True if all(labels[n].get(DOMAIN_LABEL) == cd["metadata"]["uid"] for n in nodes) else None

    await kube.eventually(
        members_labelled, f"every member Node labelled {DOMAIN_LABEL}={cd['metadata']['uid']}"
    )
    return cd


def kubectl_get_computedomains(env: E2EEnvironment, namespace: str) -> dict[str, dict[str, str]]:
    """`kubectl get computedomains` as {name: {column: value}} (default printer columns)."""
    out = env.cp.kubectl("get", "computedomains", "-n", namespace).stdout.splitlines()
    header = out[0].split()
    assert header == ["NAME", "STATUS", "NODES", "AGE"], out[0]
    rows = {}
    for line in out[1:]:
        cells = line.split()
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    return rows


async def delete_job_and_wait_released(
    env: E2EEnvironment,
    api: ApiClient,
    store: Store,
    namespace: str,
    job: str,
    formed: Formed,
    cd_name: str,
    nvidia_crd: bool = False,
) -> None:
    """Delete the Job: pods go (kubelet unprepares their claims), claims go, nodes leave the domain.
    With `nvidia_crd`, the CD's status has no node count."""
    await kube.delete_job(api, namespace, job)

    async def pods_and_claims_gone() -> bool | None:
        pods = await kube.list_pods(api, namespace, f"e2e-job={job}")
        names = {c["metadata"]["name"] for c in await kube.list_claims(api, namespace)}
        return True if not pods and not (names & set(formed.claims)) else None

    await kube.eventually(
        pods_and_claims_gone, f"pods and claims of Job {namespace}/{job} gone", explain=env.explain
    )

    async def domain_empty() -> dict[str, Any] | None:
        cd = await kube.get_cd(api, namespace, cd_name)
        status = (cd or {}).get("status") or {}
        return cd if status.get("nodes") == [] and (nvidia_crd or status.get("nodeCount") == 0) else None

    cd = await kube.eventually(
        domain_empty, f"no node left in ComputeDomain {namespace}/{cd_name}", explain=env.explain
    )
    assert cd["status"]["status"] == "NotReady"
    members, _ = await store.list(store.keys.members(formed.cd_uid), pb.Member)
    assert members == [], [m.key for m in members]
    for node, uid in zip(formed.nodes, formed.claim_uids, strict=True):
        assert not cdi_spec_exists(env, node, uid), f"CDI spec of claim {uid} still on {node}"
    assert await check_store_invariants(store) == []


async def delete_cd_and_wait_gone(
    env: E2EEnvironment,
    api: ApiClient,
    store: Store,
    namespace: str,
    name: str,
    template: str,
    formed: Formed,
) -> None:
    """Delete the CD: the finalizer holds it until teardown left nothing behind, anywhere."""
    await kube.delete_cd(api, namespace, name)

    async def gone() -> bool | None:
        return True if await kube.get_cd(api, namespace, name) is None else None

    await kube.eventually(
        gone, f"ComputeDomain {namespace}/{name} deleted (finalizer released)", explain=env.explain
    )
    assert await kube.get_template(api, namespace, template) is None, "the workload RCT outlived its CD"
    labelled = {n: ls[DOMAIN_LABEL] for n, ls in (await kube.node_labels(api)).items() if DOMAIN_LABEL in ls}
    assert formed.cd_uid not in labelled.values(), labelled

    async def quiescent() -> list[str] | None:
        problems = await check_domain_gone(store, formed.cd_uid, formed.claim_uids, env.all_node_paths())
        return None if problems else problems

    try:
        await kube.eventually(
            quiescent, f"no trace of domain {formed.cd_uid} in the store or on any node", 30.0
        )
    except AssertionError:
        problems = await check_domain_gone(store, formed.cd_uid, formed.claim_uids, env.all_node_paths())
        raise AssertionError(f"domain {formed.cd_uid} left traces: {problems}") from None
    assert await check_store_invariants(store) == []
