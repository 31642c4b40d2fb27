"""Namespace isolation with real objects: a claim in namespace B whose opaque config names the
ComputeDomain of namespace A is allocated by the scheduler, but prepare refuses it for good; the
pod shows why in its events, and nothing changes in A's domain."""

from __future__ import annotations

import json

import pytest
from kubernetes_asyncio.client import ApiClient

from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import check_store_invariants
from libs.state.store import Store
from tests.e2e import kube
from tests.e2e.harness import DRIVER, E2EEnvironment
from tests.e2e.scenario import apply_example_cd, cdi_spec_exists, kubectl_get_computedomains

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REFUSAL = "a claim may only use a ComputeDomain of its own namespace"


async def test_claim_naming_a_domain_of_another_namespace_is_refused_and_changes_nothing(
    e2e_env: E2EEnvironment, api: ApiClient, e2e_store: Store, namespace: str, other_namespace: str
) -> None:
    victim, attacker = namespace, other_namespace
    cd = await apply_example_cd(
        api, victim, "imex-channel-injection.yaml", "imex-channel-injection", "imex-channel-0"
    )
    cd_uid = cd["metadata"]["uid"]
    before = await kube.get_cd(api, victim, "imex-channel-injection")
    assert before is not None

    # kubectl sends compact JSON, as users' tools do (see the RCT note in the controller).
    claim = kube.channel_claim("borrowed-channel", attacker, cd_uid, await kube.resource_api(api))
    e2e_env.cp.kubectl("create", "-f", "-", input=json.dumps(claim))
    e2e_env.cp.kubectl(
        "create", "-f", "-", input=json.dumps(kube.pod_with_claim("intruder", attacker, "borrowed-channel"))
    )

    async def refusal_events() -> list[dict] | None:
        events = await kube.pod_events(api, attacker, "intruder")
        found = [e for e in events if e.get("reason") == "FailedPrepareDynamicResources"]
        # Kubelet's first attempt suffices: it retries with a backoff (test_real_kubelet.py shows a
        # retry), and waiting for one here took over a minute.
        return found or None

    events = await kube.eventually(
        refusal_events, "FailedPrepareDynamicResources events on the pod", explain=e2e_env.explain
    )
    messages = " | ".join(e["message"] for e in events)
    assert REFUSAL in messages, messages
    assert cd_uid in messages, messages
    assert victim not in messages, f"the refusal reveals the other tenant's namespace: {messages}"
    assert all(e["type"] == "Warning" and e["source"]["component"] == "kubelet" for e in events)

    # Allocated by the real scheduler: the refusal is prepare's, on the node.
    allocated = await kube.get_claim(api, attacker, "borrowed-channel")
    assert allocated is not None
    results = allocated["status"]["allocation"]["devices"]["results"]
    assert [(r["driver"], r["device"]) for r in results] == [(DRIVER, "channel-0")]
    node = results[0]["pool"]
    pods = await kube.list_pods(api, attacker)
    assert [(p["metadata"]["name"], p["status"]["phase"]) for p in pods] == [("intruder", "Pending")]

    # Nothing changed in the victim's domain: no member, no binding, no daemon, no CDI file.
    members, _ = await e2e_store.list(e2e_store.keys.members(cd_uid), pb.Member)
    assert members == []
    binding = await e2e_store.get(e2e_store.keys.node_binding(node), pb.NodeBinding)
    assert binding is None or binding.value.domain_uid != cd_uid
    assert not (e2e_env.layout.node(node).imex_dir / cd_uid).exists()
    assert not cdi_spec_exists(e2e_env, node, allocated["metadata"]["uid"])
    after = await kube.get_cd(api, victim, "imex-channel-injection")
    assert after is not None
    assert after["status"]["nodes"] == [] and after["status"]["status"] == "NotReady"
    assert kubectl_get_computedomains(e2e_env, victim)["imex-channel-injection"]["NODES"] == "0"
    assert await check_store_invariants(e2e_store) == []

    # The pod can still be deleted (unprepare of a never-prepared claim succeeds).
    await kube.delete_pod(api, attacker, "intruder")

    async def pod_gone() -> bool | None:
        return True if not await kube.list_pods(api, attacker) else None

    await kube.eventually(pod_gone, "the refused pod to be removed", explain=e2e_env.explain)
    await kube.delete_claim(api, attacker, "borrowed-channel")
    await kube.delete_cd(api, victim, "imex-channel-injection")

    async def cd_gone() -> bool | None:
        return True if await kube.get_cd(api, victim, "imex-channel-injection") is None else None

    await kube.eventually(cd_gone, "the victim's ComputeDomain to be deleted", explain=e2e_env.explain)
