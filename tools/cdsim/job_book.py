"""The jobs submitted with `cdsim job submit`, kept in `<state dir>/jobs.json`.

Later commands (`job delete`, `status`, `fault`, the tests) need to know which claims belong to
which job. The file is replaced atomically, and every read-modify-write holds an advisory lock,
so concurrent `cdsim` commands do not lose each other's jobs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from libs.fsio.atomic import write_atomic

JOBS_FILE_VERSION = 1


@dataclass(frozen=True)
class ClaimRecord:
    uid: str
    name: str
    namespace: str
    node: str


@dataclass(frozen=True)
class Importer:
    """One member daemon of a job and the node IDs it imported memory from."""

    node: str
    address: str
    sources: tuple[int, ...]


@dataclass(frozen=True)
class Job:
    name: str
    namespace: str
    domain_uid: str
    num_nodes: int
    allocation_mode: str  # Single | All
    # submitting | running | failed | deleting
    state: str
    created_unix_ms: int
    claims: tuple[ClaimRecord, ...] = ()
    reservation_id: str = ""
    # Who imported what once the domain was Ready (empty: the workload has not run).
    importers: tuple[Importer, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def nodes(self) -> list[str]:
        return [c.node for c in self.claims]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["claims"] = [asdict(c) for c in self.claims]
        data["importers"] = [asdict(i) for i in self.importers]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Job:
        claims = tuple(ClaimRecord(**c) for c in data.get("claims", []))
        importers = tuple(
            Importer(i["node"], i["address"], tuple(i["sources"])) for i in data.get("importers", [])
        )
        fields = {
            k: v
            for k, v in data.items()
            if k in cls.__dataclass_fields__ and k not in ("claims", "importers")
        }
        return cls(**fields, claims=claims, importers=importers)


@dataclass
class JobList:
    jobs: list[Job] = field(default_factory=list)

    def find(self, namespace: str, name: str) -> Job | None:
        return next((j for j in self.jobs if j.key == (namespace, name)), None)

    def put(self, job: Job) -> None:
        self.jobs = [j for j in self.jobs if j.key != job.key] + [job]

    def remove(self, namespace: str, name: str) -> None:
        self.jobs = [j for j in self.jobs if j.key != (namespace, name)]


class JobBook:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")

    def read(self) -> JobList:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return JobList()
        except ValueError as exc:
            raise ValueError(f"{self.path} is not readable JSON: {exc}") from exc
        if doc.get("version") != JOBS_FILE_VERSION:
            raise ValueError(f"{self.path} has version {doc.get('version')!r}, want {JOBS_FILE_VERSION}")
        return JobList([Job.from_dict(j) for j in doc.get("jobs", [])])

    def _write(self, jobs: JobList) -> None:
        doc = {"version": JOBS_FILE_VERSION, "jobs": [j.to_dict() for j in jobs.jobs]}
        write_atomic(self.path, json.dumps(doc, indent=2, sort_keys=True).encode())

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.lock_path, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def update(self, change: Callable[[JobList], None]) -> JobList:
        with self._locked():
            jobs = self.read()
            change(jobs)
            self._write(jobs)
            return jobs
