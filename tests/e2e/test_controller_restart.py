"""The controller is SIGKILLed while a domain forms and started again: the run still converges."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from tests.e2e import kube
from tests.e2e.harness import E2EEnvironment, iter_lines, pid_alive
from tests.e2e.scenario import (
    apply_example_cd,
    delete_cd_and_wait_gone,
    delete_job_and_wait_released,
    kubectl_get_computedomains,
    wait_cd_ready,
    wait_job_running,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


async def test_controller_killed_mid_formation_then_restarted_converges(
    e2e_env: E2EEnvironment, api: ApiClient, e2e_store: Store, namespace: str
) -> None:
    cd_name, template, job = (
        "nvbandwidth-test-compute-domain",
        "nvbandwidth-test-compute-domain-channel",
        "mpi",
    )
    await apply_example_cd(api, namespace, "nvbandwidth-test-compute-domain.yaml", cd_name, template)
    await kube.create_job(api, kube.indexed_job(job, namespace, template, pods=4))

    # Kill as soon as the first node has joined the domain: formation is under way, the
    # controller has not reported it yet.
    cd = await kube.get_cd(api, namespace, cd_name)
    assert cd is not None
    cd_uid = cd["metadata"]["uid"]

    async def joined() -> list[Any] | None:
        return (await e2e_store.list(e2e_store.keys.members(cd_uid), pb.Member))[0] or None

    members = await kube.eventually(joined, "a node to join the domain", explain=e2e_env.explain)
    killed = e2e_env.controller_pid
    e2e_env.kill_controller()
    assert not pid_alive(killed)
    assert 1 <= len(members) <= 4
    at_kill = await kube.get_cd(api, namespace, cd_name)
    assert at_kill is not None
    ready_at_kill = (at_kill.get("status") or {}).get("status") == "Ready"
    # Formation goes on without the controller (agents join through the store); let it get ahead.
    await asyncio.sleep(1.0)
    e2e_env.start_controller()
    assert e2e_env.controller_pid != killed

    formed = await wait_job_running(e2e_env, api, namespace, job, 4, template)
    await wait_cd_ready(e2e_env, api, namespace, cd_name, formed.nodes)
    rows = kubectl_get_computedomains(e2e_env, namespace)
    assert (rows[cd_name]["STATUS"], rows[cd_name]["NODES"]) == ("Ready", "4")
    if not ready_at_kill:
        # The Ready the user sees was written by the restarted controller.
        restarted = f"controller-{e2e_env.controller_starts}"
        lines = list(iter_lines(e2e_env.log("controller")))
        start = max(i for i, line in enumerate(lines) if line.get("identity") == restarted)
        assert any(
            line.get("event") == "computedomain status written"
            and line.get("cd_uid") == cd_uid
            and line.get("status") == "Ready"
            for line in lines[start:]
        ), f"the restarted controller did not report the domain Ready\n{e2e_env.explain('controller')}"

    await delete_job_and_wait_released(e2e_env, api, e2e_store, namespace, job, formed, cd_name)
    await delete_cd_and_wait_gone(e2e_env, api, e2e_store, namespace, cd_name, template, formed)
