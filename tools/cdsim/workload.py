"""A job's simulated workload: memory imports between the IMEX daemons of its domain.

A real multi-node job maps memory that other nodes exported, through IMEX. Its CUDA calls keep
working only while every exporter is the same daemon instance that exported it: a restarted
daemon is a new instance and peers drop its exports (the job then fails with "invalid resource
handle"). The simulated daemon models exactly that (``IMPORT`` / ``IMPORTS`` on its command
service), so a job here imports from every other member of its clique once the domain is Ready,
and ``cdsim job check`` asks every member whether all of its imports are still valid. That is
the measure of continuity: a fault that does not kill one of the job's nodes must leave them
valid.

`expected_imports` and `judge` are pure; the rest talks to the daemons' command services.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from libs.gen.computedomain.state import v1 as pb
from libs.imex import config as imexcfg
from libs.runtime.backoff import Backoff
from libs.state.store import Store
from tools.cdsim.job_book import Importer
from tools.sim.imex import client as simclient

QUERY_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ImportReport:
    """What the members' daemons say about one job's imports."""

    expected: int
    valid: int
    problems: tuple[str, ...] = field(default=())

    @property
    def intact(self) -> bool:
        return self.expected > 0 and self.valid == self.expected and not self.problems


def expected_imports(members: Sequence[pb.Member]) -> list[Importer]:
    """Who imports from whom: each fabric member from every other member of its clique (pure)."""
    fabric = [m for m in members if m.index >= 0 and m.clique_id]
    out = []
    for m in sorted(fabric, key=lambda m: (m.clique_id, m.index)):
        sources = tuple(sorted(o.index for o in fabric if o.clique_id == m.clique_id and o is not m))
        out.append(Importer(m.node_name, m.ip_address, sources))
    return out


def judge(job: str, importer: Importer, found: Sequence[simclient.Import] | None) -> tuple[int, list[str]]:
    """Valid imports of `importer` for `job`, and what is wrong with the others (pure)."""
    if found is None:
        return 0, [f"{importer.node}: IMEX daemon not reachable (its imports are gone with it)"]
    mine = {i.node_id: i for i in found if i.job == job}
    valid = 0
    problems = []
    for source in importer.sources:
        entry = mine.get(source)
        if entry is None:
            problems.append(f"{importer.node}: no import from node ID {source}")
        elif not entry.valid:
            problems.append(f"{importer.node}: import from node ID {source} invalid ({entry.reason})")
        else:
            valid += 1
    return valid, problems


async def _members(store: Store, domain_uid: str) -> list[pb.Member]:
    records, _ = await store.list(store.keys.members(domain_uid), pb.Member)
    return [r.value for r in records]


def missing_pairs(wanted: Sequence[Importer], done: Sequence[Importer]) -> list[tuple[Importer, int]]:
    """(importer, source) pairs of `wanted` that `done` has not imported yet (pure).

    An import already made is never made again: the daemon would renew it with the exporter's
    current instance, and so hide that the job lost the memory it mapped before.
    """
    made = {(i.node, s) for i in done for s in i.sources}
    return [(i, s) for i in wanted for s in i.sources if (i.node, s) not in made]


async def import_all(
    store: Store, domain_uid: str, job: str, timeout_s: float, done: Sequence[Importer] = ()
) -> list[Importer]:
    """Make every member import from every other member of its clique; returns who imports what.

    Pairs in `done` (imports made earlier, e.g. before the job grew) are left alone. An import
    needs the importer's link to the exporter to be up: retried (with backoff) until the
    deadline, then TimeoutError naming what is still missing.
    """
    importers = expected_imports(await _members(store, domain_uid))
    pending = {(i.node, s): i for i, s in missing_pairs(importers, done)}
    backoff = Backoff(initial=0.05, cap=1.0)
    last_error: dict[tuple[str, int], str] = {}
    try:
        async with asyncio.timeout(timeout_s):
            while pending:
                results = await asyncio.gather(
                    *(_import_one(i, job, source) for (_, source), i in pending.items()),
                )
                for key, error in zip(list(pending), results, strict=True):
                    if error is None:
                        del pending[key]
                    else:
                        last_error[key] = error
                if pending:
                    await asyncio.sleep(backoff.next_delay())
    except TimeoutError:
        missing = ", ".join(
            f"{node} <- node ID {source}: {last_error.get((node, source), '?')}" for node, source in pending
        )
        raise TimeoutError(f"imports not made within {timeout_s:.0f}s: {missing}") from None
    return importers


async def _import_one(importer: Importer, job: str, source: int) -> str | None:
    try:
        await simclient.import_memory(
            importer.address, imexcfg.DEFAULT_CMD_PORT, job, source, timeout_s=QUERY_TIMEOUT_S
        )
    except (simclient.DaemonUnavailable, simclient.CommandRejected) as exc:
        return str(exc)
    return None


async def check(job: str, importers: Sequence[Importer]) -> ImportReport:
    """Ask every daemon that imported for the job whether its imports are all still valid."""

    async def listing(importer: Importer) -> list[simclient.Import] | None:
        try:
            return await simclient.list_imports(
                importer.address, imexcfg.DEFAULT_CMD_PORT, timeout_s=QUERY_TIMEOUT_S
            )
        except simclient.DaemonUnavailable:
            return None

    found = await asyncio.gather(*(listing(i) for i in importers))
    valid = 0
    problems: list[str] = []
    for importer, imports in zip(importers, found, strict=True):
        ok, wrong = judge(job, importer, imports)
        valid += ok
        problems += wrong
    return ImportReport(sum(len(i.sources) for i in importers), valid, tuple(problems))
