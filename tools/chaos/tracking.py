"""What the soak keeps about its run: its options, its cluster, the jobs it started, the domains it
deleted (pure data), and how a controller failover is timed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from libs.state.store import Store
from tools.cdsim.job_book import Importer, Job
from tools.cdsim.layout import StateLayout
from tools.chaos.job_ops import JobSpec
from tools.sim.hardware.cluster import ClusterDescription


@dataclass(frozen=True)
class SoakOptions:
    duration_s: float
    seed: int
    racks: int = 2
    trays: int = 18
    address_block: int = 60
    state_dir: Path | None = None
    prepare_deadline_s: float = 45.0
    settle_s: float = 60.0
    quiesce_every: tuple[int, int] = (60, 110)
    step_delay_s: tuple[float, float] = (0.4, 2.0)
    keep_up: bool = False  # leave the cluster running after a failure, for a look
    echo: bool = True  # print events as they happen


@dataclass(frozen=True)
class ClusterHandle:
    """What the soak reaches of its running cluster: its files, its nodes and its store."""

    layout: StateLayout
    cluster: ClusterDescription
    store: Store

    def node_address(self, node: str) -> str:
        return self.cluster.node(node).address


@dataclass
class Tracked:
    spec: JobSpec
    state: str  # submitting | running | failed | deleting | broken
    job: Job | None = None
    # Invariant 6: since when faults on its nodes count against the job (its submission, or the
    # re-import at a quiescence), and who imported what (empty: no imports yet, or one member).
    armed_s: float = 0.0
    importers: tuple[Importer, ...] = ()
    exempt_noted: bool = False


@dataclass
class DeletedDomain:
    uid: str
    claim_uids: tuple[str, ...]
    what: str


def failover_time(killed_at: float, led_at: float, etcd_back_at: Sequence[float]) -> tuple[float, int]:
    """Seconds the takeover took against its bound, and how many etcd restarts ended meanwhile.

    The bound runs from the kill, or from the end of the last etcd restart before the new leader
    took over: etcd gives every lease its full TTL again when it comes back (etcd-io/etcd#9395),
    so the dead leader's lease outlives that restart by one TTL."""
    restarts = [t for t in etcd_back_at if killed_at < t < led_at]
    return led_at - max([killed_at, *restarts]), len(restarts)
