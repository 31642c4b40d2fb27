"""The controller's Kubernetes adapter against a real kube-apiserver (tools.controlplane).

An in-process controller (view, election, reconciler and adapter) runs over a
real etcd and the loopback control plane with our CRD; node agents are
played in the store by `AgentDouble`. Checked: a CR is mirrored into the store
and gets its finalizer and its workload ResourceClaimTemplate of exactly the
upstream shape; the store's status is written back through the status
subresource with Events on transitions; deleting the CR is held by the
finalizer until the domain's teardown ends, then RCT and CR go.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import structlog.testing
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client import ApiClient, CoreV1Api, CustomObjectsApi, ResourceV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from libs.gen.computedomain.state import v1 as pb
from libs.invariants.checker import check_domain_gone
from libs.runtime.cancellation import cancel_until_done
from libs.state.config import EtcdConfig
from libs.state.election import LeaderElection, Leadership
from libs.state.store import Store
from services.controller.kube import adapter as adapter_module
from services.controller.kube.adapter import KubeAdapter
from services.controller.kube.resourceclaimtemplate import build_rct
from services.controller.metrics import ControllerMetrics
from services.controller.reconciler import DomainReconciler
from tests.controller.harness import AgentDouble
from tests.k8s.conftest import control_plane, control_plane_binaries  # noqa: F401 - session fixtures of tests/k8s
from tests.polling import eventually
from tools.controlplane.cluster import ControlPlane

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "manifests" / "base" / "crd-computedomains.yaml"
GROUP, VERSION, PLURAL = "resource.nvidia.com", "v1beta1", "computedomains"
LABEL = "resource.nvidia.com/computeDomain"
CLIQUE = "c0ffee00-0000-4000-8000-00000000000a.1"
T = TypeVar("T")


@pytest.fixture(scope="module")
def crd_installed(control_plane: ControlPlane) -> ControlPlane:  # noqa: F811
    control_plane.kubectl("apply", "-f", str(CRD))
    control_plane.kubectl("wait", "--for=condition=Established", f"crd/{PLURAL}.{GROUP}", "--timeout=60s")
    return control_plane


@pytest.fixture
async def api(crd_installed: ControlPlane) -> AsyncIterator[ApiClient]:
    client = await k8s_config.new_client_from_config(config_file=str(crd_installed.kubeconfig))
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def namespace(api: ApiClient) -> AsyncIterator[str]:
    name = f"cd-{uuid.uuid4().hex[:8]}"
    await CoreV1Api(api).create_namespace({"metadata": {"name": name}})  # type: ignore[arg-type]
    yield name
    # CRs a test leaves behind keep our finalizer (their controller is gone): release them, so the
    # next test's controller does not adopt them from a namespace being deleted.
    custom, resource = CustomObjectsApi(api), ResourceV1Api(api)
    no_finalizers = [{"op": "add", "path": "/metadata/finalizers", "value": []}]
    listing = await custom.list_namespaced_custom_object(GROUP, VERSION, name, PLURAL)
    for cd in listing.get("items", []):
        cd_name = cd["metadata"]["name"]
        with contextlib.suppress(ApiException):
            await custom.delete_namespaced_custom_object(GROUP, VERSION, name, PLURAL, cd_name)
            await custom.patch_namespaced_custom_object(GROUP, VERSION, name, PLURAL, cd_name, no_finalizers)
    for rct in (await resource.list_namespaced_resource_claim_template(name)).items:
        with contextlib.suppress(ApiException):
            await resource.patch_namespaced_resource_claim_template(rct.metadata.name, name, no_finalizers)
    with contextlib.suppress(ApiException):
        await CoreV1Api(api).delete_namespace(name)


@contextlib.asynccontextmanager
async def kube_controller(etcd_config: EtcdConfig, kubeconfig: Path) -> AsyncIterator[KubeAdapter]:
    """One controller replica in Kubernetes mode, in this process."""
    store = Store(etcd_config)
    await store.connect()
    reconciler = DomainReconciler(store, ControllerMetrics())
    adapter = KubeAdapter(
        store,
        reconciler,
        await k8s_config.new_client_from_config(config_file=str(kubeconfig)),
        sweep_interval_s=3600,
        instance="test",
    )

    async def lead(leadership: Leadership) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(reconciler.lead(leadership))
            tg.create_task(adapter.run(leadership))

    election = LeaderElection(store, "cd-controller", "kube-test", ttl_s=2)
    tasks = [asyncio.create_task(reconciler.watch()), asyncio.create_task(election.run(lead))]
    try:
        await eventually(lambda: _true_if(adapter.listed.is_set()), "the adapter to list ComputeDomains", 20)
        yield adapter
    finally:
        stuck = await cancel_until_done(tasks, 10)
        assert not stuck, f"controller tasks did not stop: {stuck}"
        await asyncio.wait_for(store.close(), 10)


async def _true_if(value: bool) -> bool | None:
    return True if value else None


def cd_body(namespace: str, name: str, rct: str, num_nodes: int = 0, mode: str = "Single") -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ComputeDomain",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "numNodes": num_nodes,
            "channel": {"resourceClaimTemplate": {"name": rct}, "allocationMode": mode},
        },
    }


def contains(actual: Any, expected: Any) -> bool:
    """`expected` is a sub-document of `actual` (dicts may have more keys; lists match item by item)."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(
            k in actual and contains(actual[k], v) for k, v in expected.items()
        )
    if isinstance(expected, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(expected)
            and all(contains(a, e) for a, e in zip(actual, expected, strict=True))
        )
    return bool(actual == expected)


async def get_cd(api: ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return await CustomObjectsApi(api).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


async def get_rct(api: ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        obj = await ResourceV1Api(api).read_namespaced_resource_claim_template(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return api.sanitize_for_serialization(obj)


# The API server and the informer add seconds to what the store alone takes.
KUBE_WAIT_S = 20.0


async def test_cr_gets_finalizer_store_record_and_exact_rct(
    api: ApiClient, namespace: str, store: Store, etcd_config: EtcdConfig, crd_installed: ControlPlane
) -> None:
    async with kube_controller(etcd_config, crd_installed.kubeconfig):
        created = await CustomObjectsApi(api).create_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            cd_body(namespace, "job", "job-channel", num_nodes=2, mode="All"),
        )
        uid = created["metadata"]["uid"]

        async def rct() -> dict[str, Any] | None:
            return await get_rct(api, namespace, "job-channel")

        template = await eventually(rct, "the workload ResourceClaimTemplate", KUBE_WAIT_S)
        expected = build_rct(uid, namespace, "job-channel", "All")
        # The target label is what NVIDIA's controller selects its workload templates by (rollback).
        assert template["metadata"]["labels"] == {
            LABEL: uid,
            "resource.nvidia.com/computeDomainTarget": "Workload",
        }
        assert template["metadata"]["finalizers"] == [LABEL]
        # What we sent is there unchanged (the API server only adds its defaults around it).
        assert contains(template["spec"], expected["spec"]), template["spec"]
        request = template["spec"]["spec"]["devices"]["requests"]
        assert [(r["name"], r["exactly"]["deviceClassName"]) for r in request] == [
            ("channel", "compute-domain-default-channel.nvidia.com")
        ]
        assert template["spec"]["spec"]["devices"]["config"] == expected["spec"]["spec"]["devices"]["config"]
        params = template["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]
        assert params == {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomainChannelConfig",
            "domainID": uid,
            "allocationMode": "All",
        }

        async def mirrored() -> pb.ComputeDomain | None:
            got = await store.get(store.keys.domain(uid), pb.ComputeDomain)
            return got.value if got else None

        domain = await eventually(mirrored, "the store record of the CR", KUBE_WAIT_S)
        assert (domain.namespace, domain.name, domain.source) == (namespace, "job", "kubernetes")
        assert domain.spec.num_nodes == 2 and domain.spec.channel.allocation_mode == pb.AllocationMode.ALL
        assert domain.spec.channel.resource_claim_template_name == "job-channel"

        async def finalized() -> dict[str, Any] | None:
            cd = await get_cd(api, namespace, "job")
            return cd if cd and LABEL in (cd["metadata"].get("finalizers") or []) else None

        await eventually(finalized, "our finalizer on the CR", KUBE_WAIT_S)


async def test_status_is_written_back_with_events(
    api: ApiClient, namespace: str, store: Store, etcd_config: EtcdConfig, crd_installed: ControlPlane
) -> None:
    async with kube_controller(etcd_config, crd_installed.kubeconfig):
        created = await CustomObjectsApi(api).create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, cd_body(namespace, "pair", "pair-channel", num_nodes=2)
        )
        uid = created["metadata"]["uid"]

        async def status_is(value: str, reason: str) -> dict[str, Any] | None:
            cd = await get_cd(api, namespace, "pair")
            status = (cd or {}).get("status") or {}
            conditions = status.get("conditions") or []
            if status.get("status") == value and conditions and conditions[0]["reason"] == reason:
                return status
            return None

        await eventually(
            lambda: status_is("NotReady", "WaitingForNodes"), "WaitingForNodes on the CR", KUBE_WAIT_S
        )
        agents = [AgentDouble(store, f"kn{i}", CLIQUE, f"127.0.20.{i}", ttl_s=5) for i in (1, 2)]
        for a in agents:
            await a.start()
        await eventually(lambda: _domain_in_store(store, uid), "the store record", KUBE_WAIT_S)
        for a in agents:
            await a.prepare(uid, namespace)
        for a in agents:
            await a.report_daemon(uid, pb.DaemonState.READY)
        status = await eventually(lambda: status_is("Ready", "AllNodesReady"), "Ready on the CR", KUBE_WAIT_S)
        assert status["nodeCount"] == 2
        assert [
            (n["name"], n["cliqueID"], n["index"], n["status"], n["ipAddress"]) for n in status["nodes"]
        ] == [
            ("kn1", CLIQUE, 0, "Ready", "127.0.20.1"),
            ("kn2", CLIQUE, 1, "Ready", "127.0.20.2"),
        ]
        assert status["conditions"][0]["type"] == "Ready" and status["conditions"][0]["status"] == "True"

        async def ready_event() -> list[Any] | None:
            events = await CoreV1Api(api).list_namespaced_event(namespace)
            mine = [e for e in events.items if e.involved_object.uid == uid and e.reason == "Ready"]
            return mine or None

        events = await eventually(ready_event, "a Ready event on the CR", KUBE_WAIT_S)
        assert events[0].type == "Normal" and events[0].involved_object.kind == "ComputeDomain"
        for a in agents:
            await a.unprepare_all()
            await a.stop()


async def test_node_list_rewrites_are_paced_and_the_last_one_still_lands(
    api: ApiClient,
    namespace: str,
    store: Store,
    etcd_config: EtcdConfig,
    crd_installed: ControlPlane,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Members joining every 0.3 s change the CR's node list each time. Unpaced, each change is a
    status write through the API server; paced (as shipped), at most one a second, and the list
    still ends complete."""
    writes: dict[float, int] = {}
    spans: dict[float, float] = {}  # first join to the complete list, seconds (longer when loaded)
    async with kube_controller(etcd_config, crd_installed.kubeconfig):
        for interval_s in (0.0, adapter_module.STATUS_MIN_INTERVAL_S):
            monkeypatch.setattr(adapter_module, "STATUS_MIN_INTERVAL_S", interval_s)
            name = f"paced-{int(interval_s * 10)}"
            created = await CustomObjectsApi(api).create_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, cd_body(namespace, name, f"{name}-channel", num_nodes=8)
            )
            uid = created["metadata"]["uid"]

            async def node_count(name: str = name) -> int | None:
                cd = await get_cd(api, namespace, name)
                status = (cd or {}).get("status")
                return len(status.get("nodes") or []) if status else None

            await eventually(node_count, "the first status", KUBE_WAIT_S)
            await eventually(functools.partial(_domain_in_store, store, uid), "the store record", KUBE_WAIT_S)
            octet = 30 + int(interval_s * 10)
            agents = [
                AgentDouble(store, f"kp{octet}-{i}", CLIQUE, f"127.0.{octet}.{i + 1}") for i in range(8)
            ]
            started = time.monotonic()
            with structlog.testing.capture_logs() as logs:
                for a in agents:
                    await a.start()
                    await a.prepare(uid, namespace)
                    await asyncio.sleep(0.3)
                await eventually(lambda: _eight(node_count), "all 8 nodes on the CR", KUBE_WAIT_S)
            spans[interval_s] = time.monotonic() - started
            writes[interval_s] = sum(
                1 for e in logs if e["event"] == "computedomain status written" and e.get("cd_uid") == uid
            )
            for a in agents:
                await a.unprepare_all()
                await a.stop()
    unpaced, paced = writes[0.0], writes[adapter_module.STATUS_MIN_INTERVAL_S]
    assert unpaced >= 6, (
        f"the control wrote only {unpaced} times: the joins did not change the list one by one"
    )
    # Paced, a write opens each interval and the last one lands: at most one per started second
    # of the span, plus that last one.
    span = spans[adapter_module.STATUS_MIN_INTERVAL_S]
    bound = math.floor(span / adapter_module.STATUS_MIN_INTERVAL_S) + 2
    assert paced <= bound, f"{paced} status writes for 8 joins over {span:.1f} s, paced at one a second"


async def _eight(count: Callable[[], Awaitable[int | None]]) -> bool | None:
    return True if await count() == 8 else None


async def test_deletion_is_held_until_teardown_ends(
    api: ApiClient, namespace: str, store: Store, etcd_config: EtcdConfig, crd_installed: ControlPlane
) -> None:
    async with kube_controller(etcd_config, crd_installed.kubeconfig):
        created = await CustomObjectsApi(api).create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, cd_body(namespace, "busy", "busy-channel")
        )
        uid = created["metadata"]["uid"]
        await eventually(lambda: get_rct(api, namespace, "busy-channel"), "the RCT", KUBE_WAIT_S)
        await eventually(lambda: _domain_in_store(store, uid), "the store record", KUBE_WAIT_S)
        agent = AgentDouble(store, "kd1", CLIQUE, "127.0.21.1", ttl_s=5)
        await agent.start()
        await agent.prepare(uid, namespace)  # a pod still holds a claim of the domain

        async def has_finalizer() -> bool | None:
            cd = await get_cd(api, namespace, "busy")
            return True if cd and LABEL in (cd["metadata"].get("finalizers") or []) else None

        await eventually(has_finalizer, "the finalizer", KUBE_WAIT_S)
        await CustomObjectsApi(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "busy")

        async def terminating() -> dict[str, Any] | None:
            cd = await get_cd(api, namespace, "busy")
            conditions = ((cd or {}).get("status") or {}).get("conditions") or []
            return cd if conditions and conditions[0]["reason"] == "Terminating" else None

        cd = await eventually(terminating, "the CR to show Terminating", KUBE_WAIT_S)
        assert cd["metadata"].get("deletionTimestamp")
        await asyncio.sleep(1.0)
        assert await get_cd(api, namespace, "busy") is not None, (
            "the CR went while a member was in the domain"
        )
        assert await get_rct(api, namespace, "busy-channel") is not None

        await agent.unprepare_all()  # the pod is gone: the node leaves the domain

        async def released() -> bool | None:
            gone = (
                await get_cd(api, namespace, "busy") is None
                and await get_rct(api, namespace, "busy-channel") is None
            )
            return True if gone else None

        await eventually(released, "the CR and its RCT to go after teardown", KUBE_WAIT_S)
        assert await check_domain_gone(store, uid) == []
        await agent.stop()


async def _domain_in_store(store: Store, uid: str) -> bool | None:
    return True if await store.get(store.keys.domain(uid), pb.ComputeDomain) is not None else None


async def test_informer_lists_again_when_its_resource_version_is_gone(
    api: ApiClient, namespace: str, store: Store, etcd_config: EtcdConfig, crd_installed: ControlPlane
) -> None:
    adapter = KubeAdapter(
        store,
        DomainReconciler(store, ControllerMetrics()),
        await k8s_config.new_client_from_config(config_file=str(crd_installed.kubeconfig)),
        instance="test",
    )

    async def listed() -> bool | None:
        try:
            await adapter._list()
        except ApiException as exc:  # 429 while a freshly installed CRD's storage initialises
            if exc.status != 429:
                raise
            return None
        return True

    await eventually(listed, "a first list of ComputeDomains", KUBE_WAIT_S)
    created = await CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, cd_body(namespace, "late", "late-channel")
    )
    # A resume point the API server no longer has (compacted away): the watch answers 410 Gone,
    # and the informer lists again, which brings the CR created meanwhile.
    adapter.resource_version = "1"
    informer = asyncio.create_task(adapter._informer())
    try:

        async def relisted() -> bool | None:
            return True if adapter.relists >= 2 and created["metadata"]["uid"] in adapter.crs else None

        await eventually(relisted, "the informer to list again after 410 Gone", KUBE_WAIT_S)
    finally:
        await cancel_until_done([informer])
        await adapter.api.close()
