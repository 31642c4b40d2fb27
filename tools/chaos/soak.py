"""The chaos soak: a cdsim cluster, random jobs and real faults, invariants checked all along.

    up -> [step: pause, then one action (job submit/delete or a fault)]... with
          a checker of invariants 1-3 on store snapshots every CHECK_INTERVAL_S meanwhile,
          a checker of invariant 6 (running jobs keep their workload's imports, killed nodes
          come back with their index) every IMPORT_CHECK_INTERVAL_S,
          and every few dozen steps a quiescence: no new actions, in-flight ones finish,
          every process healthy again, then invariants 1-4, liveness (every job Ready, every
          claim preparable), invariant 6, and invariant 5 for each domain deleted since the last one
    -> at the end: one more quiescence, every job deleted, nothing left of any domain
       (`check_cluster_idle`), no service crashed -> down

The first violation stops the soak. The result says what was done (counts per fault and job
operation) or, on failure, the seed and the whole event log.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import shutil
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import structlog

from libs.gen.computedomain.state import v1 as pb
from libs.invariants import checker as invariants
from tools.cdsim import jobs, lifecycle
from tools.cdsim.job_book import Job
from tools.cdsim.layout import StateLayout, cluster_node_paths
from tools.chaos import checks, continuity, job_ops
from tools.chaos import plan as p
from tools.chaos.event_log import EventLog
from tools.chaos.fault_steps import FaultSteps
from tools.chaos.import_watch import ImportWatch
from tools.chaos.tracking import ClusterHandle, DeletedDomain, SoakOptions, Tracked
from tools.sim import faults
from tools.sim.hardware.cluster import ClusterDescription

log = structlog.get_logger(__name__)

CHECK_INTERVAL_S = 0.5
MAX_SUBMITS_IN_FLIGHT = 3
DELETE_TIMEOUT_S = 60.0
HEALTHY_TIMEOUT_S = 90.0


class SoakFailed(Exception):
    pass


@dataclass
class Soak(FaultSteps, ImportWatch):
    options: SoakOptions
    out: TextIO
    layout: StateLayout = field(init=False)
    events: EventLog = field(init=False)

    def __post_init__(self) -> None:
        o = self.options
        self.plan = p.Plan(o.seed, step_delay_s=o.step_delay_s, quiesce_every=o.quiesce_every)
        self.events = EventLog(echo=self.out if o.echo else None)
        root = o.state_dir or Path(tempfile.mkdtemp(prefix="chaos-"))
        self.layout = StateLayout.at(root)
        self.cluster: ClusterDescription | None = None
        self.handle: ClusterHandle | None = None
        self.jobs: dict[tuple[str, str], Tracked] = {}
        self.gone_pending: list[DeletedDomain] = []
        self.busy_nodes: set[str] = set()
        self.nodes_down = 0
        self.etcd_restarting = False
        # When each etcd restart was over (monotonic): etcd renews every lease's TTL when it
        # comes back (etcd-io/etcd#9395), so a dead leader's lease outlives it by that much.
        self.etcd_back_at: list[float] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.caused_restarts: Counter[str] = Counter()
        self.baseline: dict[str, checks.ProcessCount] = {}
        self.garbage_keys: list[str] = []
        self.failover_s: list[float] = []
        self.failed = asyncio.Event()
        self.stopped_pids: set[int] = set()
        self.ledger = continuity.FaultLedger()
        self.index_expected: dict[tuple[str, str], continuity.IndexExpectation] = {}

    # ---- entry point -----------------------------------------------------------------------

    async def run(self) -> bool:
        o = self.options
        self.out.write(
            f"chaos soak: seed {o.seed}, {o.duration_s:.0f}s, {o.racks} rack(s) x {o.trays} trays, "
            f"state dir {self.layout.root}\n"
        )
        self.out.flush()
        up_out = self.out if o.echo else io.StringIO()
        options = lifecycle.UpOptions(racks=o.racks, trays=o.trays, address_block=o.address_block)
        try:
            await asyncio.to_thread(lifecycle.up, self.layout, options, up_out)
        except lifecycle.CommandError as exc:
            self.events.violation(f"setup: the cluster did not come up: {exc}")
            return False
        self.cluster = ClusterDescription.load(self.layout.cluster_file)
        try:
            state = jobs.running_state(self.layout)
            async with jobs.open_store(state) as store:
                self.handle = ClusterHandle(self.layout, self.cluster, store)
                await self._soak()
        except SoakFailed:
            pass
        except Exception as exc:  # a bug of the soak itself: still report what happened until then
            self.events.violation(f"soak: internal error: {traceback.format_exc()}")
            log.error("soak failed", error=str(exc))
        finally:
            await self._release_stopped()
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            failed = bool(self.events.violations)
            if not (failed and o.keep_up):
                await asyncio.to_thread(lifecycle.down, self.layout, io.StringIO())
        return not self.events.violations

    async def _soak(self) -> None:
        assert self.handle is not None
        self.baseline = checks.process_counts(await self._supervisor_state())
        self.events.add("phase", "cluster up", f"{len(self.baseline)} processes")
        checkers = [
            asyncio.create_task(self._check_forever(), name="chaos-checker"),
            asyncio.create_task(self._guarded("inv6-checker", self._check_imports_forever()), name="inv6"),
        ]
        try:
            await self._drive()
            self._raise_if_failed()
            await self._quiesce(final=True)
            await self._finish()
        finally:
            for checker in checkers:
                checker.cancel()
            await asyncio.gather(*checkers, return_exceptions=True)

    # ---- the driver ------------------------------------------------------------------------

    async def _drive(self) -> None:
        deadline = time.monotonic() + self.options.duration_s
        next_quiescence = self.plan.steps_until_quiescence()
        steps = 0
        while time.monotonic() < deadline:
            step = self.plan.next_step()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(step.delay_s):
                    await self.failed.wait()
            self._raise_if_failed()
            await self._act(step)
            steps += 1
            if steps >= next_quiescence and time.monotonic() < deadline:
                await self._quiesce(final=False)
                next_quiescence = steps + self.plan.steps_until_quiescence()
        self.events.add("phase", "time is up", f"{steps} steps")

    def _raise_if_failed(self) -> None:
        if self.events.violations:
            raise SoakFailed

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(self._guarded(name, coro), name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _guarded(self, name: str, coro: Awaitable[None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug of the soak or a service misbehaving: stop and show it
            self._fail(f"soak: {name} raised {type(exc).__name__}: {exc}")

    def _fail(self, text: str) -> None:
        self.events.violation(text)
        self.failed.set()

    async def _act(self, step: p.Step) -> None:
        if step.action == p.JOB_SUBMIT:
            self._submit(step)
        elif step.action == p.JOB_DELETE:
            self._delete_one(step)
        else:
            await self._inject(step)

    # ---- jobs ------------------------------------------------------------------------------

    def _submit(self, step: p.Step) -> None:
        spec = job_ops.JobSpec(f"j{step.number:05d}", step.namespace, step.job_size, step.all_channels)
        if sum(1 for t in self.jobs.values() if t.state == "submitting") >= MAX_SUBMITS_IN_FLIGHT:
            self.events.counts["job submit skipped (submits in flight)"] += 1
            return
        self.jobs[spec.key] = Tracked(spec, "submitting", armed_s=self.events.elapsed())
        self.events.add("job", "submit", spec.describe(), count="job submit")
        self._spawn(f"submit {spec.name}", self._submit_run(spec))

    async def _submit_run(self, spec: job_ops.JobSpec) -> None:
        assert self.handle is not None
        outcome = await job_ops.submit(self.layout, self.handle.store, spec, self.options.prepare_deadline_s)
        tracked = self.jobs[spec.key]
        tracked.job = outcome.job
        self.events.add("job", f"submit {outcome.result}", f"{spec.describe()}: {outcome.detail}")
        self.events.counts[f"job submit {outcome.result}"] += 1
        if outcome.result == job_ops.HUNG:
            self._fail(f"live: submit of {spec.describe()} hung: {outcome.detail}")
            tracked.state = "broken"
        elif outcome.result == job_ops.SUBMITTED:
            tracked.state = "running"
            await self._import(tracked, quiescent=False)
        elif outcome.result in (job_ops.REFUSED, job_ops.ADVISOR_DOWN):
            del self.jobs[spec.key]
        elif outcome.job is None:
            del self.jobs[spec.key]  # nothing was recorded: nothing to clean up
        elif outcome.result == job_ops.PREPARE_LATE:
            tracked.state = "failed"
        else:
            tracked.state = "broken"  # half-created: it is deleted, not resumed

    def _delete_one(self, step: p.Step) -> None:
        candidates = sorted(
            (k for k, t in self.jobs.items() if t.state in ("running", "failed", "broken")),
        )
        key = p.pick(candidates, step.picks[0])
        if key is None:
            self.events.counts["job delete skipped (no job)"] += 1
            return
        tracked = self.jobs[key]
        job = tracked.job or job_ops.book_job(self.layout, *key)
        if job is None:
            del self.jobs[key]
            return
        was_running = tracked.state == "running"
        tracked.state = "deleting"
        self.events.add("job", "delete", tracked.spec.describe(), count="job delete")
        self._spawn(f"delete {key[1]}", self._delete_run(tracked, job, check_first=was_running))

    async def _delete_run(self, tracked: Tracked, job: Job, check_first: bool = False) -> None:
        if check_first:
            await self._check_before_delete(tracked)
        outcome = await job_ops.delete(self.layout, job, DELETE_TIMEOUT_S)
        self.events.add("job", f"delete {outcome.result}", f"{tracked.spec.describe()}: {outcome.detail}")
        self.events.counts[f"job delete {outcome.result}"] += 1
        if outcome.result == job_ops.HUNG:
            self._fail(f"live: delete of {tracked.spec.describe()} hung: {outcome.detail}")
        if outcome.result == job_ops.DELETED:
            self.jobs.pop(tracked.spec.key, None)
            self.gone_pending.append(
                DeletedDomain(job.domain_uid, tuple(c.uid for c in job.claims), tracked.spec.describe())
            )
        else:
            tracked.state = "deleting-incomplete"

    # ---- checks ----------------------------------------------------------------------------

    async def _check_forever(self) -> None:
        """Invariants 1-3 on a store snapshot, every CHECK_INTERVAL_S, faults or not."""
        assert self.handle is not None
        while True:
            try:
                violations, revision = await checks.instant_violations(self.handle.store)
            except job_ops.CALL_FAILURES:
                self.events.counts["check 1-3 skipped (store unavailable)"] += 1
            else:
                self.events.counts["check 1-3"] += 1
                for text in violations:
                    self._fail(f"{text} (store revision {revision})")
            await asyncio.sleep(CHECK_INTERVAL_S)

    async def _supervisor_state(self) -> dict[str, Any]:
        assert self.handle is not None
        answer = await faults.supervisor_request(self.handle.layout, "status")
        state = answer.get("state")
        return state if isinstance(state, dict) else {}

    async def _wait_healthy(self) -> None:
        began = time.monotonic()
        while True:
            down = checks.not_running(checks.process_counts(await self._supervisor_state()))
            if not down:
                return
            if time.monotonic() - began > HEALTHY_TIMEOUT_S:
                tails = "\n".join(
                    f"--- {name}:\n{checks.tail(self.layout.log_file(name), 10)}" for name in down[:3]
                )
                self._fail(
                    f"live: not healthy {HEALTHY_TIMEOUT_S:.0f}s after the faults stopped: {down}\n{tails}"
                )
                return
            await asyncio.sleep(0.5)

    async def _settle(self, what: str, probe: Callable[[], Awaitable[list[str]]], detail: str = "") -> None:
        """Poll `probe` until it finds nothing; what it still finds after settle_s are violations."""
        began = time.monotonic()
        found: list[str] = []
        while time.monotonic() - began < self.options.settle_s:
            try:
                found = await probe()
            except job_ops.CALL_FAILURES as exc:
                found = [f"{what}: store unavailable ({type(exc).__name__})"]
            if not found:
                took = f"ok after {time.monotonic() - began:.1f}s"
                self.events.add("check", what, f"{detail}{took}", count=f"check {what}")
                return
            if any(v.startswith(("inv1:", "inv2:", "inv3:")) for v in found):
                break  # these never need time
            await asyncio.sleep(0.5)
        for text in found:
            self._fail(text)

    async def _quiesce(self, final: bool) -> None:
        assert self.handle is not None
        began = time.monotonic()
        self.events.add(
            "phase", "quiescence" + (" (final)" if final else ""), f"{len(self.tasks)} operations in flight"
        )
        self.events.counts["phase quiescence"] += 1
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)
        self._raise_if_failed()
        await self._wait_healthy()
        self._raise_if_failed()
        # Kubelet keeps retrying the claims of a pod; a job whose submit gave up is retried now.
        for tracked in sorted(self.jobs.values(), key=lambda t: t.spec.key):
            if tracked.state == "failed" and tracked.job is not None:
                outcome = await job_ops.prepare_again(self.layout, tracked.job, self.options.settle_s)
                self.events.add(
                    "job", f"prepare again {outcome.result}", f"{tracked.spec.describe()}: {outcome.detail}"
                )
                if outcome.result != job_ops.SUBMITTED:
                    self._fail(
                        f"live: {tracked.spec.describe()} cannot be prepared once faults stopped: {outcome.detail}"
                    )
                    return
                tracked.state, tracked.job = "running", outcome.job
        # Half-created and half-deleted jobs are deleted now (a user would delete them again).
        for tracked in sorted(self.jobs.values(), key=lambda t: t.spec.key):
            if tracked.state in ("broken", "deleting-incomplete"):
                job = tracked.job or job_ops.book_job(self.layout, *tracked.spec.key)
                if job is None:
                    self.jobs.pop(tracked.spec.key, None)
                    continue
                tracked.state = "deleting"
                await self._delete_run(tracked, job)
                if tracked.state != "deleting-incomplete":
                    continue
                self._fail(f"live: {tracked.spec.describe()} cannot be deleted once faults stopped")
                return
        paths = cluster_node_paths(self.layout, self._nodes())
        store = self.handle.store
        nodes = self._nodes()

        async def invariants_1_to_4() -> list[str]:
            found = await checks.quiescent_violations(store, paths)
            return found + await checks.stray_daemons(store, self.layout, nodes)

        await self._settle("invariants 1-4", invariants_1_to_4)
        self._raise_if_failed()
        await self._settle("jobs ready", self._jobs_not_ready)
        self._raise_if_failed()
        # Invariant 6: what survived the faults first, then imports (again) for the jobs that had
        # none yet or were hit by a fault that may break them; those count from now on.
        await self._check_indices(quiescent=True)
        await self._check_imports(quiescent=True)
        self._raise_if_failed()
        for tracked in sorted(self.jobs.values(), key=lambda t: t.spec.key):
            if tracked.state == "running" and (not tracked.importers or self._exemption(tracked)):
                await self._import(tracked, quiescent=True)
                self._raise_if_failed()
        pending, self.gone_pending = self.gone_pending, []
        if pending:

            async def leftovers() -> list[str]:
                found: list[str] = []
                for gone in pending:
                    found += [
                        f"{v} (job {gone.what})"
                        for v in await invariants.check_domain_gone(store, gone.uid, gone.claim_uids, paths)
                    ]
                return found

            await self._settle("invariant 5", leftovers, f"{len(pending)} deleted domains: ")
            self.events.counts["check invariant 5 (deleted domains)"] += len(pending)
        await self._crash_check()
        self._raise_if_failed()
        self.events.add("phase", "quiescence done", f"{time.monotonic() - began:.1f}s")

    async def _jobs_not_ready(self) -> list[str]:
        assert self.handle is not None
        store = self.handle.store
        missing = []
        for tracked in sorted(self.jobs.values(), key=lambda t: t.spec.key):
            if tracked.state != "running" or tracked.job is None:
                continue
            found = await store.get(store.keys.domain(tracked.job.domain_uid), pb.ComputeDomain)
            domain = found.value if found else None
            if domain is None or domain.status.status != pb.Readiness.READY:
                missing.append(f"live: {tracked.spec.describe()} not Ready ({jobs.readiness_reason(domain)})")
        return missing

    async def _crash_check(self) -> None:
        now = checks.process_counts(await self._supervisor_state())
        for text in checks.unexplained_restarts(self.baseline, now, self.caused_restarts):
            name = text.split()[1]
            self._fail(f"{text}\n{checks.tail(self.layout.log_file(name), 15)}")

    async def _finish(self) -> None:
        """Delete every job, then nothing of any domain may be left anywhere."""
        assert self.handle is not None
        store = self.handle.store
        self.events.add("phase", "deleting every job", f"{len(self.jobs)} jobs")
        for tracked in sorted(self.jobs.values(), key=lambda t: t.spec.key):
            job = tracked.job or job_ops.book_job(self.layout, *tracked.spec.key)
            if job is not None:
                was_running = tracked.state == "running"
                tracked.state = "deleting"
                self._spawn(f"delete {tracked.spec.name}", self._delete_run(tracked, job, was_running))
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)
        stuck = [t.spec.describe() for t in self.jobs.values() if t.job is not None]
        if stuck:
            self._fail(f"live: jobs could not be deleted at the end: {stuck}")
        self._raise_if_failed()
        for key in self.garbage_keys:
            await store.delete(key)
        self.events.add("note", "garbage removed", f"{len(self.garbage_keys)} undecodable keys deleted")
        paths = cluster_node_paths(self.layout, self._nodes())
        pending, self.gone_pending = self.gone_pending, []

        async def idle() -> list[str]:
            found = await invariants.check_cluster_idle(store, paths)
            for gone in pending:
                found += await invariants.check_domain_gone(store, gone.uid, gone.claim_uids, paths)
            return found

        await self._settle("cluster idle", idle)
        await self._crash_check()
        self._raise_if_failed()

    # ---- report ----------------------------------------------------------------------------

    def report(self, ok: bool) -> str:
        o = self.options
        lines = []
        if ok:
            lines.append(
                f"CHAOS SOAK PASSED: seed {o.seed}, {self.events.elapsed():.0f}s, zero invariant violations "
                f"({self.events.counts['check 1-3']} snapshot checks of invariants 1-3, "
                f"{self._inv6_checks()} checks of running jobs' imports (invariant 6), "
                f"{self.events.counts['phase quiescence']} quiescences)"
            )
        else:
            lines.append(
                f"CHAOS SOAK FAILED: seed {o.seed} (replay: python -m tools.chaos --seed {o.seed} "
                f"--duration {o.duration_s:.0f} --racks {o.racks} --trays {o.trays})"
            )
            lines.append("violations:")
            lines += [f"  {v}" for v in self.events.violations]
            lines.append("event log:")
            lines.append(self.events.render())
            lines.append(f"logs of every process: {self.layout.logs_dir}")
        lines.append("faults:")
        lines += [f"  {line}" for line in self.events.summary("fault ")] or ["  (none)"]
        lines.append("job operations:")
        lines += [f"  {line}" for line in self.events.summary("job ")] or ["  (none)"]
        lines.append("checks:")
        lines += [f"  {line}" for line in self.events.summary("check ")]
        if self.failover_s:
            lines.append(
                f"controller failover: {len(self.failover_s)} takeovers, longest {max(self.failover_s):.2f}s"
            )
        errors = checks.error_log_lines(self.layout)
        if errors:
            lines.append("error-level log lines of the services (faults cause some; for reading):")
            lines += [f"  {count:6d}  {what}" for what, count in errors.most_common(25)]
        return "\n".join(lines)

    def _inv6_checks(self) -> int:
        return sum(
            n for name, n in self.events.counts.items() if name.startswith("check inv6 job imports intact")
        )

    def summary(self, ok: bool) -> dict[str, Any]:
        """The result as data (for `--summary-json` and the tests)."""
        return {
            "ok": ok,
            "seed": self.options.seed,
            "duration_s": self.options.duration_s,
            "elapsed_s": round(self.events.elapsed(), 1),
            "counts": dict(sorted(self.events.counts.items())),
            "violations": list(self.events.violations),
            "failover_s": [round(x, 2) for x in self.failover_s],
            "state_dir": str(self.layout.root),
        }

    def cleanup(self, ok: bool) -> None:
        """Remove the state dir after a pass (unless it was given); a failure keeps it to read."""
        if ok and self.options.state_dir is None:
            shutil.rmtree(self.layout.root, ignore_errors=True)
