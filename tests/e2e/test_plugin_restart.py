"""Every kubelet plugin is deleted and started again (a DaemonSet rollout of cd-node-agent) while a
ComputeDomain is Ready with a running Job: the domain stays Ready throughout, and no IMEX daemon,
member or index changes, because the IMEX side (cd-imex-agent) holds the node records and the
daemons. The new plugins then serve kubelet: the Job's teardown goes through them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from services.imexagent.process import PID_FILE
from services.imexagent.settings import ImexSettings
from tests.e2e import kube
from tests.e2e.harness import E2EEnvironment, pid_alive
from tests.e2e.scenario import (
    apply_example_cd,
    delete_cd_and_wait_gone,
    delete_job_and_wait_released,
    wait_cd_ready,
    wait_job_running,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

# Formation's last hosts rewrite may still owe its daemon a SIGUSR1 (at most one per this
# interval), which re-dials every link of that daemon: a brief NotReady that has nothing to do
# with the plugins. The test starts once the domain has been Ready for longer than that.
SETTLE_S = ImexSettings().reload_min_interval_s + 1.0


@dataclass(frozen=True)
class NodeSide:
    """What a job on one member node depends on: its daemon and its place in the domain."""

    daemon_pid: int
    daemon_instance: str
    daemon_restarts: int
    pidfile: str
    member_index: int
    member_state: int


async def node_sides(env: E2EEnvironment, store: Store, cd_uid: str, nodes: list[str]) -> dict[str, NodeSide]:
    sides = {}
    for node in nodes:
        daemon = await store.get(store.keys.daemon(cd_uid, node), pb.DaemonStatus)
        member = await store.get(store.keys.member(cd_uid, node), pb.Member)
        assert daemon is not None and member is not None, f"{node}: no daemon or member record"
        pidfile = (env.layout.node(node).imex_dir / cd_uid / PID_FILE).read_text()
        sides[node] = NodeSide(
            daemon.value.pid,
            daemon.value.instance,
            daemon.value.restarts,
            pidfile,
            member.value.index,
            member.value.state,
        )
    return sides


async def settled_ready(api: ApiClient, namespace: str, name: str) -> dict[str, Any]:
    """The CD once it has stayed Ready, unchanged, for SETTLE_S (bounded by kube.WAIT_S)."""
    seen, since = "", time.monotonic()

    async def settled() -> dict[str, Any] | None:
        nonlocal seen, since
        cd = await kube.get_cd(api, namespace, name) or {}
        now, state = time.monotonic(), ready_since(cd)
        if state != seen:
            seen, since = state, now
            return None
        return cd if state.startswith("Ready True") and now - since >= SETTLE_S else None

    return await kube.eventually(
        settled, f"ComputeDomain {namespace}/{name} to settle Ready", explain=lambda: f"last seen: {seen}"
    )


def ready_since(cd: dict[str, Any]) -> str:
    """The CD's status and when its Ready condition last changed."""
    status = cd.get("status") or {}
    ready: dict[str, Any] = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})
    return f"{status.get('status')} {ready.get('status')} since {ready.get('lastTransitionTime')}"


async def test_deleting_every_kubelet_plugin_keeps_the_domain_ready_and_its_daemons(
    e2e_env: E2EEnvironment, api: ApiClient, e2e_store: Store, namespace: str
) -> None:
    cd_name, template, job = "imex-channel-injection", "imex-channel-0", "steady"
    await apply_example_cd(api, namespace, "imex-compute-domain.yaml", cd_name, template)
    await kube.create_job(api, kube.indexed_job(job, namespace, template, pods=4, size_hint=4))
    formed = await wait_job_running(e2e_env, api, namespace, job, 4, template)
    await wait_cd_ready(e2e_env, api, namespace, cd_name, formed.nodes)
    cd = await settled_ready(api, namespace, cd_name)
    before = await node_sides(e2e_env, e2e_store, formed.cd_uid, formed.nodes)
    assert all(pid_alive(side.daemon_pid) for side in before.values())
    imex_agents = dict(e2e_env.imex_agents)
    old_plugins = dict(e2e_env.agents)

    # What a user watching the domain sees while every plugin is replaced.
    seen: list[str] = []
    replaced = asyncio.Event()

    async def watch() -> None:
        while not replaced.is_set():
            current = await kube.get_cd(api, namespace, cd_name)
            seen.append(ready_since(current or {}))
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.to_thread(e2e_env.stop_plugins, e2e_env.node_names)
        assert not any(pid_alive(pid) for pid in old_plugins.values())
        await asyncio.to_thread(e2e_env.start_plugins, e2e_env.node_names)
    finally:
        replaced.set()
        await watcher
    assert set(e2e_env.agents.values()).isdisjoint(old_plugins.values())

    # Ready throughout, and never flipped in between polls (the transition time did not move).
    assert seen and set(seen) == {ready_since(cd)}, f"the domain left Ready: {sorted(set(seen))}"
    after = await node_sides(e2e_env, e2e_store, formed.cd_uid, formed.nodes)
    assert after == before, "a daemon, pidfile or member changed with the plugins"
    assert all(pid_alive(side.daemon_pid) for side in after.values())
    assert e2e_env.imex_agents == imex_agents and all(pid_alive(p) for p in imex_agents.values())
    running = [p for p in await kube.list_pods(api, namespace, f"e2e-job={job}") if kube.is_running(p)]
    assert sorted(p["metadata"]["name"] for p in running) == sorted(
        p["metadata"]["name"] for p in formed.pods
    )
    await wait_cd_ready(e2e_env, api, namespace, cd_name, formed.nodes)

    # The new plugins serve kubelet: they unprepare the Job's claims.
    await delete_job_and_wait_released(e2e_env, api, e2e_store, namespace, job, formed, cd_name)
    await delete_cd_and_wait_gone(e2e_env, api, e2e_store, namespace, cd_name, template, formed)
