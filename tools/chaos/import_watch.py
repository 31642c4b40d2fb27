"""Invariant 6 in the soak: running jobs keep their workload's imports, killed nodes come back
with their index.

A mixin of `tools.chaos.soak.Soak` (it uses the soak's jobs, ledger and event log): the workload
of a job imports once its domain is Ready (again at a quiescence after a fault that may break
it), its imports are checked every IMPORT_CHECK_INTERVAL_S, at every quiescence and just before
the job is deleted; the bookkeeping itself is `tools.chaos.continuity`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from tools.cdsim import workload
from tools.cdsim.layout import StateLayout
from tools.chaos import checks, continuity, job_ops
from tools.chaos.event_log import EventLog
from tools.chaos.tracking import ClusterHandle, SoakOptions, Tracked

T = TypeVar("T")

IMPORT_CHECK_INTERVAL_S = 5.0
# How long a job's domain may take to be Ready after its claims were prepared, before its
# workload's imports are left to the next quiescence; and how long the imports may take.
READY_WAIT_S = 60.0
IMPORT_TIMEOUT_S = 30.0
# At quiescence, a daemon that keeps not answering a job's import check is a violation.
IMPORT_CHECK_ATTEMPTS = 4


class ImportWatch:
    """The invariant 6 half of the soak (state and helpers below are the soak's)."""

    options: SoakOptions
    layout: StateLayout
    events: EventLog
    handle: ClusterHandle | None
    jobs: dict[tuple[str, str], Tracked]
    ledger: continuity.FaultLedger
    index_expected: dict[tuple[str, str], continuity.IndexExpectation]

    def _fail(self, text: str) -> None:
        raise NotImplementedError

    async def _import(self, tracked: Tracked, quiescent: bool) -> None:
        """Once the job's domain is Ready, its workload imports memory between all members.

        During the faults a domain that is not Ready soon enough, or imports that cannot be made
        (a member's node or daemon hit meanwhile), are left to the next quiescence; at a
        quiescence (every job Ready, no fault) they must succeed."""
        assert self.handle is not None and tracked.job is not None
        store = self.handle.store
        if tracked.job.num_nodes < 2:
            return  # one member imports from nobody: nothing for invariant 6 to watch
        if not quiescent:
            ready = await self._while_running(
                tracked, job_ops.wait_ready(store, tracked.job.domain_uid, READY_WAIT_S)
            )
            if not ready:
                if ready is False:
                    self.events.add("job", f"imports {job_ops.NOT_READY}", tracked.spec.describe())
                    self.events.counts[f"job imports {job_ops.NOT_READY}"] += 1
                return
        armed_s = self.events.elapsed() if quiescent else tracked.armed_s
        timeout_s = self.options.settle_s if quiescent else IMPORT_TIMEOUT_S
        outcome = await self._while_running(
            tracked, job_ops.make_imports(self.layout, store, tracked.job, timeout_s)
        )
        if outcome is None:
            return  # deleted meanwhile
        self.events.add("job", f"imports {outcome.result}", f"{tracked.spec.describe()}: {outcome.detail}")
        self.events.counts[f"job imports {outcome.result}"] += 1
        if tracked.state != "running":
            return  # deleted meanwhile
        if outcome.result == job_ops.IMPORTED and outcome.job is not None:
            tracked.job, tracked.importers = outcome.job, outcome.job.importers
            tracked.armed_s, tracked.exempt_noted = armed_s, False
        elif quiescent:
            self._fail(
                f"live: {tracked.spec.describe()} is Ready but its workload cannot import: {outcome.detail}"
            )

    async def _while_running(self, tracked: Tracked, work: Coroutine[Any, Any, T]) -> T | None:
        """`work`'s result, or None once the job is no longer running (deleted meanwhile)."""
        task = asyncio.ensure_future(work)
        while not task.done():
            if tracked.state != "running":
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
            await asyncio.wait({task}, timeout=0.25)
        return task.result()

    def _exemption(self, tracked: Tracked) -> continuity.NodeFault | None:
        """The fault that may have broken the job's imports since it was armed, noted once."""
        nodes = set(tracked.job.nodes) if tracked.job is not None else set()
        fault = self.ledger.exempting(nodes, tracked.armed_s)
        if fault is not None and not tracked.exempt_noted:
            tracked.exempt_noted = True
            self.events.counts[f"check inv6 jobs exempted ({fault.kind})"] += 1
            self.events.add("note", "inv6 exempt", f"{tracked.spec.describe()}: {fault.describe()}")
        return fault

    def _live_domains(self) -> set[str]:
        out = set()
        for tracked in self.jobs.values():
            if tracked.state in ("deleting", "deleting-incomplete", "broken"):
                continue
            job = tracked.job or job_ops.book_job(self.layout, *tracked.spec.key)
            if job is not None:
                out.add(job.domain_uid)
        return out

    async def _check_imports_forever(self) -> None:
        while True:
            await asyncio.sleep(IMPORT_CHECK_INTERVAL_S)
            await self._check_indices(quiescent=False)
            await self._check_imports(quiescent=False)

    async def _check_indices(self, quiescent: bool) -> None:
        """Killed member nodes come back with the index they held (any other index: at once)."""
        if not self.index_expected:
            return
        assert self.handle is not None
        try:
            members, daemons = await checks.members_and_daemons(self.handle.store)
        except job_ops.CALL_FAILURES:
            if quiescent:
                raise
            return
        live = self._live_domains()
        violations, settled = continuity.index_findings(
            list(self.index_expected.values()), members, daemons, live, quiescent
        )
        for expectation in settled:
            self.index_expected.pop(expectation.key, None)
            if expectation.domain_uid in live:
                e = expectation
                self.events.add(
                    "check",
                    "inv6 node back",
                    f"{e.node} took index {e.index} of {e.job} again",
                    count="check inv6 killed node back with its index",
                )
        for text in violations:
            self._fail(text)

    async def _check_imports(self, quiescent: bool) -> None:
        """Every running job armed and not exempt has intact imports. A daemon that does not
        answer is asked again at a quiescence (a violation if it never does); during the faults
        it is left to the next round."""
        armed = [
            (t, t.armed_s, t.importers)
            for t in sorted(self.jobs.values(), key=lambda t: t.spec.key)
            if t.state == "running" and t.importers and self._exemption(t) is None
        ]
        where = " (quiescence)" if quiescent else ""
        for attempt in range(IMPORT_CHECK_ATTEMPTS if quiescent else 1):
            if attempt:
                await asyncio.sleep(1.0)
            reports = await asyncio.gather(*(workload.check(t.spec.name, imp) for t, _, imp in armed))
            silent = []
            for (tracked, armed_s, importers), report in zip(armed, reports, strict=True):
                # Deleted, hit by a fault that may break it, or imported anew while it was asked.
                if tracked.state != "running" or tracked.armed_s != armed_s or self._exemption(tracked):
                    continue
                final = quiescent and attempt == IMPORT_CHECK_ATTEMPTS - 1
                if self._judge(tracked, armed_s, report, where, final):
                    silent.append((tracked, armed_s, importers))
            armed = silent
            if not armed:
                return

    async def _check_before_delete(self, tracked: Tracked) -> None:
        """A running job's imports once more, just before it is deleted (most jobs live shorter
        than the periodic check's interval)."""
        armed_s, importers = tracked.armed_s, tracked.importers
        if not importers or self._exemption(tracked) is not None:
            return
        report = await workload.check(tracked.spec.name, importers)
        if self._exemption(tracked) is None:
            self._judge(tracked, armed_s, report, " (before delete)", final=False)

    def _judge(
        self, tracked: Tracked, armed_s: float, report: workload.ImportReport, where: str, final: bool
    ) -> bool:
        """Count an intact check or fail a broken one; True: a daemon was silent, ask again."""
        verdict = continuity.verdict(report)
        if verdict == continuity.INTACT:
            self.events.counts[f"check inv6 job imports intact{where}"] += 1
            return False
        if verdict == continuity.BROKEN or final:
            self._fail(continuity.broken_imports(tracked.spec.describe(), report, armed_s))
            return False
        self.events.counts["check inv6 job imports inconclusive (daemon silent)"] += 1
        return True
