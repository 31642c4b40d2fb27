"""Jobs of the soak: submitted, deleted and (after a fault storm) prepared again through cdsim;
once a job's domain is Ready its workload imports memory between its members (as `cdsim job
submit` does), which invariant 6 then checks.

Every operation ends in an outcome the soak counts; none raises for what chaos can cause (a
placement refused for lack of room, a prepare that missed its deadline while agents were being
killed, an etcd restart under a call). Those are not violations by themselves: the soak retries
at quiescence, as kubelet keeps retrying a pod's claims, and only what still fails then counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
import uuid
from dataclasses import dataclass, replace

import aetcd.exceptions
import grpclib.exceptions

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import TRANSIENT_ERRORS, Put, Store
from tools.cdsim import advisor, credentials, jobs, kubelet, workload
from tools.cdsim.job_book import Job, JobBook, JobList
from tools.cdsim.layout import StateLayout
from tools.cdsim.lifecycle import CommandError

MAX_TXN_OPS = 128  # etcd's --max-txn-ops default
RECORDS_DEADLINE_S = 30.0
# Beyond the deadlines the operation is given, before it counts as hung.
WATCHDOG_MARGIN_S = 90.0

# What an etcd restart or a killed service can throw at a cdsim call.
CALL_FAILURES: tuple[type[BaseException], ...] = (
    *TRANSIENT_ERRORS,
    aetcd.exceptions.ClientError,
    grpclib.exceptions.GRPCError,
    ConnectionError,
    OSError,
)

RECORD_FAILURES: tuple[type[BaseException], ...] = (*CALL_FAILURES, TimeoutError, CommandError)

SUBMITTED = "ok"
REFUSED = "refused (no room)"
ADVISOR_DOWN = "refused (advisor unreachable)"
PREPARE_LATE = "failed (prepare deadline)"
INTERRUPTED = "interrupted"
HUNG = "hung"
DELETED = "ok"
DELETE_INCOMPLETE = "incomplete"
IMPORTED = "ok"
NOT_READY = "postponed (domain not Ready)"
IMPORTS_LATE = "failed (imports not made)"
READY_POLL_S = 0.25


@dataclass(frozen=True)
class Outcome:
    result: str
    detail: str = ""
    job: Job | None = None


@dataclass(frozen=True)
class JobSpec:
    name: str
    namespace: str
    size: int
    all_channels: bool

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    def describe(self) -> str:
        mode = " All-channel" if self.all_channels else ""
        return f"{self.namespace}/{self.name} ({self.size} nodes{mode})"


def book_job(layout: StateLayout, namespace: str, name: str) -> Job | None:
    return JobBook(layout.jobs_file).read().find(namespace, name)


async def _create_records(store: Store, job: Job) -> None:
    now = int(time.time() * 1000)
    keys = store.keys
    if not await store.create(keys.domain(job.domain_uid), jobs.build_domain(job, now)):
        raise CommandError(f"domain {job.domain_uid} exists already")
    puts = [
        Put(keys.claim(c.uid), jobs.build_claim(c, job.domain_uid, job.allocation_mode, now))
        for c in job.claims
    ]
    for start in range(0, len(puts), MAX_TXN_OPS):
        await store.txn([], puts[start : start + MAX_TXN_OPS])


async def submit(layout: StateLayout, store: Store, spec: JobSpec, prepare_deadline_s: float) -> Outcome:
    """What `cdsim job submit` does (place, create, prepare like kubelet, release), minus its
    progress display and READY timeline; every step has a deadline, the whole a watchdog."""
    try:
        async with asyncio.timeout(prepare_deadline_s + WATCHDOG_MARGIN_S):
            return await _submit(layout, store, spec, prepare_deadline_s)
    except TimeoutError:
        job = book_job(layout, spec.namespace, spec.name)
        return Outcome(HUNG, f"no answer within {prepare_deadline_s + WATCHDOG_MARGIN_S:.0f}s", job)


async def _submit(layout: StateLayout, store: Store, spec: JobSpec, prepare_deadline_s: float) -> Outcome:
    state = jobs.running_state(layout)
    uid = str(uuid.uuid4())
    holder = f"chaos/{spec.name}"
    try:
        placement = await advisor.place(
            state.advisor_endpoint,
            spec.size,
            uid,
            "single-clique",
            holder,
            tls=credentials.advisor_tls(state),
        )
    except advisor.PlacementRefused as exc:
        text = str(exc)
        return Outcome(ADVISOR_DOWN if "not reachable" in text else REFUSED, text)
    except CALL_FAILURES as exc:
        return Outcome(ADVISOR_DOWN, f"{type(exc).__name__}: {exc}")
    job = Job(
        name=spec.name,
        namespace=spec.namespace,
        domain_uid=uid,
        num_nodes=spec.size,
        allocation_mode="All" if spec.all_channels else "Single",
        state="submitting",
        created_unix_ms=int(time.time() * 1000),
        claims=jobs.plan_claims(spec.name, spec.namespace, placement.nodes),
        reservation_id=placement.reservation_id,
    )
    book = JobBook(layout.jobs_file)
    book.update(lambda current: current.put(job))
    try:
        async with asyncio.timeout(RECORDS_DEADLINE_S):
            await _create_records(store, job)
    except RECORD_FAILURES as exc:
        return Outcome(INTERRUPTED, f"{type(exc).__name__}: {exc}", job)
    calls = [jobs.claim_call(layout, claim) for claim in job.claims]
    outcomes = await asyncio.gather(*(kubelet.prepare(call, prepare_deadline_s) for call in calls))
    failed = [o for o in outcomes if not o.ok]
    if failed:
        job = replace(job, state="failed")
        book.update(lambda current: current.put(job))
        detail = "; ".join(f"{o.claim.node}: {o.last_error}" for o in failed[:5])
        return Outcome(PREPARE_LATE, f"{len(failed)}/{len(outcomes)} claims not prepared: {detail}", job)
    job = replace(job, state="running")
    book.update(lambda current: current.put(job))
    await advisor.release(
        state.advisor_endpoint, placement.reservation_id, holder=holder, tls=credentials.advisor_tls(state)
    )
    return Outcome(SUBMITTED, f"on {', '.join(job.nodes)}", job)


async def delete(layout: StateLayout, job: Job, timeout_s: float) -> Outcome:
    """`cdsim job delete --wait` (unprepare, delete the claims, mark deleting, wait), watched."""
    options = jobs.DeleteOptions(name=job.name, namespace=job.namespace, wait=True, timeout_s=timeout_s)
    try:
        # Unprepare and the wait for the domain each take up to timeout_s.
        async with asyncio.timeout(2 * timeout_s + WATCHDOG_MARGIN_S):
            await jobs.delete(layout, options, io.StringIO())
    except TimeoutError:
        return Outcome(HUNG, f"no answer within {2 * timeout_s + WATCHDOG_MARGIN_S:.0f}s", job)
    except CommandError as exc:
        return Outcome(DELETE_INCOMPLETE, str(exc).strip(), job)
    except CALL_FAILURES as exc:
        return Outcome(DELETE_INCOMPLETE, f"{type(exc).__name__}: {exc}", job)
    return Outcome(DELETED, f"domain {job.domain_uid} gone", job)


async def prepare_again(layout: StateLayout, job: Job, deadline_s: float) -> Outcome:
    """Prepare every claim of a job whose submission gave up (kubelet would still be retrying)."""
    calls = [jobs.claim_call(layout, claim) for claim in job.claims]
    try:
        async with asyncio.timeout(deadline_s + WATCHDOG_MARGIN_S):
            outcomes = await asyncio.gather(*(kubelet.prepare(call, deadline_s) for call in calls))
    except TimeoutError:
        return Outcome(HUNG, f"no answer within {deadline_s + WATCHDOG_MARGIN_S:.0f}s", job)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        detail = "; ".join(f"{o.claim.node}: {o.last_error}" for o in failed[:5])
        return Outcome(PREPARE_LATE, f"{len(failed)}/{len(outcomes)} claims: {detail}", job)
    running = replace(job, state="running")
    JobBook(layout.jobs_file).update(lambda book: book.put(running))
    return Outcome(SUBMITTED, "all claims prepared", running)


async def wait_ready(store: Store, domain_uid: str, timeout_s: float) -> bool:
    """Whether the job's domain is Ready within `timeout_s` (store errors are waited out)."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                with contextlib.suppress(*CALL_FAILURES):
                    found = await store.get(store.keys.domain(domain_uid), pb.ComputeDomain)
                    if found is not None and found.value.status.status == pb.Readiness.READY:
                        return True
                await asyncio.sleep(READY_POLL_S)
    except TimeoutError:
        return False


async def make_imports(layout: StateLayout, store: Store, job: Job, timeout_s: float) -> Outcome:
    """The job's workload imports memory from every other member (`workload.import_all`); the
    job book keeps who imported what, as `cdsim job submit` leaves it for `cdsim job check`."""
    try:
        async with asyncio.timeout(timeout_s + WATCHDOG_MARGIN_S):
            importers = await workload.import_all(store, job.domain_uid, job.name, timeout_s)
    except TimeoutError as exc:
        return Outcome(
            IMPORTS_LATE, str(exc) or f"no answer within {timeout_s + WATCHDOG_MARGIN_S:.0f}s", job
        )
    except CALL_FAILURES as exc:
        return Outcome(IMPORTS_LATE, f"{type(exc).__name__}: {exc}", job)
    imported = replace(job, importers=tuple(importers))

    def keep(book: JobList) -> None:
        if book.find(job.namespace, job.name) is not None:  # not deleted meanwhile
            book.put(imported)

    JobBook(layout.jobs_file).update(keep)
    count = sum(len(i.sources) for i in importers)
    return Outcome(IMPORTED, f"{count} imports between {len(importers)} members", imported)
