"""Node labels `resource.nvidia.com/computeDomain=<CD uid>` on a real kube-apiserver.

An in-process controller in Kubernetes mode (as in test_kube_adapter.py) over a real etcd and
the loopback control plane; node agents are played in the store by `AgentDouble`, the Nodes are
real Node objects. Checked: a node that joins a domain gets the label and loses it when it
leaves; a member without a Node object (simulated) costs one 404, no error, no retry; a node
labelled for another domain is never touched; after a domain is deleted no Node carries its uid,
including one labelled behind the controller's back, and that is so before the finalizer goes.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest
from kubernetes_asyncio.client import ApiClient, CoreV1Api, CustomObjectsApi
from kubernetes_asyncio.client.exceptions import ApiException

from libs.state.config import EtcdConfig
from libs.state.store import Store
from services.controller.kube.node_label import NodeLabeler
from tests.controller.harness import AgentDouble
from tests.controller.test_kube_adapter import (  # noqa: F401 - fixtures shared with the adapter tests
    CLIQUE,
    GROUP,
    KUBE_WAIT_S,
    LABEL,
    PLURAL,
    VERSION,
    _domain_in_store,
    api,
    cd_body,
    crd_installed,
    get_cd,
    kube_controller,
    namespace,
)
from tests.k8s.conftest import control_plane, control_plane_binaries  # noqa: F401 - session fixtures
from tests.polling import eventually
from tools.controlplane.cluster import ControlPlane
from tools.controlplane.nodes import create_schedulable_node

pytestmark = pytest.mark.e2e


@pytest.fixture
async def nodes(api: ApiClient) -> AsyncIterator[list[str]]:  # noqa: F811
    """Three real Node objects of this test's own (Nodes are cluster-wide: unique names)."""
    suffix = uuid.uuid4().hex[:6]
    names = [f"lbl-{suffix}-{i}" for i in range(3)]
    core = CoreV1Api(api)
    for name in names:
        await create_schedulable_node(core, name)
    yield names
    for name in names:
        with contextlib.suppress(ApiException):
            await core.delete_node(name)


async def label_of(client: ApiClient, node: str) -> str | None:
    got = await CoreV1Api(client).read_node(node)
    return (got.metadata.labels or {}).get(LABEL)


async def set_label(client: ApiClient, node: str, value: str | None) -> None:
    await CoreV1Api(client).patch_node(node, {"metadata": {"labels": {LABEL: value}}})


async def create_cd(client: ApiClient, ns: str, name: str) -> str:
    created = await CustomObjectsApi(client).create_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, cd_body(ns, name, f"{name}-channel")
    )
    return str(created["metadata"]["uid"])


async def test_members_are_labelled_and_labels_go_with_the_domain(
    api: ApiClient,  # noqa: F811
    namespace: str,  # noqa: F811
    store: Store,
    etcd_config: EtcdConfig,
    crd_installed: ControlPlane,  # noqa: F811
    nodes: list[str],
) -> None:
    joiner, neighbour, stray = nodes
    ghost = f"ghost-{uuid.uuid4().hex[:6]}"  # a member with no Node object (simulated node)
    async with kube_controller(etcd_config, crd_installed.kubeconfig) as adapter:
        uid = await create_cd(api, namespace, "job")
        other_uid = await create_cd(api, namespace, "other")
        await eventually(lambda: _domain_in_store(store, uid), "the store record of the CD", KUBE_WAIT_S)
        await eventually(
            lambda: _domain_in_store(store, other_uid), "the store record of the other CD", KUBE_WAIT_S
        )

        agents = {
            name: AgentDouble(store, name, CLIQUE, f"127.0.22.{i + 1}", ttl_s=5)
            for i, name in enumerate([joiner, neighbour, ghost])
        }
        for agent in agents.values():
            await agent.start()
        await agents[joiner].prepare(uid, namespace)
        await agents[ghost].prepare(uid, namespace)
        await agents[neighbour].prepare(other_uid, namespace)

        async def labelled(node: str, value: str | None) -> bool | None:
            return True if await label_of(api, node) == value else None

        await eventually(
            lambda: labelled(joiner, uid), "the joining node to carry the CD's label", KUBE_WAIT_S
        )
        await eventually(
            lambda: labelled(neighbour, other_uid), "the other CD's member to carry its label", KUBE_WAIT_S
        )

        async def ghost_settled() -> bool | None:
            settled = ghost in adapter.labeler.cache.absent and adapter.queue.backoff.retries(uid) == 0
            return True if settled else None

        # The 404 of the simulated member is "nothing to label": no failure, no requeue.
        await eventually(ghost_settled, "the simulated member to be known absent", KUBE_WAIT_S)

        # Scale-down: the node leaves while the domain lives on; its label goes.
        await agents[joiner].unprepare_all()
        await eventually(
            lambda: labelled(joiner, None), "the label of a node that left the domain to go", KUBE_WAIT_S
        )
        await agents[joiner].prepare(uid, namespace)
        await eventually(lambda: labelled(joiner, uid), "the label of a node that joined again", KUBE_WAIT_S)

        # A label the controller did not set (it has listed the Nodes already): only the
        # deletion's own listing finds it, and it must go before the finalizer does.
        await set_label(api, stray, uid)
        await CustomObjectsApi(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "job")
        await agents[joiner].unprepare_all()
        await agents[ghost].unprepare_all()

        async def cd_gone() -> bool | None:
            return True if await get_cd(api, namespace, "job") is None else None

        await eventually(cd_gone, "the deleted CD to be released", KUBE_WAIT_S)
        # Read right after the CR went: the labels were removed before the finalizer.
        assert await label_of(api, joiner) is None
        assert await label_of(api, stray) is None
        # The other domain's member is untouched.
        assert await label_of(api, neighbour) == other_uid
        labelled_now = await CoreV1Api(api).list_node(label_selector=f"{LABEL}={uid}")
        assert labelled_now.items == []

        await agents[neighbour].unprepare_all()
        await eventually(
            lambda: labelled(neighbour, None), "the other CD's label to go when its node leaves", KUBE_WAIT_S
        )
        for agent in agents.values():
            await agent.stop()


async def test_labeler_never_touches_a_label_of_a_domain_holding_the_node(
    api: ApiClient,  # noqa: F811
    nodes: list[str],
) -> None:
    held, stale, _ = nodes
    labeler = NodeLabeler(api)
    await set_label(api, held, "other-uid")
    await set_label(api, stale, "gone-uid")

    # `held` is a member of other-uid (still holds it); `stale` names a domain it is not in.
    in_domains = {held: {"mine", "other-uid"}, stale: {"mine"}}
    plan = await labeler.sync("mine", frozenset({held, stale}), lambda n: in_domains.get(n, set()))
    assert set(plan.label) == {held, stale}
    assert await label_of(api, held) == "other-uid"
    assert await label_of(api, stale) == "mine"

    # Unlabelling is conditional on the label naming the uid, even when the cache says it does.
    labeler.cache.record(held, "mine")
    await labeler.sync("mine", frozenset(), lambda n: set())
    assert await label_of(api, held) == "other-uid"
    assert await label_of(api, stale) is None
    await labeler.remove_all("other-uid")
    assert await label_of(api, held) is None

    # A node that does not exist: one 404, remembered; the next sync does not ask again.
    ghost = f"ghost-{uuid.uuid4().hex[:6]}"
    await labeler.sync("mine", frozenset({ghost}), lambda n: set())
    assert ghost in labeler.cache.absent
    assert not await labeler.sync("mine", frozenset({ghost}), lambda n: set())
