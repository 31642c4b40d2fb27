"""The chaos soak in Kubernetes mode: random ComputeDomain jobs applied through the API server, on
real kubelets (the end-to-end environment of tests/e2e/harness.py), under kubelet restarts,
cd-node-agent kills, controller failovers, kube-apiserver restarts and lost nodes.

    up (control plane, kubelets, agents, two controller replicas)
    -> [step: pause, then one action: a job submitted or deleted, or a fault]... with
          invariants 1-3 on store snapshots every CHECK_INTERVAL_S meanwhile, and
          invariant 6 (a running job's workload keeps its imports unless a fault took one of its
          daemons: a lost node) every IMPORT_CHECK_INTERVAL_S and before each delete
    -> at the end a quiescence: faults over, every job formed again (its pods run, its domain
       Ready), invariants 1-4 with the nodes' files, no stray IMEX daemon, the pods of jobs no
       node loss hit are the ones they started with, imports intact (made anew for the jobs a
       node loss hit), invariant 5 for every deleted domain, every process alive but those killed
    -> every job deleted, then nothing of any domain left (`check_cluster_idle`) -> down

The decisions come from one seed (`tools.chaos.plan.Plan`, with this soak's fault kinds); the
first violation stops the soak, and the result says what was done (counts per fault kind and job
operation) and what was found.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TextIO

import aiohttp
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from libs.invariants import checker as invariants
from libs.state.store import TRANSIENT_ERRORS, Store
from tests.e2e import kube
from tests.e2e.harness import E2EEnvironment
from tools.cdsim import workload
from tools.chaos import checks, continuity
from tools.chaos import plan as p
from tools.chaos.event_log import EventLog
from tools.chaoskube import faults, kube_jobs
from tools.chaoskube.kube_jobs import KubeJob
from tools.launch import pid_alive

KUBELET_RESTART = "kubelet-restart"
KILL_AGENT = p.KILL_AGENT
CONTROLLER_FAILOVER = p.CONTROLLER_FAILOVER
APISERVER_RESTART = "apiserver-restart"
NODE_LOST = "node-lost"
FAULTS = (KUBELET_RESTART, KILL_AGENT, CONTROLLER_FAILOVER, APISERVER_RESTART, NODE_LOST)
WEIGHTS = {
    p.JOB_SUBMIT: 6.0,
    p.JOB_DELETE: 3.0,
    KUBELET_RESTART: 2.0,
    KILL_AGENT: 2.0,
    CONTROLLER_FAILOVER: 1.0,
    APISERVER_RESTART: 1.0,
    NODE_LOST: 0.7,
}
NAMESPACES = ("chaos-a", "chaos-b")
CHECK_INTERVAL_S = 1.0
IMPORT_CHECK_INTERVAL_S = 5.0
IMPORT_TIMEOUT_S = 30.0
# Beyond kubelet's retry of a pod it saw before the node authorizer linked it to the node (~90 s).
FORM_TIMEOUT_S = 180.0
# What a restarting API server or etcd answers meanwhile: the call is tried again.
API_ERRORS: tuple[type[BaseException], ...] = (
    *TRANSIENT_ERRORS,
    ApiException,
    aiohttp.ClientError,
    OSError,
    TimeoutError,
)


@dataclass(frozen=True)
class KubeSoakOptions:
    duration_s: float
    seed: int
    step_delay_s: tuple[float, float] = (1.0, 3.0)
    settle_s: float = 180.0
    max_job_size: int = 2
    quiesce_every: tuple[int, int] = (25, 40)  # steps between quiescences (and one at the end)
    echo: bool = True


class SoakFailed(Exception):
    pass


class KubeSoak:
    def __init__(
        self, env: E2EEnvironment, api: ApiClient, store: Store, options: KubeSoakOptions, out: TextIO
    ) -> None:
        self.env, self.api, self.store, self.options = env, api, store, options
        self.plan = p.Plan(
            options.seed,
            weights=WEIGHTS,
            step_delay_s=options.step_delay_s,
            faults=FAULTS,
            quiesce_every=options.quiesce_every,
        )
        self.events = EventLog(echo=out if options.echo else None)
        self.replicas = faults.ControllerReplicas(env)
        self.jobs: dict[str, KubeJob] = {}
        self.deleted: list[KubeJob] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.lost: str = ""  # the node lost right now ("" when none)
        self.killed: set[int] = set()
        self.failover_s: list[float] = []
        self.failed = asyncio.Event()

    # ---- running -----------------------------------------------------------------------------

    async def run(self) -> bool:
        o = self.options
        self.events.add(
            "phase", "soak", f"seed {o.seed}, {o.duration_s:.0f}s, nodes {len(self.env.node_names)}"
        )
        await asyncio.to_thread(self.replicas.start_standby)
        for namespace in NAMESPACES:
            self.env.cp.kubectl("create", "namespace", namespace)
        checkers = [
            asyncio.create_task(self._guarded("checker 1-3", self._check_forever())),
            asyncio.create_task(self._guarded("checker inv6", self._check_imports_forever())),
        ]
        try:
            await self._drive()
            await self._quiesce()
            await self._finish()
        except SoakFailed:
            pass
        except Exception:  # a bug of the soak itself: still report what happened until then
            self.events.violation(f"soak: internal error: {traceback.format_exc()}")
        finally:
            for task in [*checkers, *self.tasks]:
                task.cancel()
            await asyncio.gather(*checkers, *self.tasks, return_exceptions=True)
            await asyncio.to_thread(self.replicas.stop_standbys)
        return not self.events.violations

    def _raise_if_failed(self) -> None:
        if self.events.violations:
            raise SoakFailed

    def _fail(self, text: str) -> None:
        self.events.violation(text)
        self.failed.set()

    async def _guarded(self, name: str, work: Awaitable[None]) -> None:
        try:
            await work
        except asyncio.CancelledError:
            raise
        except faults.FaultFailed as exc:
            self._fail(f"fault: {name}: {exc}")
        except Exception as exc:
            self._fail(f"soak: {name} raised {type(exc).__name__}: {exc}")

    def _spawn(self, name: str, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(self._guarded(name, work), name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _drive(self) -> None:
        deadline = time.monotonic() + self.options.duration_s
        hard_stop = deadline + self.options.settle_s
        next_quiescence = self.plan.steps_until_quiescence()
        steps = 0
        # Past the deadline until every kind of fault was done once (a short run's promise).
        while time.monotonic() < deadline or (self._faults_missing() and time.monotonic() < hard_stop):
            step = self.plan.next_step()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(step.delay_s):
                    await self.failed.wait()
            self._raise_if_failed()
            await self._act(step)
            steps += 1
            if steps >= next_quiescence and time.monotonic() < deadline:
                await self._quiesce()
                next_quiescence = steps + self.plan.steps_until_quiescence()
        self.events.add("phase", "time is up", f"{steps} steps")

    def _faults_missing(self) -> list[str]:
        return [f for f in FAULTS if not self.events.counts.get(f"fault {f}")]

    async def _act(self, step: p.Step) -> None:
        if step.action == p.JOB_SUBMIT:
            self._submit(step)
        elif step.action == p.JOB_DELETE:
            self._delete(step)
        else:
            await self._guarded(f"fault {step.action}", self._fault(step))

    # ---- jobs --------------------------------------------------------------------------------

    def _free_nodes(self) -> int:
        """Nodes no live job may use: one stays spare for a lost node's replacement."""
        used = sum(j.size for j in self.jobs.values())
        return len(self.env.node_names) - 1 - used - (1 if self.lost else 0)

    def _submit(self, step: p.Step) -> None:
        # The first job is as large as allowed, so that every run checks imports under faults.
        first = not self.events.counts.get("job submit")
        size = self.options.max_job_size if first else 1 + step.job_size % self.options.max_job_size
        if size > self._free_nodes():
            self.events.counts["job submit skipped (no room)"] += 1
            return
        job = KubeJob(f"j{step.number:04d}", NAMESPACES[int(step.picks[1] * len(NAMESPACES))], size)
        self.jobs[job.name] = job
        self.events.add("job", "submit", job.describe(), count="job submit")
        self._spawn(f"submit {job.name}", self._submit_run(job))

    async def _submit_run(self, job: KubeJob) -> None:
        await self._retrying("submit", lambda: kube_jobs.submit(self.api, job))
        pods = await self._wait_formed(job, FORM_TIMEOUT_S)
        if pods is None:
            return  # left to the quiescence
        job.pods, job.state = pods, "running"
        self.events.add("job", "formed", f"{job.describe()} on {sorted(pods.values())}", count="job formed")
        await self._import(job)

    async def _retrying(self, what: str, call: Callable[[], Awaitable[None]]) -> None:
        """`call` until it succeeds: the API server may be restarting (a fault of this soak)."""
        began, delay = time.monotonic(), 0.5
        while True:
            try:
                await call()
                return
            except API_ERRORS as exc:
                if time.monotonic() - began > self.options.settle_s:
                    raise faults.FaultFailed(
                        f"{what} kept failing for {self.options.settle_s:.0f}s: {exc}"
                    ) from exc
                self.events.counts[f"job {what} retried (API error)"] += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _wait_formed(self, job: KubeJob, timeout_s: float) -> dict[str, str] | None:
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            if job.state == "deleting":
                return None
            with contextlib.suppress(*API_ERRORS):
                pods = await kube_jobs.formed(self.api, self.store, job)
                if pods is not None:
                    return pods
            await asyncio.sleep(0.5)
        return None

    async def _import(self, job: KubeJob) -> None:
        """The job's workload imports between its members (two or more); faults count from now."""
        if job.size < 2:
            return
        armed_s = self.events.elapsed()
        importers = await workload.import_all(self.store, job.cd_uid, job.name, IMPORT_TIMEOUT_S)
        job.importers, job.armed_s, job.exempt = tuple(importers), armed_s, ""
        self.events.add(
            "job",
            "imports ok",
            f"{job.describe()}: {sum(len(i.sources) for i in importers)}",
            count="job imports ok",
        )

    def _delete(self, step: p.Step) -> None:
        candidates = sorted(n for n, j in self.jobs.items() if j.state == "running")
        name = p.pick(candidates, step.picks[0])
        if name is None:
            self.events.counts["job delete skipped (no job)"] += 1
            return
        job = self.jobs[name]
        job.state = "deleting"
        self.events.add("job", "delete", job.describe(), count="job delete")
        self._spawn(f"delete {name}", self._delete_run(job, check_first=True))

    async def _delete_run(self, job: KubeJob, check_first: bool) -> None:
        if check_first and job.importers and not job.exempt:
            await self._check_one(job, " (before delete)")
        await self._retrying("delete", lambda: kube_jobs.delete(self.api, job))
        began = time.monotonic()
        while not await self._gone(job):
            if time.monotonic() - began > self.options.settle_s:
                self._fail(f"live: {job.describe()} not gone {self.options.settle_s:.0f}s after its delete")
                return
            await asyncio.sleep(0.5)
        job.state = "gone"
        self.jobs.pop(job.name, None)
        self.deleted.append(job)
        self.events.add("job", "delete ok", job.describe(), count="job delete ok")

    async def _gone(self, job: KubeJob) -> bool:
        try:
            return await kube_jobs.gone(self.api, self.store, job)
        except API_ERRORS:
            return False

    # ---- faults ------------------------------------------------------------------------------

    def _nodes(self) -> list[str]:
        return [n for n in self.env.node_names if n != self.lost]

    async def _fault(self, step: p.Step) -> None:
        action = step.action
        nodes = self._nodes()
        node = p.pick(nodes, step.picks[0]) or nodes[0]
        if action == NODE_LOST:
            busy = {n for j in self.jobs.values() for n in j.pods.values()}
            targets = sorted(n for n in nodes if n in busy) or nodes
            if self.lost or len(nodes) < 3:
                self.plan.not_done(action)
                self.events.counts["fault node-lost skipped (one at a time)"] += 1
                return
            node = p.pick(targets, step.picks[2]) or targets[0]
            self.lost = node
            self._exempt(node, NODE_LOST)
            self.events.add("fault", NODE_LOST, node, count=f"fault {NODE_LOST}")
            self._spawn(f"node lost {node}", self._node_lost(node))
            return
        began = time.monotonic()
        if action == KUBELET_RESTART:
            detail = await faults.restart_kubelet(self.env, node, kill=step.coin)
        elif action == KILL_AGENT:
            self.killed.add(self.env.agents[node])
            detail = await faults.kill_agent(self.env, node)
        elif action == CONTROLLER_FAILOVER:
            detail, took = await faults.controller_failover(self.replicas, self.store)
            self.failover_s.append(took)
        elif action == APISERVER_RESTART:
            detail = await faults.restart_apiserver(self.env, 0.5 + 2.5 * step.length)
        else:
            raise ValueError(f"unknown fault {action}")
        self.events.add(
            "fault", action, f"{detail} ({time.monotonic() - began:.1f}s)", count=f"fault {action}"
        )

    def _exempt(self, node: str, fault: str) -> None:
        for job in self.jobs.values():
            if node in job.pods.values() and not job.exempt:
                job.exempt = f"{fault} {node}"
                self.events.counts[f"check jobs exempted ({fault})"] += 1

    async def _node_lost(self, node: str) -> None:
        self.killed |= {self.env.agents[node], self.env.imex_agents[node]}
        detail = await faults.lose_node(self.env, self.api, node, self.options.settle_s)
        self.events.add("fault", "node lost: declared gone", detail)
        began = time.monotonic()
        # The pod garbage collector (every 20 s) and the API server do this: API server restarts
        # meanwhile delay it, so the bound is a quiescence's, not a node's.
        while await self._pods_on(node) != []:
            if time.monotonic() - began > self.options.settle_s:
                raise faults.FaultFailed(
                    f"pods of lost node {node} not deleted within {self.options.settle_s:.0f}s"
                )
            await asyncio.sleep(0.5)
        self.events.add(
            "fault", "node lost: its pods deleted", f"{node} after {time.monotonic() - began:.1f}s"
        )
        detail = await faults.restore_node(self.env, self.api, node, self.options.settle_s)
        self.events.add("fault", "node lost: tray back", detail)
        self.lost = ""

    async def _pods_on(self, node: str) -> list[str] | None:
        """The job pods bound to `node` (None: the API server did not answer)."""
        found = []
        try:
            for namespace in NAMESPACES:
                pods = await kube.list_pods(self.api, namespace, kube_jobs.JOB_LABEL)
                found += [p_["metadata"]["name"] for p_ in pods if p_["spec"].get("nodeName") == node]
        except API_ERRORS:
            return None
        return found

    # ---- checks ------------------------------------------------------------------------------

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            try:
                found, revision = await checks.instant_violations(self.store)
            except API_ERRORS:
                self.events.counts["check 1-3 skipped (store unreachable)"] += 1
                continue
            self.events.counts["check 1-3"] += 1
            for text in found:
                self._fail(f"{text} (revision {revision})")

    async def _check_imports_forever(self) -> None:
        while True:
            await asyncio.sleep(IMPORT_CHECK_INTERVAL_S)
            for job in sorted(self.jobs.values(), key=lambda j: j.name):
                if job.state == "running" and job.importers and not job.exempt:
                    await self._check_one(job, "")

    async def _check_one(self, job: KubeJob, where: str, final: bool = False) -> bool:
        """Whether the job's imports are intact; a broken one is a violation."""
        armed_s = job.armed_s
        report = await workload.check(job.name, job.importers)
        if job.exempt or job.armed_s != armed_s:
            return True  # a lost node hit it meanwhile, or it imported anew
        verdict = continuity.verdict(report)
        if verdict == continuity.INTACT:
            self.events.counts[f"check inv6 job imports intact{where}"] += 1
            return True
        if verdict == continuity.BROKEN or final:
            self._fail(continuity.broken_imports(job.describe(), report, armed_s))
            return False
        self.events.counts["check inv6 job imports inconclusive (daemon silent)"] += 1
        return False

    async def _settle(self, what: str, probe: Callable[[], Awaitable[list[str]]]) -> None:
        began = time.monotonic()
        found: list[str] = []
        while time.monotonic() - began < self.options.settle_s:
            with contextlib.suppress(*API_ERRORS):
                found = await probe()
                if not found:
                    self.events.add(
                        "check", what, f"after {time.monotonic() - began:.1f}s", count=f"check {what}"
                    )
                    return
            await asyncio.sleep(1.0)
        for text in found or [f"{what}: no answer"]:
            self._fail(f"{text} (still after {self.options.settle_s:.0f}s of quiescence)")
        raise SoakFailed

    async def _quiesce(self) -> None:
        """Faults over, every job formed again: then everything must hold."""
        self.events.add("phase", "quiescence")
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)
        self._raise_if_failed()
        forming = [j for j in self.jobs.values() if j.state in ("forming", "running")]

        async def not_formed() -> list[str]:
            missing = []
            for job in forming:
                pods = await kube_jobs.formed(self.api, self.store, job)
                if pods is None:
                    missing.append(f"live: {job.describe()} not formed (pods running and domain Ready)")
                elif job.state == "forming":
                    job.pods, job.state = pods, "running"
                elif not job.exempt and pods != job.pods:
                    self._fail(
                        f"k8s: {job.describe()}'s pods changed without a lost node: {job.pods} -> {pods}"
                    )
                elif job.exempt:
                    job.pods = pods
            return missing

        await self._settle("jobs formed", not_formed)
        paths = self.env.all_node_paths()

        async def invariants_1_to_4() -> list[str]:
            found = await checks.quiescent_violations(self.store, paths)
            return found + await checks.stray_daemons(self.store, self.env.layout, self.env.node_names)

        await self._settle("invariants 1-4", invariants_1_to_4)
        for job in sorted(self.jobs.values(), key=lambda j: j.name):
            if job.importers and not job.exempt:
                await self._check_one(job, " (quiescence)", final=True)
            elif job.size >= 2:
                await self._import(job)  # anew after a lost node; faults count from now
            else:
                job.exempt = ""
        self._raise_if_failed()
        await self._check_deleted(paths)
        self._check_processes()
        self._raise_if_failed()

    async def _check_deleted(self, paths: list[invariants.NodeLocalPaths]) -> None:
        pending, self.deleted = self.deleted, []

        async def leftovers() -> list[str]:
            found: list[str] = []
            for job in pending:
                gone = await invariants.check_domain_gone(self.store, job.cd_uid, job.claim_uids, paths)
                found += [f"{v} (job {job.describe()})" for v in gone]
            return found

        if pending:
            await self._settle("invariant 5", leftovers)
            self.events.counts["check invariant 5 (deleted domains)"] += len(pending)

    def _check_processes(self) -> None:
        """Every process runs but those the soak killed (and did not start again)."""
        processes = {
            **{f"cd-node-agent {n}": pid for n, pid in self.env.agents.items()},
            **{f"cd-imex-agent {n}": pid for n, pid in self.env.imex_agents.items()},
            **{f"controller {i}": pid for i, pid in self.replicas.pids.items()},
            "placement advisor": self.env.advisor_pid,
        }
        for name, pid in sorted(processes.items()):
            if pid not in self.killed and not pid_alive(pid):
                self._fail(f"crash: {name} (pid {pid}) died without a fault")
        for name, kubelet in sorted(self.env.kubelet_nodes.items()):
            if not kubelet.kubelet_running():
                self._fail(f"crash: kubelet of {name} died without a fault")

    async def _finish(self) -> None:
        """Delete every job; then nothing of any domain is left anywhere."""
        self.events.add("phase", "deleting every job", f"{len(self.jobs)} jobs")
        for job in list(self.jobs.values()):
            job.state = "deleting"
            self._spawn(f"delete {job.name}", self._delete_run(job, check_first=True))
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)
        self._raise_if_failed()
        paths = self.env.all_node_paths()
        pending, self.deleted = self.deleted, []

        async def idle() -> list[str]:
            found = await invariants.check_cluster_idle(self.store, paths)
            for job in pending:
                found += await invariants.check_domain_gone(self.store, job.cd_uid, job.claim_uids, paths)
            for namespace in NAMESPACES:
                claims = await kube.list_claims(self.api, namespace)
                found += [f"k8s: ResourceClaim {namespace}/{c['metadata']['name']} left" for c in claims]
            return found

        await self._settle("cluster idle", idle)
        self.events.counts["check invariant 5 (deleted domains)"] += len(pending)
        self._check_processes()

    # ---- report ------------------------------------------------------------------------------

    def summary(self, ok: bool) -> dict[str, Any]:
        counts = dict(sorted(self.events.counts.items()))
        return {
            "ok": ok,
            "seed": self.options.seed,
            "duration_s": self.options.duration_s,
            "elapsed_s": round(self.events.elapsed(), 1),
            "nodes": len(self.env.node_names),
            "faults": {k.removeprefix("fault "): v for k, v in counts.items() if k.startswith("fault ")},
            "jobs": {k.removeprefix("job "): v for k, v in counts.items() if k.startswith("job ")},
            "checks": {k.removeprefix("check "): v for k, v in counts.items() if k.startswith("check ")},
            "violations": list(self.events.violations),
            "failover_s": [round(x, 2) for x in self.failover_s],
        }

    def report(self, ok: bool) -> str:
        o = self.options
        verdict = "PASSED" if ok else "FAILED"
        lines = [f"KUBERNETES CHAOS SOAK {verdict}: seed {o.seed}, {self.events.elapsed():.0f}s"]
        if not ok:
            lines += [
                "violations:",
                *[f"  {v}" for v in self.events.violations],
                "event log:",
                self.events.render(),
            ]
            lines.append(f"logs of every process: {self.env.layout.logs_dir}")
        for title, prefix in (("faults", "fault "), ("job operations", "job "), ("checks", "check ")):
            lines.append(f"{title}:")
            lines += [f"  {line}" for line in self.events.summary(prefix)] or ["  (none)"]
        if self.failover_s:
            lines.append(
                f"controller failover: {len(self.failover_s)} takeovers, longest {max(self.failover_s):.2f}s"
            )
        return "\n".join(lines)
