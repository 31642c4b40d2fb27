"""`cdsim job scale NAME --nodes N`: grow (or shrink) a running job, the way a job adds pods.

Growing: ask the placement advisor for the extra nodes inside the job's own clique (its current
nodes excluded), raise the domain's numNodes, create one allocated claim per new node, prepare
them like kubelet, release the reservation, wait until the domain is Ready with every node, then
let the workload import between the new members and everyone else. Imports made before are
never made again: the existing members keep their daemons, instances and imports untouched.

Shrinking: the last nodes added go first: lower numNodes, unprepare and delete their claims, wait
until they have left the domain and it is Ready again. The remaining members' imports from each
other stay; the imports from the nodes that left are no longer expected.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TextIO

from libs.gen.computedomain.state import v1 as pb
from libs.state.store import Store
from tools.cdsim import advisor, credentials, kubelet, workload
from tools.cdsim.job_book import ClaimRecord, Job, JobBook
from tools.cdsim.jobs import (
    check_nodes,
    claim_call,
    create_claims,
    delete_claims,
    open_store,
    plan_claims,
    readiness_reason,
    running_state,
    wait_domain,
)
from tools.cdsim.layout import StateLayout
from tools.cdsim.lifecycle import CommandError
from tools.cdsim.run_state import RunState
from tools.sim.hardware.cluster import ClusterDescription


@dataclass(frozen=True)
class ScaleOptions:
    name: str
    num_nodes: int
    namespace: str = "default"
    prepare_deadline_s: float = 120.0
    ready_timeout_s: float = 60.0


def ready_with(nodes: Sequence[str]) -> Callable[[pb.ComputeDomain | None], bool]:
    """A predicate: the domain is Ready and its status shows exactly `nodes`, each one Ready."""
    wanted = set(nodes)

    def done(domain: pb.ComputeDomain | None) -> bool:
        if domain is None or domain.status.status != pb.Readiness.READY:
            return False
        shown = {n.name for n in domain.status.nodes}
        ready = {n.name for n in domain.status.nodes if n.status == pb.Readiness.READY}
        return shown == wanted and ready == wanted

    return done


async def scale(layout: StateLayout, options: ScaleOptions, out: TextIO) -> Job:
    state = running_state(layout)
    book = JobBook(layout.jobs_file)
    job = book.read().find(options.namespace, options.name)
    if job is None:
        raise CommandError(f"no job {options.namespace}/{options.name} (see `cdsim status`)")
    if job.state != "running":
        raise CommandError(f"job {job.namespace}/{job.name} is {job.state}, not running: it cannot be scaled")
    check_nodes(options.num_nodes, ClusterDescription.load(layout.cluster_file))
    if options.num_nodes == len(job.claims):
        out.write(f"Job {job.namespace}/{job.name} has {len(job.claims)} nodes already; nothing to do.\n")
        return job
    async with open_store(state) as store:
        if options.num_nodes > len(job.claims):
            job = await _grow(layout, state, store, book, job, options, out)
        else:
            job = await _shrink(layout, store, book, job, options, out)
        job = await _imports(store, book, job, options)
    out.write(
        f"Job {job.namespace}/{job.name} runs on {len(job.claims)} nodes: {', '.join(job.nodes)}; "
        f"{sum(len(i.sources) for i in job.importers)} imports between its members.\n"
    )
    return job


async def _clique_of(store: Store, layout: StateLayout, job: Job) -> str:
    members, _ = await store.list(store.keys.members(job.domain_uid), pb.Member)
    cliques = {m.value.clique_id for m in members if m.value.clique_id}
    if not cliques:  # no member record (yet): the cluster description knows the nodes' cliques
        cluster = ClusterDescription.load(layout.cluster_file)
        cliques = {cluster.node(n).clique for n in job.nodes}
    if len(cliques) != 1:
        raise CommandError(
            f"job {job.namespace}/{job.name} spans {len(cliques)} cliques; only a job in one clique can grow"
        )
    return next(iter(cliques))


async def _set_num_nodes(store: Store, job: Job, num_nodes: int) -> None:
    def change(domain: pb.ComputeDomain | None) -> pb.ComputeDomain | None:
        if domain is None or domain.spec.num_nodes == num_nodes:
            return None
        domain.spec.num_nodes = num_nodes
        return domain

    await store.update(store.keys.domain(job.domain_uid), pb.ComputeDomain, change)


async def _wait_ready(store: Store, job: Job, timeout_s: float, what: str) -> None:
    try:
        await wait_domain(store, job.domain_uid, ready_with(job.nodes), timeout_s)
    except TimeoutError:
        record = await store.get(store.keys.domain(job.domain_uid), pb.ComputeDomain)
        raise CommandError(
            f"{what}, but the domain is not Ready with all {len(job.claims)} nodes after {timeout_s:.0f}s "
            f"({readiness_reason(record.value if record else None)})"
        ) from None


async def _grow(
    layout: StateLayout,
    state: RunState,
    store: Store,
    book: JobBook,
    job: Job,
    options: ScaleOptions,
    out: TextIO,
) -> Job:
    clique = await _clique_of(store, layout, job)
    extra = options.num_nodes - len(job.claims)
    holder = f"cdsim/{job.name}"
    try:
        placement = await advisor.place(
            state.advisor_endpoint,
            extra,
            job.domain_uid,
            "single-clique",
            holder,
            node_selector={"clique": clique},
            excluded_nodes=job.nodes,
            tls=credentials.advisor_tls(state),
        )
    except advisor.PlacementRefused as exc:
        raise CommandError(
            f"cannot grow job {job.namespace}/{job.name} by {extra} nodes in its clique {clique}: the "
            f"placement advisor says {exc}. Nothing was changed."
        ) from None
    added = plan_claims(job.name, job.namespace, placement.nodes, first=len(job.claims))
    # Recorded before anything is created: `cdsim job delete` then cleans up whatever happens next.
    job = replace(job, num_nodes=options.num_nodes, claims=job.claims + added)
    book.update(lambda jobs: jobs.put(job))
    out.write(
        f"Job {job.namespace}/{job.name}: adding {', '.join(placement.nodes)}; preparing their claims…\n"
    )
    out.flush()
    await _set_num_nodes(store, job, options.num_nodes)
    await create_claims(store, job, added)
    outcomes = await asyncio.gather(
        *(kubelet.prepare(claim_call(layout, c), options.prepare_deadline_s) for c in added)
    )
    await advisor.release(
        state.advisor_endpoint, placement.reservation_id, holder=holder, tls=credentials.advisor_tls(state)
    )
    failed = [o for o in outcomes if not o.ok]
    if failed:
        details = "\n".join(f"  {o.claim.node}: {o.last_error} ({o.attempts} attempts)" for o in failed)
        raise CommandError(
            f"{len(failed)} of {len(added)} new claims could not be prepared within "
            f"{options.prepare_deadline_s:.0f}s:\n{details}"
        )
    await _wait_ready(store, job, options.ready_timeout_s, f"{len(added)} new claims are prepared")
    return job


async def _shrink(
    layout: StateLayout, store: Store, book: JobBook, job: Job, options: ScaleOptions, out: TextIO
) -> Job:
    kept, removed = job.claims[: options.num_nodes], job.claims[options.num_nodes :]
    out.write(f"Job {job.namespace}/{job.name}: removing {', '.join(c.node for c in removed)}…\n")
    out.flush()
    await _set_num_nodes(store, job, options.num_nodes)
    outcomes = await asyncio.gather(
        *(kubelet.unprepare(claim_call(layout, c), options.prepare_deadline_s) for c in removed)
    )
    failed = [o for o in outcomes if not o.ok]
    if failed:
        details = "\n".join(f"  {o.claim.node}: {o.last_error}" for o in failed)
        raise CommandError(f"{len(failed)} claims could not be unprepared (retry the scale):\n{details}")
    await delete_claims(store, removed)
    job = replace(job, num_nodes=options.num_nodes, claims=kept)
    book.update(lambda jobs: jobs.put(job))
    await _wait_left(store, job, removed, options.ready_timeout_s)
    await _wait_ready(store, job, options.ready_timeout_s, f"{len(removed)} claims are unprepared")
    return job


async def _wait_left(store: Store, job: Job, removed: Sequence[ClaimRecord], timeout_s: float) -> None:
    """Until the removed nodes' member records are gone (their indices are free again)."""
    gone = {c.node for c in removed}
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        members, _ = await store.list(store.keys.members(job.domain_uid), pb.Member)
        left = sorted(m.value.node_name for m in members if m.value.node_name in gone)
        if not left:
            return
        if loop.time() > end:
            raise CommandError(f"{', '.join(left)} still members of the domain after {timeout_s:.0f}s")
        await asyncio.sleep(0.1)


async def _imports(store: Store, book: JobBook, job: Job, options: ScaleOptions) -> Job:
    """Imports between the new members and everyone else; the ones made before are left alone."""
    try:
        importers = await workload.import_all(
            store, job.domain_uid, job.name, options.ready_timeout_s, done=job.importers
        )
    except TimeoutError as exc:
        raise CommandError(f"the domain is Ready but the job's workload could not import: {exc}") from None
    job = replace(job, importers=tuple(importers))
    book.update(lambda jobs: jobs.put(job))
    return job
