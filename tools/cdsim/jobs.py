"""`cdsim job submit` and `cdsim job delete`: a job's domain and claims, with kubelet played here.

Submit: ask the advisor where N nodes go (Place, reserved) -> create the ComputeDomain and one
allocated channel claim per node in the store -> NodePrepareResources on every chosen node's DRA
socket at once, retried like kubelet -> release the reservation (the nodes are bound now) ->
optionally wait for the domain to be Ready -> print the timeline.

Delete: NodeUnprepareResources for every claim -> delete the claims -> mark the domain deleting
-> optionally wait until the controller has removed it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TextIO

from libs.contract.store_claims import store_claim, store_domain
from libs.gen.computedomain.state import v1 as pb
from libs.kube.names import subdomain_problem
from libs.runtime.cancellation import cancel_until_done
from libs.state.keys import Keys
from libs.state.store import Delete, Put, Store
from libs.state.watch import Resync, watch_prefix
from tools.cdsim import advisor, credentials, kubelet, workload
from tools.cdsim.job_book import ClaimRecord, Job, JobBook, JobList
from tools.cdsim.layout import StateLayout
from tools.cdsim.lifecycle import CommandError
from tools.cdsim.progress import Progress
from tools.cdsim.run_state import RunState
from tools.cdsim.timeline import SubmitTimeline
from tools.sim.hardware.cluster import ClusterDescription

# etcd refuses transactions with more operations than this (its --max-txn-ops default).
_MAX_TXN_OPS = 128


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class SubmitOptions:
    name: str
    num_nodes: int
    namespace: str = "default"
    all_channels: bool = False
    wait: bool = False
    placement: str = "single-clique"
    prepare_deadline_s: float = 120.0
    ready_timeout_s: float = 60.0


@dataclass(frozen=True)
class WaitOptions:
    name: str
    namespace: str = "default"
    status: str = "Ready"  # Ready | NotReady
    reason: str = ""
    timeout_s: float = 60.0


@dataclass(frozen=True)
class DeleteOptions:
    name: str
    namespace: str = "default"
    wait: bool = False
    timeout_s: float = 60.0


def build_domain(job: Job, now_ms: int) -> pb.ComputeDomain:
    return store_domain(
        uid=job.domain_uid,
        namespace=job.namespace,
        name=job.name,
        num_nodes=job.num_nodes,
        allocation_mode=job.allocation_mode,
        created_unix_ms=now_ms,
    )


def build_claim(record: ClaimRecord, domain_uid: str, allocation_mode: str, now_ms: int) -> pb.Claim:
    """The claim as the scheduler would have allocated it: channel-0 of the node's pool."""
    return store_claim(
        uid=record.uid,
        namespace=record.namespace,
        name=record.name,
        node=record.node,
        domain_uid=domain_uid,
        allocation_mode=allocation_mode,
        created_unix_ms=now_ms,
    )


def check_nodes(num_nodes: int, cluster: ClusterDescription) -> None:
    """--nodes is at least 1 and at most the cluster's size; CommandError naming both otherwise."""
    size = sum(1 for _ in cluster.node_names())
    if num_nodes < 1:
        raise CommandError(f"--nodes must be >= 1, got {num_nodes}")
    if num_nodes > size:
        raise CommandError(f"--nodes {num_nodes}: the cluster has {size} nodes (`cdsim status` shows them)")


def claim_name(job_name: str, index: int) -> str:
    return f"{job_name}-worker-{index}-channel"


def plan_claims(name: str, namespace: str, nodes: list[str], first: int = 0) -> tuple[ClaimRecord, ...]:
    """One claim per node, named like the claims of a job's pods (`<job>-worker-<i>-channel`).

    `first` numbers the workers of a job that grows after the ones it has.
    """
    return tuple(
        ClaimRecord(uid=str(uuid.uuid4()), name=claim_name(name, i), namespace=namespace, node=node)
        for i, node in enumerate(nodes, start=first)
    )


def claim_call(layout: StateLayout, record: ClaimRecord) -> kubelet.ClaimCall:
    return kubelet.ClaimCall(
        namespace=record.namespace,
        name=record.name,
        uid=record.uid,
        node=record.node,
        socket=layout.node(record.node).dra_socket,
    )


def running_state(layout: StateLayout) -> RunState:
    state = RunState.load(layout)
    if state is None or state.phase != "ready":
        raise CommandError(f"no running cdsim cluster in {layout.root}; start one with `cdsim up`")
    return state


def open_store(state: RunState) -> Store:
    return Store(credentials.etcd_config(state))


async def find_domain(store: Store, namespace: str, name: str) -> pb.ComputeDomain | None:
    domains, _ = await store.list(store.keys.domains(), pb.ComputeDomain)
    return next((d.value for d in domains if (d.value.namespace, d.value.name) == (namespace, name)), None)


def _rack_of(cluster: ClusterDescription, nodes: list[str]) -> str:
    racks = sorted({cluster.node(n).rack for n in nodes})
    return ", ".join(f"rack{r}" for r in racks)


async def _create_records(store: Store, job: Job) -> None:
    keys: Keys = store.keys
    if not await store.create(keys.domain(job.domain_uid), build_domain(job, _now_ms())):
        raise CommandError(f"domain {job.domain_uid} exists already")
    await create_claims(store, job, job.claims)


async def create_claims(store: Store, job: Job, claims: Sequence[ClaimRecord]) -> None:
    """The job's claims as the scheduler would have allocated them, in as few transactions as can be."""
    now = _now_ms()
    puts = [
        Put(store.keys.claim(c.uid), build_claim(c, job.domain_uid, job.allocation_mode, now)) for c in claims
    ]
    for start in range(0, len(puts), _MAX_TXN_OPS):
        await store.txn([], puts[start : start + _MAX_TXN_OPS])


async def delete_claims(store: Store, claims: Sequence[ClaimRecord]) -> None:
    for start in range(0, len(claims), _MAX_TXN_OPS):
        await store.txn([], [Delete(store.keys.claim(c.uid)) for c in claims[start : start + _MAX_TXN_OPS]])


async def _watch_daemons_ready(store: Store, domain_uid: str, seen: dict[str, int]) -> None:
    """Record when each node's IMEX daemon is first seen READY (runs until cancelled)."""
    async for item in watch_prefix(store, store.keys.daemons(domain_uid), pb.DaemonStatus):
        now = _now_ms()
        values = (
            [v.value for v in item.items] if isinstance(item, Resync) else [item.value] if item.value else []
        )
        for status in values:
            if status.state == pb.DaemonState.READY and status.node_name not in seen:
                seen[status.node_name] = now


async def wait_domain(
    store: Store, domain_uid: str, done: Callable[[pb.ComputeDomain | None], bool], timeout_s: float
) -> pb.ComputeDomain | None:
    """Poll the domain record until `done(record)`; raise TimeoutError after `timeout_s`."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        found = await store.get(store.keys.domain(domain_uid), pb.ComputeDomain)
        record = found.value if found else None
        if done(record):
            return record
        if loop.time() > end:
            raise TimeoutError
        await asyncio.sleep(0.05)


def readiness_reason(domain: pb.ComputeDomain | None) -> str:
    if domain is None:
        return "domain record gone"
    for condition in domain.status.conditions:
        if condition.type == "Ready":
            return f"{condition.reason}: {condition.message}"
    return "no Ready condition yet"


async def submit(layout: StateLayout, options: SubmitOptions, out: TextIO) -> Job:
    state = running_state(layout)
    cluster = ClusterDescription.load(layout.cluster_file)
    book = JobBook(layout.jobs_file)
    check_nodes(options.num_nodes, cluster)
    longest_claim = claim_name(options.name, options.num_nodes - 1)
    problem = subdomain_problem(longest_claim)
    if problem:
        raise CommandError(
            f"job name {options.name!r} is too long for its claims' names ({problem}); choose a shorter name"
        )
    if book.read().find(options.namespace, options.name) is not None:
        raise CommandError(f"job {options.namespace}/{options.name} exists already; delete it first")
    async with open_store(state) as store:
        if await find_domain(store, options.namespace, options.name) is not None:
            raise CommandError(f"a ComputeDomain {options.namespace}/{options.name} exists already")
        timeline = SubmitTimeline(started_ms=_now_ms())
        domain_uid = str(uuid.uuid4())
        holder = f"cdsim/{options.name}"
        try:
            placement = await advisor.place(
                state.advisor_endpoint,
                options.num_nodes,
                domain_uid,
                options.placement,
                holder,
                tls=credentials.advisor_tls(state),
            )
        except advisor.PlacementRefused as exc:
            raise CommandError(
                f"cannot place job {options.namespace}/{options.name} ({options.num_nodes} nodes): "
                f"the placement advisor says {exc}. Nothing was created."
            ) from None
        timeline.placed_ms = _now_ms()
        clique_text = ", ".join(c[-12:] for c in placement.cliques)
        timeline.placement_note = (
            f"{len(placement.nodes)} nodes in {_rack_of(cluster, placement.nodes)} (clique …{clique_text}), "
            f"reservation {placement.reservation_id or '-'}"
        )
        job = Job(
            name=options.name,
            namespace=options.namespace,
            domain_uid=domain_uid,
            num_nodes=options.num_nodes,
            allocation_mode="All" if options.all_channels else "Single",
            state="submitting",
            created_unix_ms=timeline.started_ms,
            claims=plan_claims(options.name, options.namespace, placement.nodes),
            reservation_id=placement.reservation_id,
        )
        book.update(lambda jobs: jobs.put(job))
        await _create_records(store, job)
        timeline.created_ms = _now_ms()
        timeline.created_note = f"ComputeDomain {job.namespace}/{job.name} (uid {domain_uid}) and {len(job.claims)} allocated channel claims"
        out.write(
            f"Job {job.namespace}/{job.name}: ComputeDomain {domain_uid} on {len(job.claims)} nodes "
            f"({_rack_of(cluster, job.nodes)}); preparing claims like kubelet would…\n"
        )
        out.flush()
        outcomes = await _prepare_all(layout, store, job, options, timeline, out)
        failed = [o for o in outcomes if not o.ok]
        if failed:
            book.update(lambda jobs: jobs.put(replace(job, state="failed")))
            details = "\n".join(
                f"  {o.claim.node}: {o.last_error} ({o.attempts} attempts)" for o in failed[:10]
            )
            raise CommandError(
                f"{len(failed)} of {len(outcomes)} claims could not be prepared within "
                f"{options.prepare_deadline_s:.0f}s:\n{details}\n"
                f"See `cdctl describe domain {job.name} -n {job.namespace}`; remove the job with "
                f"`cdsim job delete {job.name} -n {job.namespace}`."
            )
        job = replace(job, state="running")
        book.update(lambda jobs: jobs.put(job))
        await advisor.release(
            state.advisor_endpoint,
            placement.reservation_id,
            holder=holder,
            tls=credentials.advisor_tls(state),
        )
        members, _ = await store.list(store.keys.members(domain_uid), pb.Member)
        timeline.joined = {m.value.node_name: (m.value.joined_unix_ms, m.value.index) for m in members}
        if options.wait:
            try:
                await wait_domain(
                    store,
                    domain_uid,
                    lambda d: d is not None and d.status.status == pb.Readiness.READY,
                    options.ready_timeout_s,
                )
                timeline.domain_ready_ms = _now_ms()
            except TimeoutError:
                record = await store.get(store.keys.domain(domain_uid), pb.ComputeDomain)
                raise CommandError(
                    f"all claims are prepared but the domain is not Ready after {options.ready_timeout_s:.0f}s "
                    f"({readiness_reason(record.value if record else None)})"
                ) from None
            try:
                importers = await workload.import_all(store, domain_uid, job.name, options.ready_timeout_s)
            except TimeoutError as exc:
                raise CommandError(
                    f"the domain is Ready but the job's workload could not import: {exc}"
                ) from None
            job = replace(job, importers=tuple(importers))
            book.update(lambda jobs: jobs.put(job))
            timeline.imported_ms = _now_ms()
            timeline.imports = sum(len(i.sources) for i in importers)
    out.write(f"Timeline of {job.namespace}/{job.name} (since submit):\n")
    for line in timeline.lines(len(job.claims)):
        out.write(f"  {line}\n")
    out.flush()
    return job


async def wait(layout: StateLayout, options: WaitOptions, out: TextIO) -> None:
    """Wait until the job's domain shows `status` (and, if given, the Ready condition's `reason`)."""
    state = running_state(layout)
    job = JobBook(layout.jobs_file).read().find(options.namespace, options.name)
    if job is None:
        raise CommandError(f"no job {options.namespace}/{options.name} (see `cdsim status`)")
    want = pb.Readiness.READY if options.status == "Ready" else pb.Readiness.NOT_READY

    def reached(domain: pb.ComputeDomain | None) -> bool:
        if domain is None or domain.status.status != want:
            return False
        if not options.reason:
            return True
        condition = next((c for c in domain.status.conditions if c.type == "Ready"), None)
        return condition is not None and condition.reason == options.reason

    began = time.monotonic()
    async with open_store(state) as store:
        try:
            domain = await wait_domain(store, job.domain_uid, reached, options.timeout_s)
        except TimeoutError:
            record = await store.get(store.keys.domain(job.domain_uid), pb.ComputeDomain)
            current = record.value if record else None
            shown = (
                "gone"
                if current is None
                else ("Ready" if current.status.status == pb.Readiness.READY else "NotReady")
            )
            raise CommandError(
                f"{job.namespace}/{job.name} did not become {options.status}"
                f"{' (' + options.reason + ')' if options.reason else ''} within {options.timeout_s:.0f}s; "
                f"it is {shown} ({readiness_reason(current)})"
            ) from None
    out.write(
        f"{job.namespace}/{job.name} is {options.status} after {time.monotonic() - began:.1f}s "
        f"({readiness_reason(domain)})\n"
    )


async def _prepare_all(
    layout: StateLayout,
    store: Store,
    job: Job,
    options: SubmitOptions,
    timeline: SubmitTimeline,
    out: TextIO,
) -> list[kubelet.CallOutcome]:
    progress = Progress(len(job.claims), "claims prepared", out)
    progress.show()
    watcher = asyncio.create_task(_watch_daemons_ready(store, job.domain_uid, timeline.daemon_ready))

    async def one(record: ClaimRecord) -> kubelet.CallOutcome:
        outcome = await kubelet.prepare(claim_call(layout, record), options.prepare_deadline_s)
        if outcome.ok:
            timeline.prepared[record.node] = (outcome.finished_unix_ms, outcome.attempts)
            progress.advance(f"last: {record.node}")
        return outcome

    try:
        outcomes = await asyncio.gather(*(one(c) for c in job.claims))
    finally:
        # Not cancel + suppress(CancelledError): that would also swallow a cancellation of this task.
        await cancel_until_done([watcher], 5.0)
    # A READY the watch has not delivered yet: take the time the agent wrote it.
    statuses, _ = await store.list(store.keys.daemons(job.domain_uid), pb.DaemonStatus)
    for status in statuses:
        if status.value.state == pb.DaemonState.READY:
            timeline.daemon_ready.setdefault(status.value.node_name, status.value.updated_unix_ms)
    return list(outcomes)


async def delete(layout: StateLayout, options: DeleteOptions, out: TextIO) -> None:
    state = running_state(layout)
    book = JobBook(layout.jobs_file)
    job = book.read().find(options.namespace, options.name)
    if job is None:
        raise CommandError(f"no job {options.namespace}/{options.name} (see `cdsim status`)")
    began = time.monotonic()
    job = replace(job, state="deleting")
    book.update(lambda jobs: jobs.put(job))
    calls = [claim_call(layout, c) for c in job.claims]
    progress = Progress(len(calls), "claims unprepared", out)
    progress.show()

    async def one(call: kubelet.ClaimCall) -> kubelet.CallOutcome:
        outcome = await kubelet.unprepare(call, options.timeout_s)
        if outcome.ok:
            progress.advance(f"last: {call.node}")
        return outcome

    outcomes = await asyncio.gather(*(one(c) for c in calls))
    failed = [o for o in outcomes if not o.ok]
    if failed:
        details = "\n".join(f"  {o.claim.node}: {o.last_error}" for o in failed[:10])
        raise CommandError(f"{len(failed)} claims could not be unprepared (retry the delete):\n{details}")
    async with open_store(state) as store:
        keys = store.keys
        await delete_claims(store, job.claims)

        def mark_deleting(domain: pb.ComputeDomain | None) -> pb.ComputeDomain | None:
            if domain is None or domain.deleting:
                return None
            domain.deleting = True
            domain.deletion_requested_unix_ms = _now_ms()
            return domain

        await store.update(keys.domain(job.domain_uid), pb.ComputeDomain, mark_deleting)
        if not options.wait:
            out.write(
                f"Job {job.namespace}/{job.name}: {len(calls)} claims unprepared and deleted; the controller "
                f"now tears domain {job.domain_uid} down (`cdsim status` shows it).\n"
            )
            return
        try:
            await wait_domain(store, job.domain_uid, lambda d: d is None, options.timeout_s)
        except TimeoutError:
            record = await store.get(keys.domain(job.domain_uid), pb.ComputeDomain)
            raise CommandError(
                f"domain {job.domain_uid} still exists after {options.timeout_s:.0f}s "
                f"({readiness_reason(record.value if record else None)})"
            ) from None
    book.update(lambda jobs: jobs.remove(job.namespace, job.name))
    out.write(
        f"Job {job.namespace}/{job.name} deleted in {(time.monotonic() - began) * 1000:.0f} ms: "
        f"{len(calls)} claims unprepared, domain {job.domain_uid} torn down.\n"
    )


async def prune_finished(layout: StateLayout, store: Store) -> JobList:
    """Forget jobs whose deletion has completed (their domain record is gone)."""
    book = JobBook(layout.jobs_file)
    jobs = book.read()
    gone = []
    for job in jobs.jobs:
        if (
            job.state == "deleting"
            and await store.get(store.keys.domain(job.domain_uid), pb.ComputeDomain) is None
        ):
            gone.append(job.key)
    if not gone:
        return jobs

    def drop(current: JobList) -> None:
        for namespace, name in gone:
            current.remove(namespace, name)

    return book.update(drop)


@dataclass(frozen=True)
class CheckOptions:
    name: str
    namespace: str = "default"


async def check_job(layout: StateLayout, options: CheckOptions, out: TextIO) -> None:
    """Exit 0 only if every import the job's workload made is still valid."""
    job = JobBook(layout.jobs_file).read().find(options.namespace, options.name)
    if job is None:
        raise CommandError(f"no job {options.namespace}/{options.name} (see `cdsim status`)")
    if not job.importers:
        raise CommandError(
            f"job {job.namespace}/{job.name} has made no imports (it is made after Ready by "
            f"`cdsim job submit --wait`)"
        )
    report = await workload.check(job.name, job.importers)
    if not report.intact:
        problems = "\n".join(f"  {p}" for p in report.problems)
        raise CommandError(
            f"job {job.namespace}/{job.name}: {report.valid} of {report.expected} imports valid:\n{problems}"
        )
    out.write(f"job {job.namespace}/{job.name}: all {report.expected} imports valid\n")
