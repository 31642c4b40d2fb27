"""cd-scheduler: the placement advisor inside a real kube-scheduler (integrations/scheduler-plugin).

On an environment of its own (two racks of four trays: two cliques of four nodes), a second
scheduler runs beside the environment's own, with the shipped configuration of
manifests/components/scheduler-plugin. A Job of three pods whose pods name its schedulerName:
- lands in one NVLink clique, on the nodes the advisor reserved for the whole gang at its first
  pod (one Place + Reserve per gang), and the domain forms; once all the gang's pods are bound the
  reservation is released (its TTL is 600 s here, so gone means released);
- with the advisor unreachable, stays whole and pending with a reason that names the advisor:
  no pod bound, no claim allocated, nothing reserved; when the advisor answers again, it lands;
- joined to a PodGroup (kube-scheduler's own gang scheduling, `GenericWorkload`), lands the same
  way: the two work together;
- with cd-scheduler restarted after the gang's first pod bound, the rest lands beside it, in its
  clique, and the earlier run's reservation does not stay held;
- with one pod of the gang held back (a scheduling gate), the others are scheduled on the
  reservation but none binds until the held one is scheduled too; then all bind together.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient, BatchV1Api, CoreV1Api, CustomObjectsApi

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from tests.e2e import kube
from tests.e2e.conftest import admin_api, fresh_namespace, newest_binaries, running, services_store
from tests.e2e.harness import E2EEnvironment
from tests.e2e.scenario import (
    apply_example_cd,
    delete_cd_and_wait_gone,
    delete_job_and_wait_released,
    wait_cd_ready,
    wait_job_running,
)
from tests.e2e.second_scheduler import SecondScheduler, grant_plugin_reads
from tools.controlplane import cluster
from tools.net_ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

WITH_ADVISOR = "computedomain-scheduler"
ADVISOR_DOWN = "computedomain-scheduler-advisor-down"
RESERVED = "ComputeDomain gang reserved by the placement advisor"
RELEASED = "ComputeDomain gang bound; reservation released"
ADOPTED = "ComputeDomain gang adopted: pods of it were bound before this scheduler started"
# How long a gang must stay wholly pending while the advisor is down.
DOWN_HOLD_S = 15.0
GANG = 3
# A scheduling gate that holds one pod of a gang back, and how long: shorter than the plugin's
# gangWaitTimeout (60 s), after which the whole gang would be rejected.
HOLD_GATE = "e2e.example.com/hold"
GATE_HOLD_S = 10.0
# The most seconds between the first and the last pod of a gang bound (PodScheduled turning
# True; the API keeps whole seconds).
BOUND_TOGETHER_S = 3


class Proxy:
    """The advisor's gRPC port forwarded from a port of our choosing: closed, the advisor is down."""

    def __init__(self, port: int, target: int) -> None:
        self.port, self.target = port, target
        self.server: asyncio.Server | None = None

    async def open(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


@pytest.fixture(scope="module")
def down_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def plugin_env() -> Iterator[E2EEnvironment]:
    """Two racks of four trays, with the environment's own scheduler (and extender) beside."""
    env = E2EEnvironment(newest_binaries(), racks=2, trays=4)
    with running(env):
        yield env


@pytest.fixture
async def api(plugin_env: E2EEnvironment) -> AsyncIterator[ApiClient]:
    async with admin_api(plugin_env) as client:
        yield client


@pytest.fixture
async def store(plugin_env: E2EEnvironment) -> AsyncIterator[Store]:
    async with services_store(plugin_env) as client:
        yield client


@pytest.fixture
async def namespace(api: ApiClient) -> AsyncIterator[str]:
    async with fresh_namespace(api, "plugin") as name:
        yield name


@pytest.fixture(scope="module")
def cd_scheduler(plugin_env: E2EEnvironment, down_port: int) -> Iterator[SecondScheduler]:
    grant_plugin_reads(plugin_env)
    scheduler = SecondScheduler(
        plugin_env,
        {
            WITH_ADVISOR: f"127.0.0.1:{plugin_env.ports['advisor_grpc']}",
            ADVISOR_DOWN: f"127.0.0.1:{down_port}",
        },
        # The gates of kube-scheduler's own gang scheduling, which the control plane turns on.
        extra_args=tuple(cluster.workload_scheduling_args(plugin_env.binaries.minor)[1]),
    )
    scheduler.start()
    try:
        yield scheduler
    finally:
        scheduler.stop()


@pytest.fixture
async def proxy(plugin_env: E2EEnvironment, down_port: int) -> AsyncIterator[Proxy]:
    forward = Proxy(down_port, plugin_env.ports["advisor_grpc"])
    try:
        yield forward
    finally:
        await forward.close()


def job_for(scheduler_name: str, name: str, namespace: str, template: str, pods: int) -> dict[str, Any]:
    job = kube.indexed_job(name, namespace, template, pods=pods, size_hint=pods)
    job["spec"]["template"]["spec"]["schedulerName"] = scheduler_name
    return job


async def reservations_of(store: Store, domain_uid: str) -> list[pb.Reservation]:
    items, _ = await store.list(store.keys.reservations(), pb.Reservation)
    return [i.value for i in items if i.value.domain_uid == domain_uid]


async def domain_uid_of(api: ApiClient, namespace: str, template: str) -> str:
    found = await kube.get_template(api, namespace, template)
    assert found is not None
    return str(found["metadata"]["labels"]["resource.nvidia.com/computeDomain"])


async def create_pod_group(api: ApiClient, namespace: str, name: str, min_count: int) -> None:
    body = {
        "apiVersion": "scheduling.k8s.io/v1beta1",
        "kind": "PodGroup",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"schedulingPolicy": {"gang": {"minCount": min_count}}},
    }
    await CustomObjectsApi(api).create_namespaced_custom_object(
        "scheduling.k8s.io", "v1beta1", namespace, "podgroups", body
    )


async def place_and_release(
    env: E2EEnvironment,
    scheduler: SecondScheduler,
    api: ApiClient,
    store: Store,
    namespace: str,
    pod_group: str | None,
) -> None:
    """A Job of GANG pods under cd-scheduler (in `pod_group` if given) lands on the nodes reserved at
    its first pod, in one clique; the reservation is released; the domain forms and goes."""
    cd_name, template, job = "plugin-placed", "plugin-channel", "plugin-job"
    await apply_example_cd(api, namespace, "imex-compute-domain.yaml", cd_name, template)
    uid = await domain_uid_of(api, namespace, template)
    manifest = job_for(WITH_ADVISOR, job, namespace, template, pods=GANG)
    if pod_group is not None:
        await create_pod_group(api, namespace, pod_group, GANG)
        manifest["spec"]["template"]["spec"]["schedulingGroup"] = {"podGroupName": pod_group}
    await kube.create_job(api, manifest)

    formed = await wait_job_running(env, api, namespace, job, GANG, template)  # one clique, own nodes
    for pod in formed.pods:
        assert pod["spec"]["schedulerName"] == WITH_ADVISOR
    if pod_group is not None:
        # The API kept the pods' group (it drops the field where the API is off), and kube-scheduler
        # scheduled them as one pod group.
        assert {(p["spec"].get("schedulingGroup") or {}).get("podGroupName") for p in formed.pods} == {
            pod_group
        }
        cycles = [
            r
            for r in scheduler.log_records("Successfully scheduled a pod group")
            if r.get("podGroup") == {"name": pod_group, "namespace": namespace}
        ]
        assert [r.get("scheduledPods") for r in cycles] == [GANG], cycles
    reserved = [r for r in scheduler.log_records(RESERVED) if r.get("cd_uid") == uid]
    assert len(reserved) == 1, f"the advisor was asked {len(reserved)} times for one gang: {reserved}"
    assert sorted(reserved[0]["nodes"]) == sorted(formed.nodes), (reserved[0], formed.nodes)
    clique = env.cluster.node(formed.nodes[0]).clique
    assert reserved[0]["clique"] == clique

    async def released() -> dict[str, Any] | None:
        done = [r for r in scheduler.log_records(RELEASED) if r.get("cd_uid") == uid]
        return done[0] if done and not await reservations_of(store, uid) else None

    record = await kube.eventually(released, f"the reservation of ComputeDomain {uid} released")
    assert record["reservation"] == reserved[0]["reservation"] and record["released"] is True

    await wait_cd_ready(env, api, namespace, cd_name, formed.nodes)
    await delete_job_and_wait_released(env, api, store, namespace, job, formed, cd_name)
    await delete_cd_and_wait_gone(env, api, store, namespace, cd_name, template, formed)


async def test_gang_lands_on_its_reservation_in_one_clique_and_the_reservation_is_released(
    plugin_env: E2EEnvironment, cd_scheduler: SecondScheduler, api: ApiClient, store: Store, namespace: str
) -> None:
    await place_and_release(plugin_env, cd_scheduler, api, store, namespace, pod_group=None)


async def test_beside_kube_schedulers_own_gang_scheduling_the_pod_group_lands_the_same_way(
    plugin_env: E2EEnvironment, cd_scheduler: SecondScheduler, api: ApiClient, store: Store, namespace: str
) -> None:
    await place_and_release(plugin_env, cd_scheduler, api, store, namespace, pod_group="gang")


async def test_advisor_down_leaves_the_gang_whole_and_pending_with_a_reason_then_it_lands(
    plugin_env: E2EEnvironment,
    cd_scheduler: SecondScheduler,
    proxy: Proxy,
    down_port: int,
    api: ApiClient,
    store: Store,
    namespace: str,
) -> None:
    cd_name, template, job = "advisor-down", "advisor-down-channel", "waits"
    await apply_example_cd(api, namespace, "imex-compute-domain.yaml", cd_name, template)
    uid = await domain_uid_of(api, namespace, template)
    await kube.create_job(api, job_for(ADVISOR_DOWN, job, namespace, template, pods=GANG))
    address = f"127.0.0.1:{down_port}"

    def reason(pod: dict[str, Any]) -> dict[str, Any] | None:
        conditions = (pod.get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "PodScheduled"), None)

    async def all_refused() -> list[dict[str, Any]] | None:
        pods = await kube.list_pods(api, namespace, f"e2e-job={job}")
        refused = [p for p in pods if (reason(p) or {}).get("status") == "False"]
        return pods if len(pods) == GANG and len(refused) == GANG else None

    pods = await kube.eventually(
        all_refused, f"{GANG} pods refused by cd-scheduler while the advisor is down"
    )
    for pod in pods:
        condition = reason(pod)
        assert condition is not None
        message = condition["message"]
        assert "placement advisor" in message and address in message, message
        assert f"ComputeDomain {uid} waits for the placement advisor" in message, message

    loop = asyncio.get_running_loop()
    hold_until = loop.time() + DOWN_HOLD_S
    while loop.time() < hold_until:
        pods = await kube.list_pods(api, namespace, f"e2e-job={job}")
        assert [p["metadata"]["name"] for p in pods if p["spec"].get("nodeName")] == []
        claims = await kube.list_claims(api, namespace)
        assert [c["metadata"]["name"] for c in claims if (c.get("status") or {}).get("allocation")] == []
        assert await reservations_of(store, uid) == []
        await asyncio.sleep(1.0)

    await proxy.open()  # the advisor answers again
    formed = await wait_job_running(plugin_env, api, namespace, job, GANG, template)
    await wait_cd_ready(plugin_env, api, namespace, cd_name, formed.nodes)
    await delete_job_and_wait_released(plugin_env, api, store, namespace, job, formed, cd_name)
    await delete_cd_and_wait_gone(plugin_env, api, store, namespace, cd_name, template, formed)


async def test_a_restart_in_the_middle_of_a_gang_finishes_it_beside_its_bound_pods(
    plugin_env: E2EEnvironment, cd_scheduler: SecondScheduler, api: ApiClient, store: Store, namespace: str
) -> None:
    """The gang's first pod binds on the whole gang's reservation; cd-scheduler restarts (its
    table of gangs is gone); then the rest of the gang arrives. It lands beside the first pod,
    in its clique, on other nodes; the earlier run's reservation is released rather than left
    to make the reserved nodes look taken; nothing stays reserved once the gang is bound."""
    cd_name, template, job = "restarted", "restarted-channel", "restarted-job"
    await apply_example_cd(api, namespace, "imex-compute-domain.yaml", cd_name, template)
    uid = await domain_uid_of(api, namespace, template)
    manifest = job_for(WITH_ADVISOR, job, namespace, template, pods=GANG)
    manifest["spec"]["parallelism"] = 1  # the first pod now, the rest after the restart
    await kube.create_job(api, manifest)

    async def first_bound() -> dict[str, Any] | None:
        bound = [
            p for p in await kube.list_pods(api, namespace, f"e2e-job={job}") if p["spec"].get("nodeName")
        ]
        return bound[0] if bound else None

    first = await kube.eventually(first_bound, "the gang's first pod bound")
    assert [r for r in cd_scheduler.log_records(RESERVED) if r.get("cd_uid") == uid], "no reservation"
    cd_scheduler.stop()
    cd_scheduler.start()
    await BatchV1Api(api).patch_namespaced_job(job, namespace, {"spec": {"parallelism": GANG}})

    formed = await wait_job_running(plugin_env, api, namespace, job, GANG, template)  # one clique
    assert first["spec"]["nodeName"] in formed.nodes

    async def nothing_reserved() -> bool | None:
        return True if not await reservations_of(store, uid) else None

    # A reservation of nodes the gang did not take would hold them until its TTL (600 s here).
    await kube.eventually(nothing_reserved, f"no reservation left for ComputeDomain {uid}", timeout_s=60)
    adopted = [r for r in cd_scheduler.log_records(ADOPTED) if r.get("cd_uid") == uid]
    assert [r["boundNodes"] for r in adopted] == [[first["spec"]["nodeName"]]], adopted
    await wait_cd_ready(plugin_env, api, namespace, cd_name, formed.nodes)
    await delete_job_and_wait_released(plugin_env, api, store, namespace, job, formed, cd_name)
    await delete_cd_and_wait_gone(plugin_env, api, store, namespace, cd_name, template, formed)


async def ungate(api: ApiClient, namespace: str, pod: str) -> None:
    await CoreV1Api(api).patch_namespaced_pod(
        pod, namespace, [{"op": "remove", "path": "/spec/schedulingGates"}]
    )


def scheduled_at(pod: dict[str, Any]) -> datetime:
    conditions = (pod.get("status") or {}).get("conditions") or []
    found = next(c for c in conditions if c["type"] == "PodScheduled" and c["status"] == "True")
    return datetime.fromisoformat(found["lastTransitionTime"].replace("Z", "+00:00"))


async def test_no_pod_of_a_gang_binds_until_the_whole_gang_is_scheduled(
    plugin_env: E2EEnvironment, cd_scheduler: SecondScheduler, api: ApiClient, store: Store, namespace: str
) -> None:
    """Two of the gang's three pods are let through to cd-scheduler, the third held back by a
    scheduling gate: the two are placed on the gang's reservation but none is bound (no part of
    a gang holds nodes while the rest waits). Once the third is let through, all three bind
    together on the reserved nodes, and the reservation is released."""
    cd_name, template, job = "whole-gang", "whole-gang-channel", "whole-gang-job"
    await apply_example_cd(api, namespace, "imex-compute-domain.yaml", cd_name, template)
    uid = await domain_uid_of(api, namespace, template)
    manifest = job_for(WITH_ADVISOR, job, namespace, template, pods=GANG)
    manifest["spec"]["template"]["spec"]["schedulingGates"] = [{"name": HOLD_GATE}]
    await kube.create_job(api, manifest)

    async def created() -> list[str] | None:
        names = sorted(p["metadata"]["name"] for p in await kube.list_pods(api, namespace, f"e2e-job={job}"))
        return names if len(names) == GANG else None

    held, *let_through = await kube.eventually(created, f"{GANG} pods of Job {namespace}/{job}")
    for name in let_through:
        await ungate(api, namespace, name)

    async def reserved() -> list[dict[str, Any]] | None:
        found = [r for r in cd_scheduler.log_records(RESERVED) if r.get("cd_uid") == uid]
        return found or None

    reservation = (await kube.eventually(reserved, f"a reservation for ComputeDomain {uid}"))[0]
    loop = asyncio.get_running_loop()
    hold_until = loop.time() + GATE_HOLD_S
    while loop.time() < hold_until:
        pods = await kube.list_pods(api, namespace, f"e2e-job={job}")
        bound = [p["metadata"]["name"] for p in pods if p["spec"].get("nodeName")]
        assert bound == [], f"pods {bound} bound while {held} of their gang is held back"
        await asyncio.sleep(1.0)

    await ungate(api, namespace, held)
    formed = await wait_job_running(plugin_env, api, namespace, job, GANG, template)
    assert sorted(formed.nodes) == sorted(reservation["nodes"]), (reservation, formed.nodes)
    times = sorted(scheduled_at(p) for p in formed.pods)
    assert (times[-1] - times[0]).total_seconds() <= BOUND_TOGETHER_S, times
    assert [r for r in cd_scheduler.log_records(RESERVED) if r.get("cd_uid") == uid] == [reservation]

    async def released() -> bool | None:
        done = [r for r in cd_scheduler.log_records(RELEASED) if r.get("cd_uid") == uid]
        return True if done and not await reservations_of(store, uid) else None

    await kube.eventually(released, f"the reservation of ComputeDomain {uid} released")
    await delete_job_and_wait_released(plugin_env, api, store, namespace, job, formed, cd_name)
    await delete_cd_and_wait_gone(plugin_env, api, store, namespace, cd_name, template, formed)
