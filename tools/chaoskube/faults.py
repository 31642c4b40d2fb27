"""The faults of the Kubernetes-mode soak, done to a running `tests.e2e.harness.E2EEnvironment`
with real kubelets: each returns once the fault is over and what it hit is back (a node lost is
the exception: `lose_node` and `restore_node` are its two halves, the soak waits in between).

- kubelet restart: SIGTERM or SIGKILL, then started again, until its /healthz answers;
- cd-node-agent kill: SIGKILL the node's kubelet plugin, then started again (kubelet registers
  it anew);
- controller failover: SIGKILL the replica that leads; a standby takes over; a new standby is
  started in place of the killed one;
- kube-apiserver restart: SIGTERM, down a while, started again on the same address;
- node lost: kubelet, plugin and IMEX agent (with its daemons) die; once the Node is NotReady the
  operator declares it gone with the out-of-service taint (Kubernetes' non-graceful node
  shutdown), so its pods are deleted and the Jobs replace them; later the tray comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from tests.e2e import kube
from tests.e2e.harness import CONTROLLER_TARGET, E2EEnvironment, terminate
from tools.launch import pid_alive
from tools.net_ports import free_port
from tools.sim.faults import CONTROLLER_ELECTION

OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"
KUBELET_HEALTHY_TIMEOUT_S = 60.0
FAILOVER_TIMEOUT_S = 30.0
KUBECTL_TRIES = 15
_POLL_S = 0.1


class FaultFailed(RuntimeError):
    """The fault could not be done or undone; the message says what (a finding of the soak)."""


async def _until(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until the sync `check()` is true (in a thread), or FaultFailed naming `what`."""
    began = time.monotonic()
    while True:
        if await asyncio.to_thread(check):
            return time.monotonic() - began
        if time.monotonic() - began > timeout_s:
            raise FaultFailed(f"{what} not within {timeout_s:.0f}s")
        await asyncio.sleep(_POLL_S)


async def restart_kubelet(env: E2EEnvironment, node: str, kill: bool) -> str:
    kubelet = env.kubelet_nodes[node]
    await asyncio.to_thread(kubelet.stop_kubelet, kill)
    await asyncio.to_thread(kubelet.start_kubelet)
    took = await _until(
        kubelet.kubelet_healthy, KUBELET_HEALTHY_TIMEOUT_S, f"kubelet of {node} healthy again"
    )
    return f"kubelet of {node} {'SIGKILLed' if kill else 'stopped'} and started, healthy after {took:.1f}s"


async def kill_agent(env: E2EEnvironment, node: str) -> str:
    pid = env.agents[node]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    await _until(lambda: not pid_alive(pid), 10.0, f"killed cd-node-agent of {node} gone")
    await asyncio.to_thread(env.start_plugins, [node])
    return f"cd-node-agent of {node} (pid {pid}) SIGKILLed and started again"


async def restart_apiserver(env: E2EEnvironment, down_s: float) -> str:
    began = time.monotonic()
    await asyncio.to_thread(env.cp.restart_apiserver, down_s)
    return f"kube-apiserver down {down_s:.1f}s, ready again after {time.monotonic() - began:.1f}s"


@dataclass
class ControllerReplicas:
    """The controller's replicas: the environment's own and the standbys the soak starts."""

    env: E2EEnvironment
    pids: dict[str, int] = field(default_factory=dict)  # identity -> pid
    started: int = 0

    def __post_init__(self) -> None:
        self.pids[f"controller-{self.env.controller_starts}"] = self.env.controller_pid

    def start_standby(self) -> str:
        assert self.env.forks is not None
        self.started += 1
        identity = f"controller-standby-{self.started}"
        argv = self.env.controller_argv(identity, free_port())
        self.pids[identity] = self.env.forks.spawn(identity, CONTROLLER_TARGET, argv, self.env.log(identity))
        return identity

    def dead(self) -> list[str]:
        return sorted(i for i, pid in self.pids.items() if not pid_alive(pid))

    def stop_standbys(self) -> None:
        """End the replicas the soak started (the environment stops its own)."""
        for pid in self.pids.values():
            if pid != self.env.controller_pid:
                terminate(pid)


async def leader(store: Store) -> pb.LeaderRecord | None:
    found = await store.get(store.keys.election(CONTROLLER_ELECTION), pb.LeaderRecord)
    return found.value if found is not None else None


async def controller_failover(replicas: ControllerReplicas, store: Store) -> tuple[str, float]:
    """SIGKILL the leading replica; (what happened, seconds until another replica led)."""
    old = await leader(store)
    if old is None or old.holder not in replicas.pids:
        raise FaultFailed(f"no known controller replica leads (leader record: {old})")
    pid = replicas.pids.pop(old.holder)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while time.monotonic() - killed_at < FAILOVER_TIMEOUT_S:
        now = await leader(store)
        if now is not None and now.holder and now.holder != old.holder:
            took = time.monotonic() - killed_at
            standby = await asyncio.to_thread(replicas.start_standby)
            return (
                f"leader {old.holder} (pid {pid}) SIGKILLed; {now.holder} led after {took:.2f}s; {standby} started",
                took,
            )
        await asyncio.sleep(0.05)
    raise FaultFailed(
        f"no controller replica took the lead within {FAILOVER_TIMEOUT_S:.0f}s of killing {old.holder}"
    )


async def node_ready(api: ApiClient, node: str) -> str | None:
    """The Node's Ready condition status ("True", "False", "Unknown"; "" if not found; None when
    the API server does not answer, as while it restarts)."""
    try:
        found = await kube.raw_get(api, f"/api/v1/nodes/{node}")
    except (ApiException, aiohttp.ClientError, OSError, TimeoutError):
        return None
    conditions = ((found or {}).get("status") or {}).get("conditions") or []
    return str(next((c["status"] for c in conditions if c["type"] == "Ready"), ""))


async def _kubectl(env: E2EEnvironment, *args: str) -> None:
    """kubectl, again while the API server does not answer (up to KUBECTL_TRIES times)."""
    for attempt in range(KUBECTL_TRIES):
        done = await asyncio.to_thread(env.cp.kubectl, *args, check=False)
        if done.returncode == 0:
            return
        if attempt == KUBECTL_TRIES - 1:
            raise FaultFailed(f"kubectl {' '.join(args)} failed: {done.stderr.strip()}")
        await asyncio.sleep(2.0)


async def lose_node(env: E2EEnvironment, api: ApiClient, node: str, timeout_s: float) -> str:
    """The tray dies; once Kubernetes sees its Node NotReady it is declared out of service."""
    await asyncio.to_thread(env.lose_node, node)
    began = time.monotonic()
    while await node_ready(api, node) in ("True", None):
        if time.monotonic() - began > timeout_s:
            raise FaultFailed(f"lost node {node} still Ready after {timeout_s:.0f}s")
        await asyncio.sleep(0.5)
    await _kubectl(env, "taint", "nodes", node, f"{OUT_OF_SERVICE_TAINT}=nodeshutdown:NoExecute")
    return f"{node} lost; NotReady after {time.monotonic() - began:.1f}s, tainted out-of-service"


async def restore_node(env: E2EEnvironment, api: ApiClient, node: str, timeout_s: float) -> str:
    """The tray comes back: kubelet, IMEX agent and plugin start, the taint goes, Ready again."""
    await asyncio.to_thread(env.restore_node, node)
    await _kubectl(env, "taint", "nodes", node, f"{OUT_OF_SERVICE_TAINT}-")
    began = time.monotonic()
    while await node_ready(api, node) != "True":
        if time.monotonic() - began > timeout_s:
            raise FaultFailed(f"restored node {node} not Ready within {timeout_s:.0f}s")
        await asyncio.sleep(0.5)
    return f"{node} back, Ready after {time.monotonic() - began:.1f}s"
