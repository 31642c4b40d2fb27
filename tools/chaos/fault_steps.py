"""The soak's faults: which one a step makes, on which target, and what the soak then expects.

A mixin of `tools.chaos.soak.Soak` (it uses the soak's state and its task helpers); the faults
themselves are done by `tools.sim.faults`. Faults that may break the imports of jobs on the
node they hit (`plan.BREAKS_IMPORTS`) go into the soak's ledger before they are done, and stay
there until their effect is over (invariant 6, `tools.chaos.continuity`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from libs.gen.computedomain.state import v1 as pb
from tools.cdsim import proc_scan
from tools.cdsim.layout import StateLayout
from tools.cdsim.services import IMEX_AGENT_LEASE_TTL_S, agent_name, imex_agent_name
from tools.chaos import checks, continuity, job_ops
from tools.chaos import plan as p
from tools.chaos.event_log import EventLog
from tools.chaos.tracking import ClusterHandle, SoakOptions, Tracked, failover_time
from tools.sim import faults
from tools.sim.faults import NotApplicable
from tools.sim.hardware.cluster import ClusterDescription

MAX_NODES_DOWN = 2
# The IMEX agent kills a daemon that has not answered for 20 s; beyond that on a busy machine.
HANG_REPLACED_S = 75.0
# A standby must lead within one lease TTL (the failover target); the margin covers a busy 2-core machine.
FAILOVER_BOUND_S = 12.0
# Longest link cut: past the daemons' heartbeat timeout (15 s), well short of the IMEX agent's
# IMEX_NODE_DISCONNECTED_GRACE_TIME (services/imexagent/settings.py), so imports must survive.
CUT_LINKS_MAX_S = 25.0
GARBAGE_MARKER = b"\xff\xfe chaos: not a protobuf envelope \x00"


class FaultSteps:
    """The fault half of the soak (state and helpers below are the soak's)."""

    options: SoakOptions
    layout: StateLayout
    events: EventLog
    plan: p.Plan
    cluster: ClusterDescription | None
    handle: ClusterHandle | None
    jobs: dict[tuple[str, str], Tracked]
    busy_nodes: set[str]
    nodes_down: int
    etcd_restarting: bool
    etcd_back_at: list[float]
    caused_restarts: Counter[str]
    garbage_keys: list[str]
    failover_s: list[float]
    stopped_pids: set[int]
    ledger: continuity.FaultLedger
    index_expected: dict[tuple[str, str], continuity.IndexExpectation]

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        raise NotImplementedError

    def _fail(self, text: str) -> None:
        raise NotImplementedError

    async def _inject(self, step: p.Step) -> None:
        action = step.action
        if action in (p.IMEX_CRASH, p.IMEX_HANG, p.IMEX_KILL):
            await self._fault(action, self._imex_fault(action, step))
        elif action == p.KILL_AGENT:
            await self._fault(action, self._kill_agent(step))
        elif action == p.KILL_IMEX_AGENT:
            self._kill_imex_agent(step)
        elif action == p.CONTROLLER_FAILOVER:
            await self._fault(action, self._controller_failover())
        elif action == p.ETCD_RESTART:
            if self.etcd_restarting:
                self._skipped(action, "an etcd restart is under way")
                return
            self.etcd_restarting = True
            self._spawn(action, self._fault(action, self._restart_etcd()))
        elif action == p.KILL_NODE:
            self._kill_node(step)
        elif action == p.PARTITION_ETCD:
            self._partition_etcd(step)
        elif action == p.CUT_LINKS:
            self._cut_links(step)
        elif action == p.CORRUPT_CHECKPOINT:
            node = self._pick_node(step, prefer_busy_with_claims=step.coin)
            if node is None:
                self._skipped(action, "every node is under another fault")
                return
            self.busy_nodes.add(node)
            self._spawn(action, self._fault(action, self._corrupt_checkpoint(node, step), node))
        elif action == p.UNDECODABLE_VALUE:
            await self._fault(action, self._undecodable(step))

    async def _fault(self, action: str, run: Awaitable[str], node: str | None = None) -> None:
        try:
            detail = await run
        except NotApplicable as exc:
            self._skipped(action, str(exc))
            return
        except job_ops.CALL_FAILURES as exc:  # etcd restarting under the fault's own store read
            self._skipped(action, f"{type(exc).__name__}: {exc}")
            return
        finally:
            if node is not None:
                self.busy_nodes.discard(node)
            if action == p.ETCD_RESTART:
                self.etcd_restarting = False
        self.events.add("fault", action, detail, count=f"fault {action}")

    def _skipped(self, action: str, why: str) -> None:
        self.events.counts[f"fault {action} skipped"] += 1
        self.events.add("note", f"{action} skipped", why)
        if not self.events.counts[f"fault {action}"]:
            self.plan.not_done(action)

    # ---- targets ---------------------------------------------------------------------------

    def _nodes(self) -> list[str]:
        assert self.cluster is not None
        return sorted(self.cluster.node_names())

    def _claimed_nodes(self, states: tuple[str, ...]) -> list[str]:
        nodes = {c.node for t in self.jobs.values() if t.state in states and t.job for c in t.job.claims}
        return sorted(nodes - self.busy_nodes)

    def _pick_node(self, step: p.Step, prefer_busy_with_claims: bool) -> str | None:
        if prefer_busy_with_claims:
            node = p.pick(self._claimed_nodes(("running",)), step.picks[1])
            if node is not None:
                return node
        return p.pick([n for n in self._nodes() if n not in self.busy_nodes], step.picks[0])

    # ---- faults ----------------------------------------------------------------------------

    async def _kill_agent(self, step: p.Step) -> str:
        assert self.handle is not None
        # Half the time, a node whose claims are being prepared right now (SIGKILL mid-prepare).
        submitting = sorted(
            {
                c.node
                for t in self.jobs.values()
                if t.state == "submitting"
                for c in (job_ops.book_job(self.layout, *t.spec.key) or _NO_JOB).claims
            }
            - self.busy_nodes
        )
        node = p.pick(submitting, step.picks[1]) if step.coin else None
        node = node or self._pick_node(step, prefer_busy_with_claims=False)
        if node is None:
            raise NotApplicable("every node is under another fault")
        killed = await faults.kill_agent(self.handle.layout, node)
        self.caused_restarts[agent_name(node)] += 1
        return f"{node}: kubelet plugin pid {killed.pid} SIGKILLed" + (
            " (mid-prepare)" if node in submitting else ""
        )

    async def _imex_fault(self, action: str, step: p.Step) -> str:
        assert self.handle is not None
        candidates = sorted(set(self._nodes_with_daemons()) - self.busy_nodes)
        node = p.pick(candidates, step.picks[0])
        if node is None:
            raise NotApplicable("no IMEX daemon runs")
        # In the ledger before it is done: a check racing with the fault must see the exemption.
        fault = self.ledger.begin(node, action, self.events.elapsed())
        if action == p.IMEX_KILL:
            try:
                killed = faults.kill_imex(self.handle.layout, node)
                return f"{node}: daemon pid {', '.join(map(str, killed))} SIGKILLed"
            finally:
                self.ledger.end(fault, self.events.elapsed())
        try:
            told = "crash" if action == p.IMEX_CRASH else "hang"
            pid, domain = await faults.imex_fault(self.handle.layout, node, told)
        except BaseException:
            self.ledger.end(fault, self.events.elapsed())
            raise
        # A hung daemon is still the exporter until its IMEX agent kills it: the fault lasts until
        # then (imports made meanwhile are as good as broken), and the node stays busy.
        self.busy_nodes.add(node)
        self._spawn(f"{action}-watch", self._imex_fault_over(action, node, pid, fault))
        return f"{node}: daemon pid {pid} of domain {domain} told to {told}"

    async def _imex_fault_over(self, action: str, node: str, pid: int, fault: continuity.NodeFault) -> None:
        try:
            if await faults.wait_gone(pid, HANG_REPLACED_S):
                return
            what = "hung IMEX daemon" if action == p.IMEX_HANG else "IMEX daemon told to crash"
            self._fail(f"live: the {what} (pid {pid} on {node}) is still there {HANG_REPLACED_S:.0f}s later")
        finally:
            self.ledger.end(fault, self.events.elapsed())
            self.busy_nodes.discard(node)

    async def _controller_failover(self) -> str:
        assert self.handle is not None
        killed, old = await faults.controller_failover(self.handle.layout, self.handle.store)
        self.caused_restarts[old.holder] += 1
        self._spawn("failover-watch", self._watch_failover(old))
        return f"leader {old.holder} (pid {killed.pid}) SIGKILLed"

    async def _watch_failover(self, old: pb.LeaderRecord) -> None:
        assert self.handle is not None
        killed_at = time.monotonic()
        took = await faults.wait_new_leader(self.handle.store, old, timeout_s=60.0)
        if took is None:
            self._fail(f"failover: no controller took the lead within 60s of killing {old.holder}")
            return
        self.failover_s.append(took)
        took_since, restarts = failover_time(killed_at, killed_at + took, self.etcd_back_at)
        meanwhile = (
            f" (etcd restarted {restarts}x meanwhile, renewing the lease; "
            f"{took_since:.2f}s after it was last back)"
            if restarts
            else ""
        )
        self.events.add(
            "note", "new controller leader", f"{took:.2f}s after {old.holder} was killed{meanwhile}"
        )
        if took_since > FAILOVER_BOUND_S:
            self._fail(
                f"failover: the standby took {took_since:.1f}s to lead{meanwhile} (bound {FAILOVER_BOUND_S}s)"
            )

    async def _restart_etcd(self) -> str:
        assert self.handle is not None
        down_ms = await faults.restart_etcd(self.handle.layout)
        self.etcd_back_at.append(time.monotonic())
        self.caused_restarts["etcd"] += 1
        return f"etcd down {down_ms} ms"

    def _kill_imex_agent(self, step: p.Step) -> None:
        """SIGKILL the IMEX agent (back within 0.5-11.5 s) or freeze it past its lease (coin)."""
        action = p.KILL_IMEX_AGENT
        node = self._pick_node(step, prefer_busy_with_claims=True)
        if node is None:
            self._skipped(action, "every node is under another fault")
            return
        self.busy_nodes.add(node)
        if step.coin:
            self._spawn(
                action, self._freeze_imex_agent_run(node, IMEX_AGENT_LEASE_TTL_S + 1.5 + 5.0 * step.length)
            )
        else:
            self._spawn(
                action, self._kill_imex_agent_run(node, 0.5 + (IMEX_AGENT_LEASE_TTL_S + 6.0) * step.length)
            )

    async def _kill_imex_agent_run(self, node: str, down_s: float) -> None:
        assert self.handle is not None
        handle = self.handle
        killed = False

        async def kill() -> str:
            nonlocal killed
            done = await faults.kill_imex_agent(handle.layout, node, round(down_s, 2))
            self.caused_restarts[imex_agent_name(node)] += 1
            killed = True
            return f"{node}: IMEX agent pid {done.pid} SIGKILLed, back in {down_s:.1f}s"

        try:
            await self._fault(p.KILL_IMEX_AGENT, kill())
            if killed:
                await asyncio.sleep(down_s)  # the node stays busy while its agent is down
        finally:
            self.busy_nodes.discard(node)

    async def _freeze_imex_agent_run(self, node: str, outage_s: float) -> None:
        assert self.handle is not None
        handle = self.handle

        async def freeze() -> str:
            pid = await faults.process_pid(handle.layout, imex_agent_name(node))
            self.stopped_pids.add(pid)
            self.events.add("note", f"{p.KILL_IMEX_AGENT} (SIGSTOP)", f"{node}: IMEX agent pid {pid} frozen")
            try:
                await faults.freeze_process(pid, outage_s)
                return f"{node}: IMEX agent pid {pid} stopped for {outage_s:.1f}s, then continued"
            finally:
                self.stopped_pids.discard(pid)

        await self._fault(p.KILL_IMEX_AGENT, freeze(), node)

    def _kill_node(self, step: p.Step) -> None:
        action = p.KILL_NODE
        node = self._pick_node(step, prefer_busy_with_claims=True)
        if node is None or self.nodes_down >= MAX_NODES_DOWN:
            self._skipped(action, f"{self.nodes_down} nodes down already, or no node free")
            return
        # From a reboot faster than the lease TTL to one well beyond it.
        outage = 1.0 + (IMEX_AGENT_LEASE_TTL_S + 6.0) * step.length
        self.busy_nodes.add(node)
        self.nodes_down += 1
        self._spawn(action, self._kill_node_run(node, outage))

    async def _kill_node_run(self, node: str, outage_s: float) -> None:
        assert self.handle is not None
        handle = self.handle
        fault: continuity.NodeFault | None = None

        async def kill() -> str:
            nonlocal fault
            held = await self._indices_held(node)
            fault = self.ledger.begin(node, p.KILL_NODE, self.events.elapsed())
            done = await faults.kill_node(handle.layout, node, round(outage_s, 2))
            names = ", ".join(f"{name} {pid}" for name, pid in sorted(done.killed.items())) or "nothing ran"
            detail = f"{node}: killed ({names}), back in {outage_s:.1f}s"
            for name in (agent_name(node), imex_agent_name(node)):
                if name in done.killed:
                    self.caused_restarts[name] += 1
            for expectation in held:
                self.index_expected[expectation.key] = expectation
            kept = "; ".join(f"must come back as index {e.index} of {e.job}" for e in held)
            return f"{detail}{'; ' if kept else ''}{kept}"

        try:
            await self._fault(p.KILL_NODE, kill())
            if fault is not None:
                await asyncio.sleep(outage_s)
        finally:
            if fault is not None:
                self.ledger.end(fault, self.events.elapsed())
            self.busy_nodes.discard(node)
            self.nodes_down -= 1

    def _partition_etcd(self, step: p.Step) -> None:
        """Cut a node off etcd from shorter to well beyond its node record's lease TTL."""
        action = p.PARTITION_ETCD
        node = self._pick_node(step, prefer_busy_with_claims=True)
        if node is None:
            self._skipped(action, "every node is under another fault")
            return
        seconds = 1.0 + (IMEX_AGENT_LEASE_TTL_S + 8.0) * step.length
        self.busy_nodes.add(node)
        self._spawn(action, self._partition_etcd_run(node, seconds))

    async def _partition_etcd_run(self, node: str, seconds: float) -> None:
        handle = self._handle()
        await self._timed_run(
            p.PARTITION_ETCD, node, seconds, lambda: self._partition_etcd_now(handle, node, seconds)
        )

    async def _partition_etcd_now(self, handle: ClusterHandle, node: str, seconds: float) -> str:
        cut = await faults.partition_etcd(handle.layout, node, round(seconds, 2))
        return f"{node}: cut off etcd for {seconds:.1f}s ({cut.connections_cut} connections reset)"

    async def _timed_run(
        self, action: str, node: str, seconds: float, inject: Callable[[], Awaitable[str]]
    ) -> None:
        """Do a fault that ends by itself after `seconds`; the node stays busy until then."""
        done = False

        async def run() -> str:
            nonlocal done
            detail = await inject()
            done = True
            return detail

        try:
            await self._fault(action, run())
            if done:
                await asyncio.sleep(seconds)
        finally:
            self.busy_nodes.discard(node)

    def _cut_links(self, step: p.Step) -> None:
        """Cut a member's IMEX links, from shorter than a heartbeat timeout to well past it, always
        shorter than the daemons' grace time: imports must survive (invariant 6)."""
        action = p.CUT_LINKS
        candidates = sorted(set(self._nodes_with_daemons()) - self.busy_nodes)
        node = p.pick(candidates, step.picks[0])
        if node is None:
            self._skipped(action, "no IMEX daemon runs on a free node")
            return
        seconds = 1.0 + CUT_LINKS_MAX_S * step.length
        self.busy_nodes.add(node)
        self._spawn(action, self._cut_links_run(node, seconds))

    async def _cut_links_run(self, node: str, seconds: float) -> None:
        handle = self._handle()
        await self._timed_run(p.CUT_LINKS, node, seconds, lambda: self._cut_links_now(handle, node, seconds))

    async def _cut_links_now(self, handle: ClusterHandle, node: str, seconds: float) -> str:
        cut = await faults.cut_links(handle.layout, node, round(seconds, 2))
        pids = ", ".join(str(pid) for pid in sorted(cut))
        return f"{node}: IMEX links of daemon pid {pids} cut for {seconds:.1f}s"

    def _handle(self) -> ClusterHandle:
        assert self.handle is not None
        return self.handle

    def _nodes_with_daemons(self) -> dict[str, list[proc_scan.ProcessEntry]]:
        handle = self._handle()
        return faults.nodes_with_daemons(handle.layout, handle.cluster.node_names())

    async def _indices_held(self, node: str) -> list[continuity.IndexExpectation]:
        """The indices `node` holds in its domains now (what it must take again when it returns)."""
        assert self.handle is not None
        members, daemons = await checks.members_and_daemons(self.handle.store)
        names = {t.job.domain_uid: t.spec.describe() for t in self.jobs.values() if t.job is not None}
        held = []
        for (uid, member_node), member in sorted(members.items()):
            if member_node != node or member.index < 0:
                continue
            daemon = daemons.get((uid, node))
            instance = daemon.instance if daemon is not None else ""
            held.append(continuity.IndexExpectation(uid, node, member.index, names.get(uid, uid), instance))
        return held

    async def _corrupt_checkpoint(self, node: str, step: p.Step) -> str:
        assert self.handle is not None
        garbage = GARBAGE_MARKER + hashlib.sha256(f"{self.options.seed}/{step.number}".encode()).digest()
        done = await faults.corrupt_checkpoint(self.handle.layout, node, garbage)
        self.caused_restarts[agent_name(node)] += 1
        await asyncio.sleep(faults.CHECKPOINT_AGENT_DOWN_S)  # node stays busy while it restarts
        what = "over its checkpoint" if done.existed else "as its checkpoint (there was none)"
        return f"{node}: kubelet plugin pid {done.pid} SIGKILLed, {len(garbage)} garbage bytes written {what}"

    async def _undecodable(self, step: p.Step) -> str:
        assert self.handle is not None
        keys = self.handle.store.keys
        name = f"chaos-garbage-{step.number}"
        if step.coin:
            key = keys.domains() + name
        else:
            live = sorted(t.job.domain_uid for t in self.jobs.values() if t.job is not None)
            uid = p.pick(live, step.picks[2]) or str(uuid.UUID(int=step.number))
            key = keys.members(uid) + name
        garbage = GARBAGE_MARKER + hashlib.sha256(f"{self.options.seed}:{step.number}".encode()).digest()
        await faults.plant_undecodable(self.handle.store, key, garbage)
        self.garbage_keys.append(key)
        return f"{len(garbage)} garbage bytes at {key}"

    async def _release_stopped(self) -> None:
        for pid in list(self.stopped_pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


class _NoJob:
    claims: tuple[()] = ()


_NO_JOB = _NoJob()
